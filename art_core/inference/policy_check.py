"""The served-policy check (ARCHITECTURE invariant 9): what vLLM serves under a step's name is
what the trainer trained.

The silent failure of 2026 is a stale policy: an adapter that never reached vLLM (verl #7495),
one whose modules match nothing and is accepted anyway (vllm #34186), rollouts that stay on the
old step (OpenPipe ART #661), stale prefix-cache blocks after an in-place reload (vllm #42125).
The algorithm, at every publish of `name@step` (a runtime LoRA, a merge into the weights, a
delta beside the merged step, the reload after an engine restart):

1. The trainer wrote `probe.json` into the checkpoint (art_core/train/probe.py): a fixed short
   conversation's token ids and its logprob of each token, float32, from the adapter it trained.
2. Once the engine has loaded the step, and before the name is published, the gateway asks vLLM
   directly (the gate is closed, so nothing is batched with it: vLLM-CPU crashes on batched
   prompt logprobs through a LoRA) for the prompt logprobs of the same ids under the name vLLM
   serves the step as.
3. mean |served - trained| over the probe's tokens must be within the engine's
   `policy_check_tolerance`. Beyond it the publish fails loudly (`PolicyMismatch`): the
   previous step keeps serving, the step's history row and `/health` say so.

A checkpoint without `probe.json` (written by an older version, or by a multi-process step)
and an engine that cannot score prompts are not checked (metric `policy_checked` 0).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from art_core.train.probe import PROBE_FILE


class PolicyMismatch(RuntimeError):
    """What vLLM serves under a step's name does not match what the trainer trained."""

    def __init__(self, message: str, metrics: dict[str, float]) -> None:
        super().__init__(message)
        self.metrics = metrics


def read_probe(checkpoint: Path) -> tuple[list[int], list[float]] | None:
    """The probe's token ids and the trainer's logprobs, or None without a manifest."""
    path = Path(checkpoint) / PROBE_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return [int(i) for i in data["token_ids"]], [float(x) for x in data["logprobs"]]


def compare(trained: list[float], served: list[float]) -> tuple[float, float]:
    """(mean, max) of |served - trained| over the probe's tokens."""
    if len(trained) != len(served) or not trained:
        raise ValueError(f"the probe has {len(trained)} logprobs, the engine gave "
                         f"{len(served)}")
    diffs = [abs(a - b) for a, b in zip(trained, served, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)


def check_served(engine: Any, name: str, checkpoint: Path, tolerance: float) -> dict[str, float]:
    """Steps 2-3 of the module docstring for adapter `name` (e.g. "agent@3") loaded on
    `engine`; its metrics, or `PolicyMismatch`. Call it in a thread (it waits on vLLM)."""
    probe = read_probe(checkpoint)
    if probe is None:
        return {"policy_checked": 0.0}
    ids, trained = probe
    t0 = time.perf_counter()
    served = engine.prompt_logprobs(name, ids)
    if served is None:  # an engine that cannot score prompts
        return {"policy_checked": 0.0}
    mean, worst = compare(trained, served)
    metrics = {"policy_checked": 1.0, "policy_check_mean_abs": mean,
               "policy_check_max_abs": worst, "policy_check_seconds": time.perf_counter() - t0}
    if mean > tolerance:
        raise PolicyMismatch(
            f"{name}: what vLLM serves does not match what the trainer trained (mean "
            f"|logprob difference| {mean:.3f} over {len(ids) - 1} probe tokens, max {worst:.3f}; "
            f"tolerance {tolerance}); the previous step keeps serving. A stale or unloaded "
            "adapter, a merge that did not take, or stale prefix-cache blocks do this",
            metrics)
    return metrics
