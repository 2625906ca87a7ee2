"""The run directory: where a model's checkpoints, journal and history live.

    <path>/<project>/models/<name>/
        model.json                  base model and config, written at registration
        checkpoints/0000/ ...       one peft adapter directory per complete step
        journal/0001.jsonl          the groups of step 1, written before that step trains
        val/0001.jsonl              groups logged with split "val" at step 1 (art_core.observe.loggers),
        val/history.jsonl           and their metrics, one row per log call
        history.jsonl               one row of metrics per step
        requests.jsonl              `art serve` only: train requests already answered, so a
                                    client's retry after a server restart is not trained twice
        optimizer.safetensors       AdamW state of the latest step (for resume), tagged with it

Invariant 3 (no lost work): groups are journaled before a step starts; checkpoints are written
to a temp directory and renamed into place, so a directory named like a step is complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from art_core.model import validate_name
from art_core.trajectory import TrajectoryGroup, read_groups_jsonl, write_groups_jsonl

log = logging.getLogger(__name__)


class ModelDir:
    """Paths and small operations on one model's run directory."""

    def __init__(self, root: str | Path, project: str, name: str) -> None:
        self.root = Path(root)
        self.path = self.root / validate_name(project, "project name") / "models" / \
            validate_name(name, "model name")

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def journal(self) -> Path:
        return self.path / "journal"

    @property
    def history(self) -> Path:
        return self.path / "history.jsonl"

    @property
    def optimizer(self) -> Path:
        return self.path / "optimizer.safetensors"

    @property
    def requests(self) -> Path:
        return self.path / "requests.jsonl"

    def split_dir(self, split: str) -> Path:
        """Groups and metrics logged for a split other than train (e.g. "val"): `<split>/`."""
        if split in ("train", "checkpoints", "journal"):
            raise ValueError(f"{split!r} is not a split stored in its own directory")
        return self.path / validate_name(split, "split name")

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{step:04d}"

    def steps(self) -> list[int]:
        """Complete checkpoint steps, ascending. Read-only: temp directories are ignored."""
        if not self.checkpoints.exists():
            return []
        return sorted(
            int(d.name) for d in self.checkpoints.iterdir()
            if d.name.isdigit() and (d / "adapter_config.json").exists()
        )

    def remove_partial_checkpoints(self) -> list[Path]:
        """Delete temp directories left by a step killed mid-save. Call under the model lock."""
        if not self.checkpoints.exists():
            return []
        partial = [d for d in self.checkpoints.iterdir() if d.name.startswith(".tmp")]
        for d in partial:
            shutil.rmtree(d, ignore_errors=True)
        return partial

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def temp_checkpoint(self, step: int) -> Path:
        tmp = self.checkpoints / f".tmp-{step:04d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    def commit_checkpoint(self, tmp: Path, step: int) -> Path:
        """Atomically move a fully written temp directory into place as `step`."""
        final = self.checkpoint(step)
        if final.exists():
            raise FileExistsError(f"checkpoint {final} already exists")
        tmp.rename(final)
        return final

    def write_model_json(self, data: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.path / "model.json.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(self.path / "model.json")

    def read_model_json(self) -> dict[str, Any] | None:
        p = self.path / "model.json"
        return json.loads(p.read_text()) if p.exists() else None

    def journal_groups(self, step: int, groups: list[TrajectoryGroup]) -> Path:
        """Write the groups of `step` before it trains (replacing an earlier attempt's)."""
        return write_groups_jsonl(groups, self.journal / f"{step:04d}.jsonl")

    def journaled(self, step: int) -> list[TrajectoryGroup] | None:
        p = self.journal / f"{step:04d}.jsonl"
        return read_groups_jsonl(p) if p.exists() else None

    def interrupted_steps(self) -> list[int]:
        """Steps whose groups were journaled but whose checkpoint never completed."""
        latest = self.latest_step()
        if not self.journal.exists():
            return []
        return sorted(
            int(p.stem) for p in self.journal.glob("*.jsonl")
            if p.stem.isdigit() and (latest is None or int(p.stem) > latest)
        )

    def append_history(self, row: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        append_jsonl(self.history, row)

    def read_history(self) -> list[dict[str, Any]]:
        return read_jsonl(self.history)

    def delete_checkpoints(self, best_metric: str = "reward_mean") -> list[int]:
        """Delete all checkpoints except the latest and the best by `best_metric` (higher is
        better; the metric of step k is the one measured on the rollouts trained at step k,
        i.e. produced by checkpoint k-1)."""
        steps = self.steps()
        if len(steps) <= 1:
            return []
        keep = {steps[-1]}
        scored = [(r[best_metric], r["step"] - 1) for r in self.read_history()
                  if isinstance(r.get(best_metric), int | float) and r.get("step", 0) - 1 in steps]
        if scored:
            keep.add(max(scored)[1])
        deleted = [s for s in steps if s not in keep]
        for s in deleted:
            shutil.rmtree(self.checkpoint(s), ignore_errors=True)
        return deleted


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line. A process killed mid-write leaves a torn last line; the next row
    starts on a line of its own, so it is not glued onto the torn one and lost with it."""
    with path.open("ab") as f:
        torn = False
        if f.tell() > 0:  # append mode: the position starts at the end
            with path.open("rb") as r:
                r.seek(-1, os.SEEK_END)
                torn = r.read(1) != b"\n"
        f.write((("\n" if torn else "") + json.dumps(row) + "\n").encode())
        f.flush()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file (none if it does not exist). A line that does not parse (torn by
    a kill, or being appended right now) is skipped with a warning instead of hiding every row."""
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d is not a complete JSON line; skipped", path, n)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows

