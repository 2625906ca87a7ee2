"""Where a run's steps go: the run directory always, Weights & Biases and Langfuse when configured.

The backend calls `Loggers.log_step(StepRecord)` once per training step (split "train": the
step's metrics and the groups it trained on) and `TrainableModel.log(groups, split="val")` (or
`gather_trajectory_groups(..., log_to=model)`) records evaluation groups at the model's current
step. Every logger receives the same `StepRecord`: metrics, groups with rewards, RULER's
explanations (in each trajectory's `logs`) and the rollouts' exceptions.

- `RunDirLogger` (always on) writes what the backend does not already: the groups and metrics of
  other splits under `<model>/<split>/` (train groups are the journal, train metrics history.jsonl).
- `WandbLogger` (art_core.observe.wandb_logger) and `LangfuseLogger` (art_core.observe.langfuse_logger) are off
  unless configured by argument or environment (WANDB_API_KEY or WANDB_MODE=offline with
  WANDB_PROJECT; LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY). Their SDKs load only then.

A logger that fails (no network, a bad key, a server that errors) never stops or stalls training:
optional loggers run in one background thread, any exception is caught, and the first failure of
each logger is logged as one warning; later failures are only counted (`Loggers.failures`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from art_core.observe.base import SPLIT_TRAIN, Logger, StepRecord

log = logging.getLogger(__name__)

class RunDirLogger(Logger):
    """The always-on default: the run directory (what the viewer reads)."""

    name = "run-dir"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def log_step(self, record: StepRecord) -> None:
        from art_core.storage import ModelDir, append_jsonl

        if record.split == SPLIT_TRAIN:
            return  # the backend journals the groups before the step and writes history.jsonl
        md = ModelDir(self.root, record.project, record.model)
        split_dir = md.split_dir(record.split)
        split_dir.mkdir(parents=True, exist_ok=True)
        # several evaluations at one step add up: append, one group per line
        with (split_dir / f"{record.step:04d}.jsonl").open("a", encoding="utf-8") as f:
            for g in record.groups:
                f.write(g.model_dump_json() + "\n")
        append_jsonl(split_dir / "history.jsonl", {"step": record.step, **record.metrics})


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def optional_loggers_from_env(env: dict[str, str] | None = None) -> list[Logger]:
    """The optional loggers the environment turns on (none by default).

    - W&B: WANDB_API_KEY set, or WANDB_MODE=offline; project WANDB_PROJECT (else the model's
      project); ART_WANDB_LOG_CHECKPOINTS=1 uploads checkpoints as artifacts.
    - Langfuse: LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY (host: LANGFUSE_BASE_URL or
      LANGFUSE_HOST). ART_LOGGERS=none turns both off whatever else is set.
    """
    env = dict(os.environ if env is None else env)
    if env.get("ART_LOGGERS", "").strip().lower() == "none":
        return []
    out: list[Logger] = []
    if env.get("WANDB_API_KEY") or env.get("WANDB_MODE", "").lower() == "offline":
        from art_core.observe.wandb_logger import WandbLogger

        out.append(WandbLogger(project=env.get("WANDB_PROJECT") or None,
                               entity=env.get("WANDB_ENTITY") or None,
                               log_checkpoints=_truthy(env.get("ART_WANDB_LOG_CHECKPOINTS"))))
    if env.get("LANGFUSE_PUBLIC_KEY") and env.get("LANGFUSE_SECRET_KEY"):
        from art_core.observe.langfuse_logger import LangfuseLogger

        out.append(LangfuseLogger(
            public_key=env["LANGFUSE_PUBLIC_KEY"], secret_key=env["LANGFUSE_SECRET_KEY"],
            host=env.get("LANGFUSE_BASE_URL") or env.get("LANGFUSE_HOST") or None))
    return out


class Loggers:
    """The loggers of one backend: the run directory (synchronous: the viewer reads it) and the
    optional ones, which run in a background thread so a slow or dead service cannot stall a
    training step. Every call is guarded; a logger's first failure is one warning."""

    def __init__(self, root: str | Path | None, loggers: Iterable[Logger] | None = None, *,
                 from_env: bool = True, close_timeout_s: float = 60.0) -> None:
        self.run_dir: Logger | None = RunDirLogger(root) if root is not None else None
        extra = list(loggers or [])
        self.optional: list[Logger] = extra + (optional_loggers_from_env() if from_env else [])
        self.failures: dict[str, int] = {}
        self.close_timeout_s = close_timeout_s
        # items: a record to log, an Event to set once what came before is done, None to stop
        self._queue: queue.Queue[StepRecord | threading.Event | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def all(self) -> list[Logger]:
        return ([self.run_dir] if self.run_dir else []) + self.optional

    def _guard(self, logger: Logger, what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # a logger never stops training
            with self._lock:
                n = self.failures[logger.name] = self.failures.get(logger.name, 0) + 1
            if n == 1:
                log.warning("logger %s failed (%s: %s: %s); training goes on, later failures "
                            "of this logger are not reported", logger.name, what,
                            type(e).__name__, str(e)[:300])

    def log_step(self, record: StepRecord) -> None:
        """Hand one step to every logger. Returns at once for the optional ones."""
        if self.run_dir is not None:
            self._guard(self.run_dir, "log_step", self.run_dir.log_step, record)
        if not self.optional or self._closed:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="art-loggers",
                                                daemon=True)
                self._thread.start()
        self._queue.put(record)

    def _work(self) -> None:
        while (record := self._queue.get()) is not None:
            if isinstance(record, threading.Event):
                record.set()
                continue
            for lg in self.optional:
                self._guard(lg, "log_step", lg.log_step, record)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the records queued so far were handed to every logger. False: timed out."""
        done = threading.Event()
        if self._thread is None or self._closed:
            return True
        self._queue.put(done)
        return done.wait(self.close_timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """Deliver what is queued (up to `close_timeout_s`), then close every logger."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(self.close_timeout_s)
            if self._thread.is_alive():
                log.warning("loggers did not finish within %.0f s; giving up on the rest",
                            self.close_timeout_s)
                return
        for lg in self.all:
            self._guard(lg, "close", lg.close)

