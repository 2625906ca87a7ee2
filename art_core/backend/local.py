"""`LocalBackend`: engine, gateway and trainer in this process. The whole RL loop:

    rollouts (through the gateway) -> backend.train(model, groups):
      1. journal the groups to <model>/journal/<step>.jsonl   (a crash loses no rollout)
      2. close the gateway's gate; wait for running requests     (inference waits)
      3. vLLM sleeps (CUDA only: the trainer gets the memory)
      4. Trainer.step: one GRPO step from the latest checkpoint
         (train_processes > 1: torchrun ranks train the journaled groups instead, see below)
      5. save the adapter to checkpoints/.tmp-<step>, rename to checkpoints/<step>  (atomic)
      6. vLLM wakes, loads it as "name@step", "name" now means step   (a new dir per step)
      7. append metrics to history.jsonl; open the gate              (inference resumes)
      8. hand the step to the loggers (art_core.observe.loggers: W&B, Langfuse if configured)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import shutil
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from art_core.base_models import resolve_base_model
from art_core.config import TrainConfig
from art_core.inference.engine import EngineError, VLLMEngine
from art_core.inference.gateway import Gateway
from art_core.inference.gateway_server import GatewayServer
from art_core.model import Endpoint, TrainableModel, TrainResult
from art_core.observe.base import SPLIT_TRAIN, Logger, StepRecord, group_metrics
from art_core.observe.loggers import Loggers
from art_core.storage import ModelDir
from art_core.trajectory import TrajectoryGroup, check_groups

log = logging.getLogger(__name__)


def _free_memory() -> None:
    """Return a dropped trainer's memory (its tensors are freed once unreferenced)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _positive_int(name: str, n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
    return n


def check_train_processes(n: int) -> int:
    """`n` if it is a usable number of training processes: at least 1 and, on a CUDA host, at
    most the visible GPUs (one rank per GPU). Imports torch only when n > 1."""
    _positive_int("train_processes", n)
    if n > 1:
        import torch

        if torch.cuda.is_available() and n > torch.cuda.device_count():
            raise ValueError(f"train_processes={n} but {torch.cuda.device_count()} GPU(s) are "
                             "visible: one training process per GPU")
    return n


