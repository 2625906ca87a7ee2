"""The run directory: where a model's checkpoints, journal and history live.

    <path>/<project>/models/<name>/
        model.json                  base model and config, written at registration
        checkpoints/0003/           one complete step, committed as a unit:
            adapter_config.json, adapter_model.safetensors   a standard peft adapter
            optimizer.safetensors   AdamW moments after this step (kept for the latest only)
            step.json               {"step", "kind", "request_id", "metrics", "committed_at"}
        journal/0003.jsonl          the groups of step 3, written before that step trains
        journal/0004.failed.jsonl   a step that failed for a reason a retry cannot fix (with
                                    0004.failed.json saying why): kept, never replayed
        val/0001.jsonl              groups logged with split "val" at step 1, and
        val/history.jsonl           their metrics, one row per log call
        history.jsonl               one row of metrics per step (rebuilt from step.json files
                                    for a step committed just before a crash)

Invariant 3 (no lost work, nothing doubled): groups are journaled before a step starts; a step
is written to a temp directory (adapter, optimizer, the request that asked for it and its
metrics), fsynced and renamed into place, so a directory named like a step is complete, and a
retried request finds the step it already produced instead of training it again.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from art_core.config import SFTConfig
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
    def legacy_optimizer(self) -> Path:
        """Where versions before step.json kept the latest optimizer state."""
        return self.path / "optimizer.safetensors"

    def optimizer(self, step: int) -> Path:
        """The optimizer state saved with checkpoint `step` (or where older versions kept
        the latest one, if the checkpoint has none)."""
        inside = self.checkpoint(step) / OPTIMIZER
        return inside if inside.exists() or not self.legacy_optimizer.exists() else \
            self.legacy_optimizer

    @property
    def legacy_requests(self) -> Path:
        """Where versions before step.json recorded answered `art serve` requests."""
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

    def commit_checkpoint(self, tmp: Path, step: int, record: dict[str, Any] | None = None
                          ) -> Path:
        """Commit step `step`: write its record (`step.json`) into the fully written temp
        directory, fsync everything in it, and rename it into place (atomic); then keep the
        optimizer state of this step only (a resume starts from the latest)."""
        final = self.checkpoint(step)
        if final.exists():
            raise FileExistsError(f"checkpoint {final} already exists")
        if record is not None:
            _write_durable(tmp / STEP_RECORD, json.dumps(
                {"step": step, "committed_at": time.time(), **record}).encode())
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        tmp.rename(final)
        _fsync_dir(self.checkpoints)
        for old in self.steps():
            if old < step:
                (self.checkpoint(old) / OPTIMIZER).unlink(missing_ok=True)
        return final

    def step_record(self, step: int) -> dict[str, Any] | None:
        """What `commit_checkpoint` recorded for `step` (None for steps without a record)."""
        try:
            return json.loads((self.checkpoint(step) / STEP_RECORD).read_text())
        except (OSError, ValueError):
            return None

    def answered(self, request_id: str) -> dict[str, Any] | None:
        """The record of the committed step a train request with this id produced, if any."""
        for step in reversed(self.steps()):
            rec = self.step_record(step)
            if rec is not None and rec.get("request_id") == request_id:
                return rec
        for row in reversed(read_jsonl(self.legacy_requests)):
            if row.get("request_id") == request_id and isinstance(row.get("step"), int):
                return row
        return None

    def history_row(self, step: int) -> dict[str, Any] | None:
        """The last history row of `step`, or None."""
        rows = [r for r in self.read_history() if r.get("step") == step]
        return rows[-1] if rows else None

    def repair_history(self) -> list[int]:
        """Append the history row of every committed step that has none (the process died
        between the commit and the history append); returns those steps."""
        have = {r.get("step") for r in self.read_history()}
        repaired = []
        for step in self.steps():
            rec = self.step_record(step)
            if step not in have and rec is not None and rec.get("kind") != "init" \
                    and "metrics" in rec:
                self.append_history({"step": step, "kind": rec.get("kind", "rl"),
                                     **rec["metrics"]})
                repaired.append(step)
        return repaired

    def check_writable(self, need_bytes: int) -> None:
        """Raise OSError (ENOSPC, or what the OS says) before a step starts if its checkpoint
        could not be written: less free space than `need_bytes`, or a directory that refuses
        a file."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.checkpoints).free
        if free < need_bytes:
            raise OSError(errno.ENOSPC, f"No space left on device: {free / 2**20:.1f} MiB free "
                          f"where a step needs about {need_bytes / 2**20:.1f} MiB",
                          str(self.checkpoints))
        probe = self.checkpoints / f".probe-{os.getpid()}"
        try:
            probe.write_bytes(b"0")
        finally:
            probe.unlink(missing_ok=True)

    def step_bytes(self) -> int:
        """About what one more step writes: the latest checkpoint's size (adapter, optimizer),
        or 64 MiB when there is none yet."""
        latest = self.latest_step()
        if latest is None:
            return 64 << 20
        size = sum(f.stat().st_size for f in self.checkpoint(latest).iterdir() if f.is_file())
        return max(size, self.legacy_optimizer.stat().st_size if
                   self.legacy_optimizer.exists() else 0) * 3 + (1 << 20)

    def write_model_json(self, data: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        _write_durable(self.path / "model.json", json.dumps(data, indent=2).encode())

    def read_model_json(self) -> dict[str, Any] | None:
        p = self.path / "model.json"
        return json.loads(p.read_text()) if p.exists() else None

    def journal_groups(self, step: int, groups: list[TrajectoryGroup],
                       sft: SFTConfig | None = None) -> Path:
        """Write the groups of `step` before it trains (replacing an earlier attempt's). An
        SFT step's config is journaled beside them (`<step>.sft.json`, first), so a replay
        trains it as SFT again."""
        marker = self.journal / f"{step:04d}.sft.json"
        if sft is not None:
            self.journal.mkdir(parents=True, exist_ok=True)
            _write_durable(marker, sft.model_dump_json().encode())
        else:
            marker.unlink(missing_ok=True)
        return write_groups_jsonl(groups, self.journal / f"{step:04d}.jsonl")

    def journaled_sft_config(self, step: int) -> SFTConfig | None:
        """The SFTConfig journaled with `step`, if it is an SFT step."""
        marker = self.journal / f"{step:04d}.sft.json"
        return SFTConfig.model_validate_json(marker.read_text()) if marker.exists() else None

    def journaled(self, step: int) -> list[TrajectoryGroup] | None:
        p = self.journal / f"{step:04d}.jsonl"
        return read_groups_jsonl(p) if p.exists() else None

    def mark_failed(self, step: int, reason: str) -> Path | None:
        """Keep the journal of a step that failed for a reason a retry cannot fix, out of
        `interrupted_steps`: `<step>.failed.jsonl` beside `<step>.failed.json` (why)."""
        p = self.journal / f"{step:04d}.jsonl"
        if not p.exists():
            return None
        tag, n = "failed", 1
        while (self.journal / f"{step:04d}.{tag}.jsonl").exists():  # an earlier failure: kept
            n += 1
            tag = f"failed-{n}"
        failed = self.journal / f"{step:04d}.{tag}.jsonl"
        _write_durable(self.journal / f"{step:04d}.{tag}.json",
                       json.dumps({"step": step, "reason": reason, "at": time.time()}).encode())
        p.replace(failed)
        return failed

    def failed_steps(self) -> dict[int, str]:
        """Steps marked failed, with why."""
        out = {}
        for p in sorted(self.journal.glob("*.failed*.json")) if self.journal.exists() else []:
            try:
                out[int(p.name.split(".")[0])] = json.loads(p.read_text()).get("reason", "")
            except (OSError, ValueError):
                continue
        return out

    def interrupted_steps(self) -> list[int]:
        """Steps whose groups were journaled but whose checkpoint never completed (steps
        marked failed excluded)."""
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

    def deletable_steps(self, best_metric: str = "reward_mean") -> list[int]:
        """All checkpoints except the latest and the best by `best_metric` (higher is better;
        the metric of step k is the one measured on the rollouts trained at step k, i.e.
        produced by checkpoint k-1)."""
        steps = self.steps()
        if len(steps) <= 1:
            return []
        keep = {steps[-1]}
        scored = [(r[best_metric], r["step"] - 1) for r in self.read_history()
                  if isinstance(r.get(best_metric), int | float) and r.get("step", 0) - 1 in steps]
        if scored:
            keep.add(max(scored)[1])
        return [s for s in steps if s not in keep]

    def remove_checkpoint(self, step: int) -> None:
        """Delete checkpoint `step` (unload it from the engine first: it may be served)."""
        shutil.rmtree(self.checkpoint(step), ignore_errors=True)


OPTIMIZER = "optimizer.safetensors"
STEP_RECORD = "step.json"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""What a checkpoint holds for users (downloads): a peft adapter directory."""


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    """Write a small file whole or not at all: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


_APPENDING = threading.Lock()


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line. A process killed mid-write leaves a torn last line; the next row
    starts on a line of its own, so it is not glued onto the torn one and lost with it.
    Appends are serialized within the process: another thread's row, half written, would look
    torn (the pipeline appends from worker threads)."""
    with _APPENDING, path.open("ab") as f:
        torn = False
        if f.tell() > 0:  # append mode: the position starts at the end
            with path.open("rb") as r:
                r.seek(-1, os.SEEK_END)
                torn = r.read(1) != b"\n"
        f.write((("\n" if torn else "") + json.dumps(row) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())  # a power loss must not leave the row half on disk


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

