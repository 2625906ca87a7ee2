"""One training step of `LocalBackend` (steps 1-8 of its module docstring), run under the
model's lock:

    1. journal the groups (a crash loses no rollout); a request id already committed is
       answered with its step instead
    2-3. close the gateway's gate and put vLLM to sleep (not with `keep_serving`)
    4-5. the trainer's step in its thread, committed as checkpoints/<step>
    6. wake vLLM, publish the step (with the served-policy check) with the gate closed
    7. the history row, the off-policy metrics and the sampler/trainer drift warning
    8. the loggers

A failure a retry cannot fix marks the journal failed; one in `RETRYABLE` leaves it to replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from art_core.backend.trainers import Trainers
from art_core.config import SFTConfig, TrainConfig
from art_core.failpoints import failpoint
from art_core.inference.engine import EngineError, VLLMEngine
from art_core.inference.gateway import Gateway
from art_core.inference.policy_check import PolicyMismatch, replayed_mismatch
from art_core.model import TrainableModel, TrainResult
from art_core.observe.base import SPLIT_TRAIN, StepRecord, group_metrics
from art_core.observe.loggers import Loggers
from art_core.storage import ModelDir
from art_core.train.errors import RetryableStepError
from art_core.trajectory import TrajectoryGroup, off_policy_metrics

log = logging.getLogger(__name__)


class StepBackend(Protocol):
    """What a step uses of `LocalBackend` (named here, not imported: it imports this module)."""

    gateway: Gateway
    trainers: Trainers
    loggers: Loggers
    _engines: dict[str, VLLMEngine]

    def _dir(self, model: TrainableModel) -> ModelDir: ...
    async def _on_gateway(self, fn: Any) -> Any: ...
    async def _resume(self) -> None: ...

RETRYABLE = (OSError, EngineError, TimeoutError, RetryableStepError)
"""Failures a retry of the same step can get past (the journal stays for a replay)."""

DRIFT_WARN = 0.08
"""`sampler_trainer_prob_diff` above which a step warns that the policy the engine served is not
the one the trainer holds: 0.008-0.03 is normal on SmolLM2 (numerics); a served adapter that
never loaded, or logprobs of a grammar-masked distribution, measured 0.11 and more."""


def check_served_policy(metrics: dict[str, float], served_step: int, name: str) -> None:
    """Warn, naming the step, when the turns a step trains were sampled wholly by the policy
    it starts from and yet their logprobs disagree with the trainer's beyond `DRIFT_WARN`:
    what vLLM served as that step was not what was trained (a stale or missing adapter)."""
    drift = metrics.get("sampler_trainer_prob_diff")
    if drift is None or metrics.get("frac_turns_off_policy", 0.0) > 0:
        return  # older policies sampled some turns: a difference is expected there
    metrics["served_policy_drift_warning"] = float(drift > DRIFT_WARN)
    if drift > DRIFT_WARN:
        log.warning("%s: the turns sampled by step %d disagree with the trainer's step %d "
                    "(sampler_trainer_prob_diff %.3f > %.2f): the engine may not have served "
                    "checkpoint %d as trained (an adapter that did not load, a stale one)",
                    name, served_step, served_step, drift, DRIFT_WARN, served_step)


async def run_step(backend: StepBackend, lock: threading.Lock, model: TrainableModel,
                   groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig,
                   emit: Callable[[dict[str, Any]], None], request_id: str | None,
                   keep_serving: bool) -> TrainResult:
    """Steps 1-8 of one `train()` / `train_sft()` call (the module docstring), holding the
    model's `lock` (taken by the caller) and releasing it at the end."""
    try:
        md = backend._dir(model)
        if request_id is not None:
            answered = await asyncio.to_thread(md.answered, request_id)
            if answered is not None:  # committed before (a retry, or a restarted caller)
                mismatch = replayed_mismatch(model.name, answered["step"],
                                             await asyncio.to_thread(md.history_row,
                                                                     answered["step"]))
                if mismatch is not None:  # what the first answer said, again
                    raise mismatch
                return TrainResult(step=answered["step"],
                                   metrics=answered.get("metrics") or {})
        await asyncio.to_thread(md.check_writable, md.step_bytes())
        step = (md.latest_step() or 0) + 1
        # before anything else: a crash loses no rollout (in a thread: it fsyncs)
        sft = config if isinstance(config, SFTConfig) else None
        await asyncio.to_thread(md.journal_groups, step, groups, sft)
        failpoint("journaled", step)
        emit({"phase": "journaled", "step": step, "groups": len(groups)})
        metrics, mismatch = await train_and_publish(backend, model, groups, config, step,
                                                   request_id, emit, keep_serving)
        if sft is None:
            metrics.update(off_policy_metrics(groups, step - 1))
            check_served_policy(metrics, step - 1, f"{model.project}/{model.name}")
        kind = "rl" if sft is None else "sft"
        # the credit a step trained with: `art view` marks the groups it trained by its rule
        credit = {"advantage": config.advantage} if sft is None else {}
        try:
            await asyncio.to_thread(md.append_history, {"step": step, "kind": kind,
                                                        **credit, **metrics})
        except OSError as e:  # the step is committed; its row is rebuilt at registration
            log.warning("%s/%s step %d: history row not written (%s)", model.project,
                        model.name, step, e)
        backend.loggers.log_step(StepRecord(
            model.project, model.name, step, SPLIT_TRAIN, {**group_metrics(groups), **metrics},
            groups, model.base_model, md.checkpoint(step)))
        if mismatch is not None:  # committed and recorded, but not what is served
            raise mismatch
        emit({"phase": "done", "step": step, "metrics": metrics})
        return TrainResult(step=step, metrics=metrics)
    finally:
        lock.release()