class LocalBackend:
    """Runs inference (vLLM behind our gateway) and training (peft) on this machine."""

    def __init__(self, path: str | Path = ".art", *, host: str = "127.0.0.1", port: int = 0,
                 gateway: Gateway | None = None, loggers: list[Logger] | None = None,
                 train_processes: int = 1, trainers_in_memory: int = 2) -> None:
        """`loggers`: extra loggers besides the run directory and those the environment turns
        on (W&B, Langfuse: see art_core.observe.loggers).

        `trainers_in_memory`: how many models keep their trainer (a copy of the base weights,
        the LoRA and its optimizer) loaded between steps; the least recently used one beyond
        that is dropped and reloaded from its checkpoint and optimizer file when it trains
        again (seconds). Bounds memory when one backend holds many models.

        `train_processes`: data-parallel ranks per training step (art_core/train/distributed.py;
        on CUDA one per GPU, at most the visible GPUs). The default 1 trains in this process
        and keeps the model loaded between steps; N > 1 starts N fresh torchrun processes for
        every step, each loading the base model and the latest checkpoint again (seconds to
        tens of seconds), which pays off only when the step itself dominates: several GPUs and
        large batches. On CPU the ranks split the cores, so it is for checking, not speed."""
        self.root = Path(path).resolve()
        self.train_processes = check_train_processes(train_processes)
        self.trainers_in_memory = _positive_int("trainers_in_memory", trainers_in_memory)
        self.loggers = Loggers(self.root, loggers)
        self.gateway = gateway or Gateway()
        self._server: GatewayServer | None = None
        self._external_loop = gateway is not None  # `art serve` runs the gateway itself
        self._host, self._port = host, port
        self._engines: dict[str, VLLMEngine] = {}
        # (project, name) -> Trainer, least recently used first
        self._trainers: dict[tuple[str, str], Any] = {}
        self._model_locks: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()
        # Every trainer's torch work runs on this one thread. Each thread that runs torch ops
        # gets its own OpenMP team, and with more teams than cores libgomp stops spinning
        # between parallel regions: measured, SmolLM2 trainer steps took 2.1-2.3 s on one
        # thread, 3.0-3.4 s when steps went to the default executor's threads in turn.
        self._torch_thread = ThreadPoolExecutor(1, thread_name_prefix="art-trainer")

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("the backend has no gateway running yet: register a model first")
        return self._server.base_url

    def _ensure_gateway(self) -> None:
        if self._server is None and not self._external_loop:
            self._server = GatewayServer(self.gateway, self._host, self._port)
            self._server.start()

    async def _on_gateway(self, fn: Any) -> Any:
        """Run an async gateway operation in the gateway's own loop."""
        if self._server is None:  # `art serve`: the gateway shares the caller's loop
            return await fn()
        return await self._server.call(fn)

    async def close(self) -> None:
        """Stop vLLM and the gateway. Checkpoints and history stay on disk."""
        for engine in self._engines.values():
            await asyncio.to_thread(engine.stop)
        self._engines.clear()
        if self._server is not None:
            self._server.stop()
            self._server = None
        await asyncio.to_thread(self.loggers.close)

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- models ----------------------------------------------------------------------------

    def _dir(self, model: TrainableModel) -> ModelDir:
        return ModelDir(self.root, model.project, model.name)

    def _model_lock(self, model: TrainableModel) -> threading.Lock:
        with self._lock:
            return self._model_locks.setdefault((model.project, model.name), threading.Lock())

    async def register(self, model: TrainableModel) -> Endpoint:
        """Start (or reuse) the engine for the model's base; create step 0 if the model is new;
        serve the latest complete step."""
        await asyncio.to_thread(self._register_sync, model)
        md = self._dir(model)
        step = md.latest_step()
        assert step is not None
        engine = self._engines[model.base_model]
        await self._on_gateway(lambda: self.gateway.publish(
            model.name, engine, step, md.checkpoint(step), project=model.project))
        for s in md.steps()[:-1]:  # older steps stay reachable as name@step (loaded on demand)
            self.gateway.models[model.name].checkpoints[s] = md.checkpoint(s)
        return Endpoint(base_url=self.base_url if self._server else "", api_key=None)

    def _register_sync(self, model: TrainableModel) -> None:
        md = self._dir(model)
        served = self.gateway.models.get(model.name)
        if served is not None and served.project != model.project:
            raise ValueError(
                f"a model named {model.name!r} is already served from project "
                f"{served.project!r}: the OpenAI model name must be unique per backend"
            )
        engine = self._engines.get(model.base_model)
        if engine is not None:  # refused before anything of the model is written
            try:
                engine.check_merged_owner(model.name)
            except EngineError as e:
                raise ValueError(str(e)) from None
        with self._model_lock(model):
            md.remove_partial_checkpoints()  # a step killed mid-save leaves a temp directory
            known = md.read_model_json()
            if known is not None and known.get("base_model") != model.base_model:
                raise ValueError(
                    f"model {model.project}/{model.name} already exists in {md.path} with base "
                    f"{known.get('base_model')!r}, not {model.base_model!r}: use another name"
                )
            if known is not None and known.get("lora") != model.config.lora.model_dump():
                raise ValueError(
                    f"model {model.project}/{model.name} was created with LoRA settings "
                    f"{known.get('lora')}; they cannot change to {model.config.lora.model_dump()}"
                )
            base_path = resolve_base_model(model.base_model)
            self._ensure_gateway()
            self._ensure_engine(model, base_path)
            md.write_model_json({"name": model.name, "project": model.project,
                                 "base_model": model.base_model,
                                 "lora": model.config.lora.model_dump()})
            if md.latest_step() is None:
                self._torch_thread.submit(self._write_step_zero, model).result()

    def _write_step_zero(self, model: TrainableModel) -> None:
        md = self._dir(model)
        trainer = self._trainer(model)
        tmp = md.temp_checkpoint(0)
        trainer.save_adapter(tmp)  # a fresh LoRA: B = 0, so step 0 equals the base
        md.commit_checkpoint(tmp, 0)
        if self.train_processes > 1:  # the ranks load their own; free its memory
            self._drop_trainer(model)

    def _ensure_engine(self, model: TrainableModel, base_path: str) -> VLLMEngine:
        with self._lock:
            engine = self._engines.get(model.base_model)
            if engine is None:
                log_dir = self.root / "logs"
                engine = VLLMEngine(
                    base_path, served_name=model.base_model, config=model.config.engine,
                    max_lora_rank=model.config.lora.rank,
                    log_path=log_dir / f"vllm-{Path(base_path).name}.log",
                )
                self._engines[model.base_model] = engine
                self.gateway.add_engine(engine)
        engine.start()
        return engine

    def _trainer(self, model: TrainableModel) -> Any:
        key = (model.project, model.name)
        with self._lock:
            trainer = self._trainers.pop(key, None)
        if trainer is None:
            from art_core.train.trainer import Trainer

            trainer = Trainer(resolve_base_model(model.base_model), model.config.lora)
            md = self._dir(model)
            step = md.latest_step()
            if step is not None:
                trainer.load_adapter(md.checkpoint(step))
                trainer.load_optimizer(md.optimizer, TrainConfig(), checkpoint=step)
        with self._lock:
            self._trainers[key] = trainer  # now the most recently used
            evicted = list(self._trainers)[:-self.trainers_in_memory]
            for old in evicted:  # their checkpoints and optimizer files are on disk
                del self._trainers[old]
        if evicted:
            _free_memory()
        return trainer

    def _drop_trainer(self, model: TrainableModel) -> None:
        """Forget the in-process trainer (its weights are stale once other processes trained a
        step; the next in-process step loads the latest checkpoint) and free its memory."""
        with self._lock:
            if self._trainers.pop((model.project, model.name), None) is None:
                return
        _free_memory()

    async def get_step(self, model: TrainableModel) -> int:
        step = self._dir(model).latest_step()
        if step is None:
            raise RuntimeError(f"model {model.project}/{model.name} has no checkpoint: register it")
        return step

    # ---- training --------------------------------------------------------------------------

    async def train(self, model: TrainableModel, groups: list[TrajectoryGroup],
                    config: TrainConfig | None = None, *,
                    progress: Callable[[dict[str, Any]], None] | None = None) -> TrainResult:
        """One GRPO step on `groups`; returns the new step and its metrics.

        `progress`, if given, is called with one event per phase: {"phase": "journaled" |
        "paused" | "trained" | "published" | "done", "step": N, ...} (the server streams them)."""
        config = config or TrainConfig()
        emit = progress or (lambda event: None)
        groups = check_groups(groups)
        md = self._dir(model)
        if model.base_model not in self._engines:
            raise RuntimeError(f"model {model.name!r} is not registered with this backend")
        lock = self._model_lock(model)
        await asyncio.to_thread(lock.acquire)  # two trainers of one model: one after the other
        try:
            step = (md.latest_step() or 0) + 1
            md.journal_groups(step, groups)  # before anything else: a crash loses no rollout
            emit({"phase": "journaled", "step": step, "groups": len(groups)})
            engine = self._engines[model.base_model]
            await self._on_gateway(self.gateway.pause)
            emit({"phase": "paused", "step": step})
            try:
                await asyncio.to_thread(engine.sleep)
                metrics = await asyncio.get_running_loop().run_in_executor(
                    self._torch_thread, self._train_and_save, model, groups, config, step)
                emit({"phase": "trained", "step": step, "seconds": metrics.get("seconds", 0.0)})
                t_publish = time.perf_counter()
                await asyncio.to_thread(engine.wake_up)
                await self._on_gateway(
                    lambda: self.gateway.publish(model.name, engine, step, md.checkpoint(step),
                                                 project=model.project))
                # from the end of the optimizer step until the new adapter serves requests
                metrics["publish_seconds"] = time.perf_counter() - t_publish
                metrics["swap_seconds"] = metrics["save_seconds"] + metrics["publish_seconds"]
                emit({"phase": "published", "step": step})
            finally:
                await asyncio.to_thread(engine.wake_up)
                await self._on_gateway(self._resume)
            md.append_history({"step": step, **metrics})
            self.loggers.log_step(StepRecord(
                model.project, model.name, step, SPLIT_TRAIN, {**group_metrics(groups), **metrics},
                groups, model.base_model, md.checkpoint(step)))
            emit({"phase": "done", "step": step, "metrics": metrics})
            return TrainResult(step=step, metrics=metrics)
        finally:
            lock.release()

    async def _resume(self) -> None:
        self.gateway.resume()

    def _train_and_save(self, model: TrainableModel, groups: list[TrajectoryGroup],
                        config: TrainConfig, step: int) -> dict[str, float]:
        """Train `step` from the latest checkpoint and commit checkpoint `step`; returns the
        step's metrics (Trainer.step's, plus save_seconds). `groups` must be journaled as
        `step` already: with train_processes > 1 the ranks read them from the journal."""
        if self.train_processes > 1:
            from art_core.train.distributed import run_distributed_step

            self._drop_trainer(model)
            # a failed rank raises RuntimeError: nothing committed, the journal kept for replay
            return run_distributed_step(self._dir(model), step,
                                        resolve_base_model(model.base_model),
                                        model.config.lora, config, self.train_processes)
        md = self._dir(model)
        trainer = self._trainer(model)
        metrics = trainer.step(groups, config)
        t0 = time.perf_counter()
        tmp = md.temp_checkpoint(step)
        trainer.save_adapter(tmp)
        md.commit_checkpoint(tmp, step)
        metrics["save_seconds"] = time.perf_counter() - t0
        trainer.save_optimizer(md.optimizer, checkpoint=step)
        return {k: float(v) for k, v in metrics.items()}

    async def log(self, model: TrainableModel, groups: list[TrajectoryGroup],
                  split: str = "val") -> None:
        """Record groups that are not trained on (e.g. validation) at the model's current step:
        in `<model>/<split>/` and in the configured loggers."""
        if split == SPLIT_TRAIN:
            raise ValueError("train groups are logged by train(); use another split, e.g. 'val'")
        groups = check_groups(groups)
        step = await self.get_step(model)
        md = self._dir(model)
        self.loggers.log_step(StepRecord(model.project, model.name, step, split,
                                         group_metrics(groups), groups, model.base_model,
                                         md.checkpoint(step)))

    async def replay_interrupted(self, model: TrainableModel,
                                 config: TrainConfig | None = None) -> list[TrainResult]:
        """Train again the journaled groups of steps that were interrupted (e.g. killed)."""
        results = []
        for step in self._dir(model).interrupted_steps():
            groups = self._dir(model).journaled(step)
            if groups:
                results.append(await self.train(model, groups, config))
        return results

    async def delete_checkpoints(self, model: TrainableModel,
                                 best_checkpoint_metric: str = "reward_mean") -> list[int]:
        """Delete all checkpoints but the latest and the best by `best_checkpoint_metric`."""
        md = self._dir(model)
        lock = self._model_lock(model)
        await asyncio.to_thread(lock.acquire)  # never block the loop: a train() may hold it
        try:
            deleted = md.delete_checkpoints(best_checkpoint_metric)
        finally:
            lock.release()
        self.gateway.forget_checkpoints(model.name, deleted)
        return deleted

    def checkpoint_dir(self, model: TrainableModel, step: int) -> Path:
        return self._dir(model).checkpoint(step)

    def remove_model(self, model: TrainableModel) -> None:
        shutil.rmtree(self._dir(model).path, ignore_errors=True)
