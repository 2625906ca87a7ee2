"""A disk cache of judge answers, keyed by the exact request, so re-scoring a group is free.

One JSON file per request under `<dir>/<key[:2]>/<key>.json`, where the key is the SHA-256 of the
request (judge, messages, rubric, response format and the sampling arguments). Entries are written
to a temporary file and renamed into place, so a crash or a concurrent writer never leaves a
half-written entry; an unreadable entry is treated as a miss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """`$ART_HOME/ruler`, else `$XDG_CACHE_HOME/art/ruler`, else `~/.cache/art/ruler`."""
    if "ART_HOME" in os.environ:
        return Path(os.environ["ART_HOME"]).expanduser() / "ruler"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "art" / "ruler"


def request_key(request: dict[str, Any]) -> str:
    """A stable hash of a JSON-like request (key order does not matter)."""
    text = json.dumps(request, sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _path(cache_dir: Path, key: str) -> Path:
    return cache_dir / key[:2] / f"{key}.json"


def read(cache_dir: Path, key: str) -> dict[str, Any] | None:
    path = _path(cache_dir, key)
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("ruler cache: ignoring unreadable entry %s (%s)", path, e)
        return None


def write(cache_dir: Path, key: str, value: dict[str, Any]) -> None:
    path = _path(cache_dir, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(value, f, ensure_ascii=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
