"""Dynamic sampling: draw scenarios until a step holds the groups *with signal* it asked for.

A group whose rewards are all equal teaches GRPO nothing (every advantage is 0); on an easy or
a hard task most groups are like that (the demo measured 5 of 6 per step). DAPO (Yu et al.,
2025) over-samples and filters until the batch is full; we do the same within a budget
(ARCHITECTURE invariant 10). The algorithm of `gather_signal_groups(make_group, scenarios, n)`:

1. Scenarios are taken from `scenarios` in order (for a loop: `shuffled_passes(train, seed)`),
   so the i-th group drawn is always the i-th scenario of the stream: the same seed and the same
   outcomes give the same draw, and a resumed run that seeds by step draws the same scenarios.
2. Rounds. The first round draws `n` groups (no waste if every group has signal). Each later
   round draws enough groups to finish at the signal rate seen so far, Laplace-smoothed
   ((found + 1) / (drawn + 2), so a round with no signal yet does not divide by zero), capped by
   what is left of the budget `max_groups` (default 3 n). A round is one
   `gather_trajectory_groups` call: its rollouts run concurrently and `after_each` (e.g. RULER)
   scores each group as it completes, so signal is judged on the final rewards.
3. A group has signal when it holds >= 2 trajectories whose rewards are not all equal
   (`TrajectoryGroup.has_signal`, the trainer's own rule). Groups without it are set aside
   (`skipped`), as are groups `after_each` dropped.
4. Stop as soon as `n` groups with signal are found; the first `n` in draw order are kept (any
   more from the last round are counted as `surplus`), or when the budget or the scenarios run
   out: then a warning says so and the step trains on the groups with signal it has. (Many
   such warnings in a row mean the task is too easy or too hard for the model: raise the
   budget, or change the task's difficulty.)

`SignalGroups.metrics()` reports what the step cost: groups drawn, groups with signal, budget
used, the reward over everything sampled (the trained groups alone are biased towards 0.5).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from art_core.gather import AfterEach, gather_trajectory_groups
from art_core.trajectory import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_BUDGET = 3.0
"""Groups drawn per group asked for, at most. DAPO's own runs drew ~2-3x at their zero-variance
rates; the demo's base model (5 of 6 groups alike) needs ~3x to fill a step."""


def shuffled_passes(items: Sequence[T], seed: Any, offset: int = 0) -> Iterator[T]:
    """`items` in shuffled passes, forever: every item once per pass, each pass shuffled by
    `Random(f"{seed}-pass-{n}")`. `offset` skips that many draws (a resumed stream)."""
    if not items:
        raise ValueError("no scenarios to draw from")
    for n in itertools.count():
        order = list(range(len(items)))
        random.Random(f"{seed}-pass-{n}").shuffle(order)
        for j, i in enumerate(order):
            if n * len(order) + j >= offset:
                yield items[i]


@dataclass
class SignalGroups:
    """What `gather_signal_groups` found: the groups to train and what it cost."""

    groups: list[TrajectoryGroup]  # with signal, in draw order, at most the number asked for
    skipped: list[TrajectoryGroup]  # drawn, completed, without signal
    asked: int
    drawn: int  # groups started (scenarios taken from the stream)
    budget: int
    rounds: int
    surplus: int = 0  # groups with signal beyond the number asked for (not returned)
    dropped: int = 0  # groups after_each dropped (None), or whose rollouts all failed
    scenarios: list[Any] = field(default_factory=list)  # every scenario drawn, in order
    sampled_rewards: list[float] = field(default_factory=list)  # every trajectory's reward

    @property
    def complete(self) -> bool:
        """Whether the step got every group with signal it asked for."""
        return len(self.groups) >= self.asked

    def metrics(self) -> dict[str, float]:
        """Step metrics (prefix `sampling_`), for history rows and loggers."""
        rewards = self.sampled_rewards
        return {
            "sampling_groups_asked": float(self.asked),
            "sampling_groups_drawn": float(self.drawn),
            "sampling_groups_with_signal": float(len(self.groups) + self.surplus),
            "sampling_groups_skipped": float(len(self.skipped) + self.dropped),
            "sampling_budget_used": self.drawn / self.budget if self.budget else 0.0,
            "sampling_rounds": float(self.rounds),
            "sampling_reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
        }


def round_size(asked: int, found: int, drawn: int, budget: int) -> int:
    """Groups to draw next: all `asked` at first, then enough to finish at the smoothed signal
    rate seen so far, within what is left of the budget."""
    if drawn == 0:
        return min(asked, budget)
    rate = (found + 1) / (drawn + 2)
    return max(0, min(math.ceil((asked - found) / rate), budget - drawn))


async def gather_signal_groups(
    make_group: Callable[[Any], Iterable[Awaitable[Trajectory]]],
    scenarios: Iterable[Any],
    n_groups: int,
    *,
    max_groups: int | None = None,
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    max_concurrency: int | None = None,
    show_progress: bool = True,
    description: str = "gather",
) -> SignalGroups:
    """Draw groups (`make_group(scenario)`: the rollouts of one scenario) from `scenarios` until
    `n_groups` of them have signal or `max_groups` (default `DEFAULT_BUDGET` x n_groups) have
    been drawn. See the module docstring. `max_exceptions` applies per round, as in
    `gather_trajectory_groups`, which raises `GatherError` beyond it."""
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"n_groups must be an integer >= 1, got {n_groups!r}")
    if max_groups is None:
        max_groups = math.ceil(DEFAULT_BUDGET * n_groups)
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < n_groups:
        raise ValueError(f"max_groups must be an integer >= n_groups ({n_groups}), "
                         f"got {max_groups!r}")
    stream = iter(scenarios)
    out = SignalGroups(groups=[], skipped=[], asked=n_groups, drawn=0, budget=max_groups,
                       rounds=0)
    exhausted = False
    while not out.complete and not exhausted:
        size = round_size(n_groups, len(out.groups), out.drawn, max_groups)
        if size == 0:
            break
        picked = list(itertools.islice(stream, size))
        exhausted = len(picked) < size
        if not picked:
            break
        out.rounds += 1
        out.drawn += len(picked)
        out.scenarios.extend(picked)
        label = (f"{description} ({len(out.groups)}/{n_groups} with signal, "
                 f"{out.drawn}/{max_groups} drawn)" if out.rounds > 1 else description)
        done = await gather_trajectory_groups(
            (make_group(s) for s in picked), max_exceptions=max_exceptions,
            after_each=after_each, max_concurrency=max_concurrency,
            show_progress=show_progress, description=label)
        out.dropped += len(picked) - sum(1 for g in done if g.trajectories)
        for group in done:
            out.sampled_rewards.extend(group.rewards)
            if not group.trajectories:
                continue
            if not group.has_signal:
                out.skipped.append(group)
            elif out.complete:
                out.surplus += 1
            else:
                out.groups.append(group)
    if not out.complete and (exhausted or max_groups > n_groups):  # (no budget: nothing asked)
        why = "the scenarios ran out" if exhausted else "the budget ran out"
        log.warning("%s: %d of %d groups with signal after drawing %d (max_groups=%d): %s; "
                    "training on those", description, len(out.groups), n_groups, out.drawn,
                    max_groups, why)
    return out
