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

5. Strata (`scenarios` a mapping of stratum -> stream, e.g. a benchmark's categories): `n` and
   the budget are split over the strata as evenly as they go, or in proportion to `weights` (a
   stratum of weight 2 gets twice the places and budget), the odd places going round with
   `turn` (a loop's step; `shares`), and
   each stratum runs steps 1-4 on its own stream within its share; a round draws from every
   stratum still short at once. A stratum that spends its budget or its scenarios without
   filling its places hands them to the strata that can still draw, by weight (their spare
   groups with signal first); places nobody can draw for go to any spare left. Without strata the groups
   with signal come from whatever the model still varies on: a category it has collapsed on
   (all pass, or all fail alike) is never trained on again, and the others take the step.

`SignalGroups.metrics()` reports what the step cost: groups drawn, groups with signal, budget
used, the reward over everything sampled (the trained groups alone are biased towards 0.5), and
per stratum the groups with signal kept (`sampling_signal_<stratum>`).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import random
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping, Sequence
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


def shares(total: int, weights: int | Sequence[float], turn: int = 0) -> list[int]:
    """`total` places split in proportion to `weights` (an int k: k equal parts): the `turn`-th
    block of `total` in one sequence of places, each place going to the part with the most weight
    per place it already holds (Sainte-Lague: weight / (2 x held + 1)), ties to the earlier part.
    A block is within about a place of the exact share, and successive blocks (a loop's steps)
    pass the odd places round so that each part gets its share over the turns: `shares(6, 4)`
    is [2, 2, 1, 1] and at turn 1 [1, 1, 2, 2]; `shares(6, [1, 1, 2, 1])` over turns 0-4
    [1, 1, 3, 1], [2, 1, 2, 1], [1, 2, 2, 1], [1, 1, 2, 2], [1, 1, 3, 1]: 12 of 30 for the
    weight of 2, as 2 of 5 asks."""
    w = [1.0] * weights if isinstance(weights, int) else [float(x) for x in weights]
    if not w or min(w) <= 0:
        raise ValueError(f"weights must be positive and not empty, got {weights!r}")
    if total < 0 or turn < 0:
        raise ValueError(f"total and turn must be >= 0, got {total}, {turn}")
    if all(x.is_integer() for x in w):  # the sequence repeats every sum(w) blocks
        turn %= int(sum(w))
    held, out = [0] * len(w), [0] * len(w)
    for place in range((turn + 1) * total):
        i = max(range(len(w)), key=lambda j: (w[j] / (2 * held[j] + 1), -j))
        held[i] += 1
        if place >= turn * total:
            out[i] += 1
    return out


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
    by_stratum: dict[str, int] = field(default_factory=dict)  # groups kept per stratum (if any)

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
            **{f"sampling_signal_{k}": float(v) for k, v in self.by_stratum.items()},
        }


def round_size(asked: int, found: int, drawn: int, budget: int) -> int:
    """Groups to draw next: all `asked` at first, then enough to finish at the smoothed signal
    rate seen so far, within what is left of the budget."""
    if drawn == 0:
        return min(asked, budget)
    rate = (found + 1) / (drawn + 2)
    return max(0, min(math.ceil((asked - found) / rate), budget - drawn))


def _keeping_places(after_each: AfterEach | None) -> AfterEach | None:
    """`after_each` with a dropped group kept as an empty one, so that the result lines up with
    the scenarios drawn (gather omits dropped groups)."""
    if after_each is None:
        return None

    async def keep(group: TrajectoryGroup) -> TrajectoryGroup:
        kept = after_each(group)
        if inspect.isawaitable(kept):
            kept = await kept
        return TrajectoryGroup(trajectories=[]) if kept is None else kept

    return keep


@dataclass
class _Stratum:
    """One stratum's stream and what it has found so far."""

    key: Hashable
    stream: Iterator[Any]
    weight: float  # its share of the step, against the other strata's
    quota: int  # groups with signal asked of it (grows by the places other strata hand on)
    budget: int  # groups it may draw
    share: int = 0  # its quota at the start, for the report
    drawn: int = 0
    exhausted: bool = False
    kept: list[TrajectoryGroup] = field(default_factory=list)  # with signal, in draw order
    spare: list[TrajectoryGroup] = field(default_factory=list)  # with signal, beyond the quota

    @property
    def can_draw(self) -> bool:
        return not self.exhausted and self.drawn < self.budget

    def keep(self, group: TrajectoryGroup) -> None:
        (self.kept if len(self.kept) < self.quota else self.spare).append(group)

    def next_round(self) -> list[Any]:
        if len(self.kept) >= self.quota or self.exhausted:
            return []
        size = round_size(self.quota, len(self.kept), self.drawn, self.budget)
        picked = list(itertools.islice(self.stream, size))
        self.exhausted = len(picked) < size
        self.drawn += len(picked)
        return picked


def _hand_on(strata: list[_Stratum], turn: int) -> bool:
    """Give the places a stratum can no longer fill (its budget or scenarios spent) to the
    strata that can still draw, by weight (`shares` at `turn`); a stratum's spare groups fill
    them first. Whether any place moved."""
    live = [st for st in strata if st.can_draw]
    short = [st for st in strata if not st.can_draw and len(st.kept) < st.quota]
    places = sum(st.quota - len(st.kept) for st in short)
    if not live or not places:
        return False
    for st in short:
        st.quota = len(st.kept)
    for st, extra in zip(live, shares(places, [st.weight for st in live], turn), strict=True):
        st.quota += extra
        while st.spare and len(st.kept) < st.quota:
            st.kept.append(st.spare.pop(0))
    return True


def _next_round(strata: list[_Stratum], turn: int) -> list[tuple[_Stratum, Any]]:
    """The scenarios of the next round, each with its stratum (none: nothing left to draw)."""
    _hand_on(strata, turn)
    picked = [(st, s) for st in strata for s in st.next_round()]
    while not picked and _hand_on(strata, turn):  # a stratum ran out while picking: hand on again
        picked = [(st, s) for st in strata for s in st.next_round()]
    return picked


def weigh(strata: Iterable[Hashable],
          weights: Mapping[Hashable, float] | None) -> dict[Hashable, float]:
    """Each stratum's weight: `weights[stratum]`, or 1 where not named. A weight that is not a
    positive number, or one naming no stratum, is refused by name."""
    w = {key: 1.0 for key in strata}
    for key, x in (weights or {}).items():
        if key not in w:
            raise ValueError(f"weights: {key!r} is not a stratum (strata: "
                             f"{', '.join(map(str, w)) or 'none'})")
        if isinstance(x, bool) or not isinstance(x, int | float) or not x > 0:
            raise ValueError(f"weights: the weight of {key!r} must be a positive number, "
                             f"got {x!r}")
        w[key] = float(x)
    return w


def signal_rule(train_config: Any = None) -> Callable[[TrajectoryGroup], bool]:
    """The trainer's own rule for whether a group trains under `train_config` (a TrainConfig,
    or the name of its `advantage`): rewards not all equal (`TrajectoryGroup.has_signal`), or
    under per-turn credit (`advantage="turn"`) a turn advantage that is not 0
    (`credit.has_turn_signal`)."""
    advantage = (train_config if isinstance(train_config, str)
                 else getattr(train_config, "advantage", "group"))
    if advantage == "turn":
        from art_core.train.credit import has_turn_signal  # pure Python, no torch

        return lambda group: has_turn_signal(group.trajectories)
    return lambda group: group.has_signal


async def gather_signal_groups(
    make_group: Callable[[Any], Iterable[Awaitable[Trajectory]]],
    scenarios: Iterable[Any] | Mapping[Hashable, Iterable[Any]],
    n_groups: int,
    *,
    max_groups: int | None = None,
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    max_concurrency: int | None = None,
    show_progress: bool = True,
    description: str = "gather",
    signal: Callable[[TrajectoryGroup], bool] | None = None,
    weights: Mapping[Hashable, float] | None = None,
    turn: int = 0,
) -> SignalGroups:
    """Draw groups (`make_group(scenario)`: the rollouts of one scenario) from `scenarios` until
    `n_groups` of them have signal or `max_groups` (default `DEFAULT_BUDGET` x n_groups) have
    been drawn. `scenarios` may map strata to streams: the groups and the budget are then
    shared out over them, in proportion to `weights` where given (a stratum not named: 1;
    step 5 of the module docstring), `turn` (a loop's step) passing the odd places round. `max_exceptions` applies per round,
    as in `gather_trajectory_groups`, which raises `GatherError` beyond it. `signal`: whether
    a group has signal (default `TrajectoryGroup.has_signal`; `signal_rule(train_config)`
    gives the trainer's rule for a config)."""
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or n_groups < 1:
        raise ValueError(f"n_groups must be an integer >= 1, got {n_groups!r}")
    if max_groups is None:
        max_groups = math.ceil(DEFAULT_BUDGET * n_groups)
    signal = signal or signal_rule()
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < n_groups:
        raise ValueError(f"max_groups must be an integer >= n_groups ({n_groups}), "
                         f"got {max_groups!r}")
    stratified = isinstance(scenarios, Mapping)
    streams = dict(scenarios) if stratified else {None: scenarios}
    if weights and not stratified:
        raise ValueError("weights: scenarios must map strata to streams to weight them")
    if not streams:
        raise ValueError("scenarios: no strata to draw from")
    w = weigh(streams, weights)
    strata = [_Stratum(key, iter(it), w[key], quota, budget, share=quota)
              for (key, it), quota, budget in zip(streams.items(),
                                                  shares(n_groups, list(w.values()), turn),
                                                  shares(max_groups, list(w.values()), turn),
                                                  strict=True)]
    out = SignalGroups(groups=[], skipped=[], asked=n_groups, drawn=0, budget=max_groups,
                       rounds=0)
    while picked := _next_round(strata, turn):
        out.rounds += 1
        out.drawn += len(picked)
        out.scenarios.extend(s for _, s in picked)
        found = sum(len(st.kept) for st in strata)
        label = (f"{description} ({found}/{n_groups} with signal, "
                 f"{out.drawn}/{max_groups} drawn)" if out.rounds > 1 else description)
        done = await gather_trajectory_groups(
            (make_group(s) for _, s in picked), max_exceptions=max_exceptions,
            after_each=_keeping_places(after_each), max_concurrency=max_concurrency,
            show_progress=show_progress, description=label)
        out.dropped += len(picked) - sum(1 for g in done if g.trajectories)
        for (st, _), group in zip(picked, done, strict=True):
            out.sampled_rewards.extend(group.rewards)
            if not group.trajectories:
                continue
            if signal(group):
                st.keep(group)
            else:
                out.skipped.append(group)
    # places no stratum could still draw for go to the spare groups, in stratum order
    for st in strata:
        while st.spare and sum(len(x.kept) for x in strata) < n_groups:
            st.kept.append(st.spare.pop(0))
    out.groups = [g for st in strata for g in st.kept]
    out.surplus = sum(len(st.spare) for st in strata)
    if stratified:
        out.by_stratum = {str(st.key): len(st.kept) for st in strata}
    exhausted = any(st.exhausted and len(st.kept) < st.share for st in strata)
    if not out.complete and (exhausted or max_groups > n_groups):  # (no budget: nothing asked)
        why = "the scenarios ran out" if exhausted else "the budget ran out"
        per = ("; per stratum " + ", ".join(f"{st.key} {len(st.kept)}/{st.share} of {st.drawn}"
                                             for st in strata)) if stratified else ""
        log.warning("%s: %d of %d groups with signal after drawing %d (max_groups=%d): %s%s; "
                    "training on those", description, len(out.groups), n_groups, out.drawn,
                    max_groups, why, per)
    return out
