"""Turn-level RULER: the judge ranks a group's trajectories after each turn, and each turn is
rewarded with the change it made to its trajectory's standing.

The algorithm of `score_turns(group, judge)`:

1. For each turn index k = 0..K-1 (K: the most sampled turns of any trajectory's main
   conversation), take each trajectory's conversation up to and including its k-th sampled
   assistant turn; a trajectory that ended earlier is taken whole (its state no longer
   changes). Score these N conversations against each other with `ruler.score` (the same
   judges, modes, validation, retries and cache as RULER): s[i][k] in [0, 1].
2. The trajectory's reward is its score at the last index, s[i][K-1]: every trajectory whole,
   exactly what `score_group` judges.
3. Turn k's own reward is s[i][k] - s[i][k-1] (with s[i][-1] = 0): how much that turn moved the
   trajectory's standing in its group. Whatever the turns do not account for of the reward goes
   to the last turn, so a turn's return-to-go (`TrainConfig(advantage="turn")`,
   art_core/train/credit.py) is the standing the trajectory gained from that turn on.

Each index is one judgement of the group (the prefix shared by all is sent once, identical
conversations are judged once, answers are cached): K judgements where `score_group` makes one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from art_core.trajectory import TrajectoryGroup
from ruler.prompt import DEFAULT_RUBRIC
from ruler.scoring import _group_tools, resolve_mode, score, score_group

logger = logging.getLogger(__name__)


async def score_turns(
    group: TrajectoryGroup,
    judge: str,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    mode: str = "auto",
    max_retries: int = 3,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    **litellm_kwargs: Any,
) -> TrajectoryGroup | None:
    """A copy of `group` with each trajectory's reward the judge's final score and each sampled
    turn of its main conversation a reward of its own (the module docstring). Metrics (those of
    the last judgement) and logs as `score_group`'s, plus `ruler_turn_judgements`. A group without sampled turns is scored
    whole, by `score_group`. `swallow_exceptions=True`: a failure drops the group (None)."""
    resolve_mode(mode, judge, litellm_kwargs)  # a wrong mode is a bug: never swallowed
    ends = [sorted(turn.message_index for turn in t.turns) for t in group.trajectories]
    depth = max((len(e) for e in ends), default=0)
    if depth == 0:
        return await score_group(group, judge, rubric, swallow_exceptions=swallow_exceptions,
                                 mode=mode, max_retries=max_retries, cache=cache,
                                 cache_dir=cache_dir, **litellm_kwargs)
    tools = _group_tools(group)
    scores: list[list[float]] = [[] for _ in group.trajectories]
    result = None
    try:
        for k in range(depth):
            prefixes = [t.messages[: e[k] + 1] if k < len(e) else t.messages
                        for t, e in zip(group.trajectories, ends, strict=True)]
            result = await score(prefixes, judge, rubric, tools=tools, mode=mode,
                                 max_retries=max_retries, cache=cache, cache_dir=cache_dir,
                                 **litellm_kwargs)
            for i, e in enumerate(ends):
                if k < len(e):
                    scores[i].append(result.scores[i])
    except Exception as e:
        if not swallow_exceptions:
            raise
        logger.warning("ruler: dropping a group of %d trajectories: %s", len(group), e)
        return None
    assert result is not None
    scored = group.model_copy(deep=True)
    for i, t in enumerate(scored.trajectories):
        final = result.scores[i]
        if "ruler_score" not in t.metrics:  # scoring twice must not lose the original reward
            t.metrics["independent_reward"] = t.reward
        # the call metrics are the last judgement's: the whole trajectories, as score_group's
        t.metrics.update(result.metrics, ruler_score=final, ruler_turn_judgements=depth)
        t.reward = final
        own = [s - (scores[i][k - 1] if k else 0.0) for k, s in enumerate(scores[i])]
        if own:
            own[-1] += final - math.fsum(own)
        order = sorted(range(len(t.turns)), key=lambda j: t.turns[j].message_index)
        for j, value in zip(order, own, strict=True):
            t.set_turn_reward(j, value)
        t.logs.append(f"RULER per turn {judge} [{result.mode}]: standing after each turn "
                      f"{[round(s, 3) for s in scores[i]]}, final {final:.3f}: "
                      f"{result.explanations[i]}")
    return scored


def turn_hook(
    judge: str, rubric: str = DEFAULT_RUBRIC, **kwargs: Any
) -> Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]]:
    """An `after_each` hook for `gather_trajectory_groups` that scores each group per turn as
    it completes (train with `TrainConfig(advantage="turn")`); `kwargs` as `score_turns`'s."""

    async def after_each(group: TrajectoryGroup) -> TrajectoryGroup | None:
        return await score_turns(group, judge, rubric, **kwargs)

    return after_each
