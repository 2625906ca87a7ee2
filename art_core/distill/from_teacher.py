"""Distillation from a teacher's rollouts: run the user's rollout with a stronger model, keep
the best trajectories of each group, and fine-tune the student on them (`model.train_sft`).

    groups  = rollout(teacher, scenario) x rollouts_per_group, per scenario   (gathered)
    scored  = after_each(group) if given (e.g. RULER), else the rollout's own rewards
    kept    = per group, the `keep_per_group` best by reward, at least `min_reward`
    step    = student.train_sft(kept, config)

The teacher is any OpenAI-compatible endpoint (`Model(name=..., base_url=..., api_key=...)`:
a hosted model, a litellm proxy, `vllm serve`), or a name the student's own gateway serves
(`"mymodel@12"`, the base model's id, another model trained on the same engine). Its
trajectories need no sampled tokens: SFT renders them through the student's chat template.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from art_core.config import SFTConfig
from art_core.gather import AfterEach, gather_trajectory_groups
from art_core.model import Model, TrainableModel, TrainResult
from art_core.trajectory import Trajectory, TrajectoryGroup

TeacherRollout = Callable[[Model, Any], Awaitable[Trajectory]]
"""One rollout of one scenario by the given model: `async (model, scenario) -> Trajectory`."""


def teacher_model(teacher: Model | str, student: TrainableModel) -> Model:
    """`teacher` as a Model: a string names a model on the student's own endpoint."""
    if isinstance(teacher, Model):
        return teacher
    if not isinstance(teacher, str) or not teacher:
        raise TypeError(f"teacher must be a Model or a served model name, got {teacher!r}")
    if student.base_url is None:
        raise RuntimeError(f"teacher {teacher!r} names a model on the student's endpoint, but "
                           f"{student.name!r} is not registered: await student.register(backend)")
    return Model(name=teacher, base_url=student.base_url, api_key=student.api_key)


def best_of_groups(groups: Sequence[TrajectoryGroup], keep_per_group: int = 1,
                   min_reward: float | None = None) -> list[Trajectory]:
    """The `keep_per_group` highest-reward trajectories of each group (ties: the earlier one),
    those below `min_reward` left out."""
    if keep_per_group < 1:
        raise ValueError(f"keep_per_group must be >= 1, got {keep_per_group}")
    kept = []
    for group in groups:
        ranked = sorted(group.trajectories, key=lambda t: -t.reward)
        kept += [t for t in ranked[:keep_per_group]
                 if min_reward is None or t.reward >= min_reward]
    return kept


async def distill(student: TrainableModel, teacher: Model | str, rollout: TeacherRollout,
                  scenarios: Sequence[Any], *, rollouts_per_group: int = 4,
                  keep_per_group: int = 1, min_reward: float | None = None,
                  after_each: AfterEach | None = None, config: SFTConfig | None = None,
                  max_exceptions: int | float = 0) -> TrainResult:
    """Fine-tune `student` on the best of `teacher`'s rollouts of `scenarios` (see the module
    docstring); one SFT step. Its metrics add `teacher_reward_mean` (all teacher rollouts)
    and `distilled_trajectories` (kept)."""
    if not scenarios:
        raise ValueError("distill needs at least one scenario")
    model = teacher_model(teacher, student)
    groups = await gather_trajectory_groups(
        ([rollout(model, s) for _ in range(rollouts_per_group)] for s in scenarios),
        after_each=after_each, max_exceptions=max_exceptions,
        description=f"teacher {model.name}")
    kept = best_of_groups(groups, keep_per_group, min_reward)
    if not kept:
        raise ValueError(f"no teacher trajectory reached min_reward={min_reward}: nothing to "
                         "distill (lower it, or use more rollouts per group)")
    result = await student.train_sft(kept, config)
    rewards = [t.reward for g in groups for t in g.trajectories]
    result.metrics.update(teacher_reward_mean=sum(rewards) / len(rewards),
                          distilled_trajectories=len(kept))
    return result
