"""The logger interface: what every destination of a run's steps receives (a leaf module).

`StepRecord` is one model step as every logger sees it; `Logger` is the base class; the
factory and the run-directory logger are in `art_core.observe.loggers`. `group_metrics` and
`wilson` are the summary statistics every part reports the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from art_core.trajectory import TrajectoryGroup

SPLIT_TRAIN = "train"


@dataclass
class StepRecord:
    """One model step as every logger sees it."""

    project: str
    model: str
    step: int = field(metadata={"help": "The model's step: the checkpoint trained (train) or "
                                        "the checkpoint that produced the groups (val)."})
    split: str = SPLIT_TRAIN
    metrics: dict[str, float] = field(default_factory=dict)
    groups: list[TrajectoryGroup] = field(default_factory=list)
    base_model: str | None = None
    checkpoint: Path | None = field(default=None, metadata={"help": "Adapter dir of `step`."})


class Logger:
    """A destination for steps. Subclasses override `log_step` (and `close` if they buffer)."""

    name = "logger"

    def log_step(self, record: StepRecord) -> None:
        """Record one step. May raise: `Loggers` catches and warns once."""

    def close(self) -> None:
        """Flush and release resources; called once at the end of the run."""


def group_metrics(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """Summary metrics of groups: reward mean/std, counts, exceptions and the mean of each
    numeric trajectory metric (e.g. `ruler_score`, `tool_calls`)."""
    groups = list(groups)
    rewards = [t.reward for g in groups for t in g.trajectories]
    out: dict[str, float] = {
        "groups": float(len(groups)),
        "trajectories": float(len(rewards)),
        "exceptions": float(sum(len(g.exceptions) for g in groups)),
    }
    if rewards:
        mean = math.fsum(rewards) / len(rewards)
        out["reward_mean"] = mean
        out["reward_std"] = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    sums: dict[str, list[float]] = {}
    for g in groups:
        for t in g.trajectories:
            for k, v in t.metrics.items():
                sums.setdefault(k, []).append(float(v))
    for k, vs in sums.items():
        out.setdefault(k, math.fsum(vs) / len(vs))
    return out


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate successes/n (sound for small n and rates
    near 0 or 1; rollouts are treated as independent draws). (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