async def train_and_publish(backend: StepBackend, model: TrainableModel,
                            groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig,
                            step: int, request_id: str | None,
                            emit: Callable[[dict[str, Any]], None],
                            keep_serving: bool = False
                            ) -> tuple[dict[str, float], PolicyMismatch | None]:
    """Steps 2-7 of the module docstring, with the gate closed (with `keep_serving`, only
    around the swap); the step's metrics, and the served-policy check's failure if the
    publish failed it (the step is committed; the previous one keeps serving)."""
    md = backend._dir(model)
    engine = backend._engines[model.base_model]
    asleep = paused = False
    try:
        if not keep_serving:
            await backend._on_gateway(backend.gateway.pause)
            paused = True
            emit({"phase": "paused", "step": step})
            await asyncio.to_thread(engine.sleep)
            asleep = True
        # dedicated on a CPU: the trainer takes the cores the engine leaves free
        threads = free_cores(backend, engine) if keep_serving else None
        try:
            metrics = await asyncio.wrap_future(backend.trainers.submit(
                backend.trainers.train_and_save, model, groups, config, step, request_id,
                threads))
        except RETRYABLE:
            raise
        except Exception as e:  # the same groups would fail again: do not replay them
            md.mark_failed(step, f"{type(e).__name__}: {e}")
            raise
        emit({"phase": "trained", "step": step, "seconds": metrics.get("seconds", 0.0)})
        t_publish = time.perf_counter()
        if not paused:  # merged weights are reloaded in place: no request may be running
            await backend._on_gateway(backend.gateway.pause)
            paused = True
            emit({"phase": "paused", "step": step})
        if asleep:
            asleep = False
            try:  # committed: the step stands even if vLLM does not wake (it restarts)
                await asyncio.to_thread(engine.wake_up)
            except EngineError as e:
                log.warning("vLLM did not wake after step %d (%s); it serves again after "
                            "its restart", step, str(e).splitlines()[0])
        # committed: a publish that fails (the engine restarting) loads it on demand later
        mismatch = None
        try:
            metrics.update(await backend._on_gateway(
                lambda: backend.gateway.publish(
                    model.name, engine, step, md.checkpoint(step), project=model.project,
                    tolerance=model.config.engine.policy_check_tolerance)) or {})
        except PolicyMismatch as e:
            metrics.update(e.metrics, policy_mismatch=1.0)
            mismatch = e
        # from the end of the optimizer step until the new adapter serves requests
        metrics["publish_seconds"] = time.perf_counter() - t_publish
        metrics["swap_seconds"] = metrics["save_seconds"] + metrics["publish_seconds"]
        failpoint("published", step)
        emit({"phase": "published", "step": step})
        return metrics, mismatch
    finally:
        if asleep:
            with contextlib.suppress(EngineError):
                await asyncio.to_thread(engine.wake_up)
        if paused:
            await backend._on_gateway(backend._resume)

def free_cores(backend: StepBackend, engine: VLLMEngine) -> int | None:
    """The CPU threads a step may use while `engine` keeps serving: the cores beside the
    engine's (None: the trainer is not on the CPU, or the engine is not)."""
    if engine.cuda or (backend.trainers.device or "cpu") != "cpu":
        return None
    return max(1, (os.cpu_count() or 1) - engine.config.cpu_threads)
