"""The in-process trainers of a `LocalBackend`, and a step committed as one unit.

- All torch work runs on one thread. Each thread that runs torch ops gets its own OpenMP team,
  and with more teams than cores libgomp stops spinning between parallel regions: measured,
  SmolLM2 trainer steps took 2.1-2.3 s on one thread, 3.0-3.4 s when steps went to the default
  executor's threads in turn.
- A trainer (a copy of the base weights, the LoRA and its optimizer) stays loaded between
  steps, up to `in_memory` of them; the least recently used beyond that is dropped and reloaded
  from its checkpoint when it trains again.
- `train_and_save` trains from the latest checkpoint and commits the new step as one unit
  (storage.ModelDir.commit_checkpoint): the adapter, the optimizer moments, the request that
  asked for it and its metrics, in a temp directory renamed into place. If anything fails after
  the optimizer step, the trainer is dropped, so the next step starts from the last committed
  checkpoint, not from weights nobody saved (the "rollback").
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from art_core.base_models import base_model_limits, resolve_base_model
from art_core.config import SFTConfig, TrainConfig
from art_core.failpoints import failpoint
from art_core.model import TrainableModel
from art_core.storage import ModelDir
from art_core.trajectory import TrajectoryGroup

T = TypeVar("T")
log = logging.getLogger(__name__)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op CPU threads set to `n` (None: unchanged) on this thread, restored
    after. All torch work runs on the trainer's one thread, so no other work sees it."""
    if n is None:
        yield
        return
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def save_probe(trainer: Any, checkpoint: Path, step: int) -> None:
    """The served-policy check's manifest (art_core/train/probe.py). Never fails the step: a
    checkpoint without it is published unchecked (metric `policy_checked` 0)."""
    try:
        trainer.save_probe(checkpoint)
    except Exception as e:
        log.warning("step %d: no served-policy probe (%s: %s); it is published unchecked",
                    step, type(e).__name__, e)


def free_memory() -> None:
    """Return a dropped trainer's memory (its tensors are freed once unreferenced)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


class Trainers:
    """The trainers of one backend's models, on one torch thread, least recently used first."""

    def __init__(self, root: Path, in_memory: int, train_processes: int,
                 device: str | None = None) -> None:
        self.root = root
        self.in_memory = in_memory
        self.train_processes = train_processes
        self.device = device  # None: the trainer's own choice (cuda if available, else cpu)
        self.cached: dict[tuple[str, str], Any] = {}  # (project, name) -> Trainer
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="art-trainer")

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run `fn(*args)` on the torch thread."""
        return self._thread.submit(fn, *args)

    def _dir(self, model: TrainableModel) -> ModelDir:
        return ModelDir(self.root, model.project, model.name)

    def get(self, model: TrainableModel) -> Any:
        """The model's trainer, loaded from its latest checkpoint if it is not in memory."""
        key = (model.project, model.name)
        with self._lock:
            trainer = self.cached.pop(key, None)
        if trainer is None:
            from art_core.train.trainer import Trainer

            trainer = Trainer(resolve_base_model(model.base_model), model.config.lora,
                              device=self.device)
            md = self._dir(model)
            step = md.latest_step()
            if step is not None:
                trainer.load_adapter(md.checkpoint(step))
                trainer.load_optimizer(md.optimizer(step), TrainConfig(), checkpoint=step)
        with self._lock:
            self.cached[key] = trainer  # now the most recently used
            evicted = list(self.cached)[:-self.in_memory]
            for old in evicted:  # their checkpoints and optimizer files are on disk
                del self.cached[old]
        if evicted:
            free_memory()
        return trainer

    def drop(self, model: TrainableModel) -> None:
        """Forget the model's trainer (stale once other processes trained a step, or after a
        step that failed half-way) and free its memory: the next step reloads the latest
        checkpoint."""
        with self._lock:
            if self.cached.pop((model.project, model.name), None) is None:
                return
        free_memory()

    def write_step_zero(self, model: TrainableModel) -> None:
        """Checkpoint 0: a fresh LoRA (B = 0, so step 0 serves what the base model does)."""
        md = self._dir(model)
        trainer = self.get(model)
        tmp = md.temp_checkpoint(0)
        trainer.save_adapter(tmp)
        save_probe(trainer, tmp, 0)  # registration checks that vLLM serves the base as trained
        md.commit_checkpoint(tmp, 0, {"kind": "init", "request_id": None, "metrics": {}})
        if self.train_processes > 1:  # the ranks load their own; free its memory
            self.drop(model)

    def train_and_save(self, model: TrainableModel, groups: list[TrajectoryGroup],
                       config: TrainConfig | SFTConfig, step: int,
                       request_id: str | None = None, threads: int | None = None
                       ) -> dict[str, float]:
        """Train `step` from the latest checkpoint and commit it (see the module docstring);
        returns the step's metrics (Trainer.step's or sft_step's, plus save_seconds). A
        TrainConfig trains a GRPO step on `groups`, an SFTConfig a supervised step on their
        trajectories (the step's `kind`, "rl" or "sft", is recorded with it). `groups` must be
        journaled as `step` already: with train_processes > 1 the ranks read them there.
        `threads`: torch's CPU threads for this step (None: unchanged), e.g. the cores the
        engine leaves free while it keeps serving."""
        md = self._dir(model)
        sft = isinstance(config, SFTConfig)
        kind = "sft" if sft else "rl"
        if sft and self.train_processes > 1:
            raise ValueError("SFT trains in one process: use a backend with train_processes=1")
        if self.train_processes > 1:
            from art_core.train.distributed import run_distributed_step

            self.drop(model)
            # a failed rank raises RuntimeError: nothing committed, the journal kept for replay
            return run_distributed_step(md, step, resolve_base_model(model.base_model),
                                        model.config.lora, config, self.train_processes,
                                        request_id=request_id, kind=kind)
        trainer = self.get(model)
        try:
            with torch_threads(threads):
                if sft:
                    from art_core.train.sft import sft_step

                    examples = [t for g in groups for t in g.trajectories]
                    limit = base_model_limits(model.base_model).context
                    raw = sft_step(trainer, examples, config, limit)
                else:
                    raw = trainer.step(groups, config)
                metrics = {k: float(v) for k, v in raw.items()}
            failpoint("trained", step)
            t0 = time.perf_counter()
            tmp = md.temp_checkpoint(step)
            trainer.save_adapter(tmp)
            trainer.save_optimizer(tmp / "optimizer.safetensors", checkpoint=step)
            save_probe(trainer, tmp, step)  # what this step says, for the served-policy check
            metrics["save_seconds"] = time.perf_counter() - t0
            md.commit_checkpoint(tmp, step, {"kind": kind, "request_id": request_id,
                                             "metrics": metrics})
            failpoint("committed", step)
        except BaseException:
            # the optimizer step may have changed the weights in memory: forget them, so the
            # next step starts from the last committed checkpoint and its moments
            self.drop(model)
            md.remove_partial_checkpoints()
            raise
        return metrics
