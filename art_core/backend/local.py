"""`LocalBackend`: engine, gateway and trainer in this process. The whole RL loop:

    rollouts (through the gateway) -> backend.train(model, groups):
      0. refuse what cannot train: an unregistered model, a non-finite reward, a sequence
         longer than the trainer's limit, a disk without room for the step; answer a
         request id whose step is committed already with that step (never train twice)
      1. journal the groups to <model>/journal/<step>.jsonl   (a crash loses no rollout)
      2. close the gateway's gate; wait for running requests     (inference waits)
      3. vLLM sleeps (CUDA only: the trainer gets the memory)
      4. Trainer.step: one GRPO step from the latest checkpoint
         (train_processes > 1: torchrun ranks train the journaled groups instead)
      5. commit checkpoints/<step>: adapter, optimizer, request id, metrics, one atomic rename
      6. vLLM wakes, loads it as "name@step", "name" now means step   (a new dir per step)
      7. append metrics to history.jsonl; open the gate              (inference resumes)
      8. hand the step to the loggers (art_core.observe: W&B, Langfuse if configured)

With `keep_serving` (dedicated devices: the trainer does not share the engine's), steps 2-3
are skipped: the engine serves the previous step while this one trains, and the gate closes
only around step 6, the swap.

The step itself (1-8) runs in art_core/backend/step.py. A step that fails for a reason a retry
cannot fix (bad data, a NaN gradient) marks its journal failed, so `replay_interrupted` does not
retry it forever; one killed or cut short (a crash, a full disk, a dead rank) stays interrupted
and replays. A `train()` that is cancelled leaves its
step to finish (or fail) on its own and never leaks the model's lock.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from art_core.backend.orphans import Orphans, call_key
from art_core.backend.step import run_step
from art_core.backend.trainers import Trainers
from art_core.base_models import base_model_limits, resolve_base_model
from art_core.config import SFTConfig, TrainConfig
from art_core.inference.engine import VLLMEngine
from art_core.inference.gateway import Gateway
from art_core.inference.gateway_server import GatewayServer
from art_core.model import Endpoint, TrainableModel, TrainResult
from art_core.observe.base import SPLIT_TRAIN, Logger, StepRecord, group_metrics
from art_core.observe.loggers import Loggers
from art_core.storage import ModelDir
from art_core.trajectory import (
    Trajectory,
    TrajectoryGroup,
    check_groups,
    check_sequence_lengths,
)

log = logging.getLogger(__name__)

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


async def acquire(lock: threading.Lock) -> None:
    """Take a thread lock from async code without blocking the loop. Polls instead of
    waiting in a thread: a thread cannot be cancelled, and one that got the lock after its
    caller was cancelled would hold it forever."""
    while not lock.acquire(blocking=False):
        await asyncio.sleep(0.02)


class LocalBackend:
    """Runs inference (vLLM behind our gateway) and training (peft) on this machine."""

    def __init__(self, path: str | Path = ".art", *, host: str = "127.0.0.1", port: int = 0,
                 gateway: Gateway | None = None, loggers: list[Logger] | None = None,
                 train_processes: int = 1, trainers_in_memory: int = 2,
                 api_key: str | None = None, max_body_bytes: int | None = None,
                 train_device: str | None = None) -> None:
        """`host`, `port`, `api_key`, `max_body_bytes`: where the gateway listens, and its
        guard (ARCHITECTURE invariant 8, as for `art serve`): a non-loopback `host` needs an
        `api_key` (refused here, before anything starts), every request a body under the limit
        (default 64 MiB); registered models' clients send the key.

        `loggers`: extra loggers besides the run directory and those the environment turns
        on (W&B, Langfuse: see art_core.observe.loggers).

        `trainers_in_memory`: how many models keep their trainer (a copy of the base weights,
        the LoRA and its optimizer) loaded between steps; the least recently used one beyond
        that is dropped and reloaded from its checkpoint when it trains again (seconds).

        `train_processes`: data-parallel ranks per training step (art_core/train/distributed.py;
        on CUDA one per GPU, at most the visible GPUs). The default 1 trains in this process
        and keeps the model loaded between steps; N > 1 starts N fresh torchrun processes for
        every step, each loading the base model and the latest checkpoint again (seconds to
        tens of seconds), which pays off only when the step itself dominates: several GPUs and
        large batches. On CPU the ranks split the cores, so it is for checking, not speed.

        `train_device`: where the in-process trainer runs (default: "cuda" if available, else
        "cpu"). A CUDA device the engines do not use (index >= the GPUs vLLM takes) makes
        training *dedicated*: `train()` keeps serving while it trains (see the module
        docstring; `dedicated_training`). Not measured yet: no GPU host has run it."""
        if gateway is None:
            from art_core.inference.guard import check_bind

            check_bind(host, api_key)  # before anything starts
        self.api_key, self._max_body_bytes = api_key, max_body_bytes
        self.root = Path(path).resolve()
        self.trainers = Trainers(self.root, _positive_int("trainers_in_memory",
                                                          trainers_in_memory),
                                 check_train_processes(train_processes), device=train_device)
        self.loggers = Loggers(self.root, loggers)
        self.gateway = gateway or Gateway()
        self._server: GatewayServer | None = None
        self._external_loop = gateway is not None  # `art serve` runs the gateway itself
        self._host, self._port = host, port
        self._engines: dict[str, VLLMEngine] = {}
        self._registered: set[tuple[str, str]] = set()
        self._model_locks: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()
        self._steps: set[asyncio.Task[Any]] = set()  # running steps, whoever awaits them
        self._orphans = Orphans()  # steps whose caller was cancelled: a retry gets them

    @property
    def train_processes(self) -> int:
        return self.trainers.train_processes

    @train_processes.setter
    def train_processes(self, n: int) -> None:
        self.trainers.train_processes = check_train_processes(n)

    @property
    def dedicated_training(self) -> bool:
        """True when the trainer runs on a device no engine uses (a CUDA device past the
        GPUs vLLM takes), so inference need not wait while a step trains."""
        device = self.trainers.device or ""
        if not device.startswith("cuda:") or self.train_processes > 1:
            return False
        taken = max((e.config.tensor_parallel_size * e.config.data_parallel_size
                     for e in self._engines.values()), default=1)
        return int(device.split(":", 1)[1]) >= taken

    # ---- lifecycle -------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError("the backend has no gateway running yet: register a model first")
        return self._server.base_url

    def _ensure_gateway(self) -> None:
        if self._server is None and not self._external_loop:
            from art_core.inference.guard import DEFAULT_MAX_BODY_BYTES, guarded

            app = guarded(self.gateway.app, host=self._host, api_key=self.api_key,
                          max_body_bytes=self._max_body_bytes or DEFAULT_MAX_BODY_BYTES)
            self._server = GatewayServer(self.gateway, self._host, self._port, app=app)
            self._server.start()

    async def _on_gateway(self, fn: Any) -> Any:
        """Run an async gateway operation in the gateway's own loop."""
        if self._server is None:  # `art serve`: the gateway shares the caller's loop
            return await fn()
        return await self._server.call(fn)

    async def close(self) -> None:
        """Let running steps finish, then stop vLLM and the gateway. Checkpoints and history
        stay on disk."""
        if self._steps:
            await asyncio.wait(list(self._steps))
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

    def _check_registered(self, model: TrainableModel) -> None:
        if (model.project, model.name) not in self._registered:
            raise ValueError(f"model {model.project}/{model.name} is not registered with this "
                             "backend: await model.register(backend) first (is the name "
                             "spelled as when it was registered?)")

    async def register(self, model: TrainableModel) -> Endpoint:
        """Start (or reuse) the engine for the model's base; create step 0 if the model is new;
        serve the latest complete step. A registration that fails leaves nothing served and,
        for a new model, nothing on disk."""
        md = self._dir(model)
        new = not md.path.exists()
        try:
            await asyncio.to_thread(self._register_sync, model)
            step = md.latest_step()
            assert step is not None
            engine = self._engines[model.base_model]
            checkpoints = {s: md.checkpoint(s) for s in md.steps()}
            await self._on_gateway(lambda: self.gateway.publish(
                model.name, engine, step, md.checkpoint(step), project=model.project,
                checkpoints=checkpoints, tolerance=model.config.engine.policy_check_tolerance))
        except BaseException:
            if (model.project, model.name) not in self._registered:
                await self._on_gateway(lambda: self.gateway.forget_model(model.name))
                if new:
                    shutil.rmtree(md.path, ignore_errors=True)
            raise
        self._registered.add((model.project, model.name))
        return Endpoint(base_url=self.base_url if self._server else "",
                        api_key=self.api_key if self._server else None)

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
            self._check_engine_fits(model, engine)
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
                self.trainers.submit(self.trainers.write_step_zero, model).result()
            repaired = md.repair_history()  # steps committed just before a crash
            if repaired:
                log.warning("%s/%s: history rows of steps %s rebuilt from their checkpoints",
                            model.project, model.name, repaired)

    def _check_engine_fits(self, model: TrainableModel, engine: VLLMEngine) -> None:
        """Refuse, naming the setting, a model the running engine cannot serve as asked."""
        if model.config.lora.rank > engine.max_lora_rank:
            raise ValueError(
                f"model {model.name!r} has LoRA rank {model.config.lora.rank}, but the engine of "
                f"{model.base_model!r} was started for ranks up to {engine.max_lora_rank} (by "
                "the first model registered on it): use rank <= that, or a backend of its own")
        conflicts = model.config.engine.conflicts(engine.config)
        if conflicts:
            raise ValueError(
                f"model {model.name!r} asks for {'; '.join(conflicts)}: the engine of "
                f"{model.base_model!r} is already running, and its settings cannot change. "
                "Register with the same EngineConfig, or use a backend of its own")

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
        try:
            engine.start()
        except BaseException:
            if engine.state != "ready":  # a failed first start: a corrected config may retry
                with self._lock:
                    if self._engines.get(model.base_model) is engine:
                        del self._engines[model.base_model]
                        self.gateway.engines.pop(engine.served_name, None)
            raise
        return engine

    async def get_step(self, model: TrainableModel) -> int:
        step = self._dir(model).latest_step()
        if step is None:
            raise RuntimeError(f"model {model.project}/{model.name} has no checkpoint: register it")
        return step

    # ---- training --------------------------------------------------------------------------

    def sequence_limit(self, model: TrainableModel, config: TrainConfig) -> int | None:
        """The longest sequence a step of `model` may train (see TrainConfig)."""
        if config.max_sequence_tokens is not None:
            return config.max_sequence_tokens
        return base_model_limits(model.base_model).context

    async def train(self, model: TrainableModel, groups: list[TrajectoryGroup],
                    config: TrainConfig | None = None, *,
                    progress: Callable[[dict[str, Any]], None] | None = None,
                    request_id: str | None = None,
                    keep_serving: bool | None = None) -> TrainResult:
        """One GRPO step on `groups`; returns the new step and its metrics.

        `progress`, if given, is called with one event per phase: {"phase": "journaled" |
        "paused" | "trained" | "published" | "done", "step": N, ...} (the server streams them).
        `request_id` is recorded with the committed step: a call with the id of a committed
        step returns that step's result instead of training again.
        `keep_serving`: serve the previous step while this one trains and hold requests only
        for the swap (dedicated devices); False holds them for the whole step (one device:
        the engine and the trainer share it); None: `dedicated_training`."""
        config = config or TrainConfig()
        groups = check_groups(groups)
        self._check_registered(model)
        check_sequence_lengths(groups, await asyncio.to_thread(self.sequence_limit, model,
                                                                config))
        def key() -> str:
            return call_key("rl", model.project, model.name, config, groups)

        # a retry of a call cancelled after its step started: that step, not a second one
        orphan = self._orphans.claim(key)
        if orphan is not None:
            return await self._orphans.wait(orphan, key)
        lock = self._model_lock(model)
        await acquire(lock)  # two trainers of one model: one after the other; cancelled
        # while waiting here, the step never starts
        if keep_serving is None:
            keep_serving = self.dedicated_training
        task = asyncio.ensure_future(run_step(self, lock, model, groups, config,
                                              progress or (lambda event: None), request_id,
                                              keep_serving))
        self._steps.add(task)
        task.add_done_callback(self._steps.discard)
        # cancelling the caller does not cut the step in half: it finishes, frees the lock,
        # and a retry of the same call is answered with it (art_core/backend/orphans.py)
        return await self._orphans.wait(task, key)

    async def train_sft(self, model: TrainableModel,
                        data: list[Trajectory | TrajectoryGroup] | str | Path,
                        config: SFTConfig | None = None, *,
                        progress: Callable[[dict[str, Any]], None] | None = None,
                        request_id: str | None = None) -> TrainResult:
        """One supervised step on `data` (trajectories, groups, or a JSONL file in the
        OpenAI fine-tuning chat format): the same adapter, checkpoints, step numbering, gate
        and swap as `train`, journaled and resumable alike (art_core/train/sft.py)."""
        from art_core.sft.data import as_trajectories

        config = config or SFTConfig()
        examples = await asyncio.to_thread(as_trajectories, data)
        self._check_registered(model)
        if self.train_processes > 1:
            raise ValueError("SFT trains in one process: use a backend with train_processes=1")
        groups = [TrajectoryGroup(trajectories=examples)]

        def key() -> str:
            return call_key("sft", model.project, model.name, config, groups)

        orphan = self._orphans.claim(key)
        if orphan is not None:
            return await self._orphans.wait(orphan, key)
        lock = self._model_lock(model)
        await acquire(lock)
        task = asyncio.ensure_future(run_step(
            self, lock, model, groups, config, progress or (lambda event: None), request_id,
            False))
        self._steps.add(task)
        task.add_done_callback(self._steps.discard)
        return await self._orphans.wait(task, key)

    async def _resume(self) -> None:
        self.gateway.resume()

    async def log(self, model: TrainableModel, groups: list[TrajectoryGroup],
                  split: str = "val") -> None:
        """Record groups that are not trained on (e.g. validation) at the model's current step:
        in `<model>/<split>/` and in the configured loggers."""
        if split == SPLIT_TRAIN:
            raise ValueError("train groups are logged by train(); use another split, e.g. 'val'")
        groups = check_groups(groups)
        self._check_registered(model)
        step = await self.get_step(model)
        md = self._dir(model)
        self.loggers.log_step(StepRecord(model.project, model.name, step, split,
                                         group_metrics(groups), groups, model.base_model,
                                         md.checkpoint(step)))

    async def replay_interrupted(self, model: TrainableModel,
                                 config: TrainConfig | None = None) -> list[TrainResult]:
        """Train again the journaled groups of steps that were interrupted (e.g. killed). A
        journal that cannot be read any more is marked failed (kept, not replayed)."""
        md = self._dir(model)
        results = []
        for step in md.interrupted_steps():
            try:
                groups = md.journaled(step)
                if groups:
                    check_groups(groups)
            except (ValueError, TypeError) as e:
                md.mark_failed(step, f"the journal cannot be replayed: {e}")
                log.warning("%s/%s: journaled step %d cannot be replayed (%s); marked failed",
                            model.project, model.name, step, e)
                continue
            if not groups:
                continue
            sft = md.journaled_sft_config(step)
            if sft is not None:  # an interrupted SFT step trains as SFT again
                results.append(await self.train_sft(model, groups, sft))
            else:
                results.append(await self.train(model, groups, config))
        return results

    async def delete_checkpoints(self, model: TrainableModel,
                                 best_checkpoint_metric: str = "reward_mean") -> list[int]:
        """Delete all checkpoints but the latest and the best by `best_checkpoint_metric`.
        They are unloaded from the engine first, then removed from disk."""
        md = self._dir(model)
        if not md.path.is_dir():
            raise ValueError(f"model {model.project}/{model.name} does not exist in {self.root}")
        lock = self._model_lock(model)
        await acquire(lock)  # never while a step of this model is saving
        try:
            deleted = md.deletable_steps(best_checkpoint_metric)
            await self._on_gateway(lambda: self.gateway.forget_checkpoints(model.name, deleted))
            for step in deleted:
                md.remove_checkpoint(step)
        finally:
            lock.release()
        return deleted

    def checkpoint_dir(self, model: TrainableModel, step: int) -> Path:
        return self._dir(model).checkpoint(step)

    def remove_model(self, model: TrainableModel) -> None:
        shutil.rmtree(self._dir(model).path, ignore_errors=True)
