"""Advantages: how much each trajectory (or token) is pushed up or down. Stage 1 of a step
(art_core/train/batch.py holds the stages after it). Per-turn credit is credit.py.

- `compute_advantages` (`TrainConfig.advantage="group"`, GRPO): advantage = reward - group mean
  (divided by the group's std when `scale_rewards`). Groups whose rewards are all equal carry no
  signal and are dropped and counted (ARCHITECTURE invariant 7), as are groups with fewer than
  two trajectories.
- `teacher_advantages` (`advantage="teacher"`, on-policy distillation): every trajectory trains,
  and each sampled token's advantage is its teacher logprob minus its sampler logprob
  (`teacher_token_advantages`, set per token when the sequences are built).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from art_core.trajectory import SampledTurn, Trajectory, has_signal

ADVANTAGE_EPS = 1e-6
"""Added to the group std before dividing: keeps near-equal rewards from exploding into +-1."""

TokenAdvantages = Callable[[int, int, SampledTurn], list[float]]
"""(trajectory index in `scored`, history index in `histories()`, turn) -> one advantage per
completion token of the turn: per-token advantages (distillation, per-turn credit)."""


def compute_advantages(
    groups: Iterable[Iterable[Trajectory]], scale_rewards: bool
) -> tuple[list[tuple[Trajectory, float]], dict[str, float]]:
    """Group-relative advantages (GRPO): each trajectory is compared with its own group only.

    Returns the kept trajectories with their advantage, in group order, and step statistics:
    `groups`, `groups_zero_variance` (all rewards equal within `trajectory.ZERO_VARIANCE_TOL`),
    `frac_groups_zero_variance`, `groups_too_small` (fewer than 2 trajectories; counted apart
    from zero-variance ones), `trajectories`, `trajectories_kept`, and `reward_mean` /
    `reward_std` (population) over ALL trajectories, dropped groups included, so the reward curve
    does not jump when groups are dropped. Empty input gives zero statistics.
    """
    scored: list[tuple[Trajectory, float]] = []
    all_rewards: list[float] = []
    n_groups = n_zero_variance = n_too_small = 0
    for group in groups:
        trajectories = list(group)
        rewards = [t.reward for t in trajectories]
        n_groups += 1
        all_rewards.extend(rewards)
        if len(trajectories) < 2:
            n_too_small += 1  # nothing to compare with
            continue
        if not has_signal(rewards):
            n_zero_variance += 1  # every advantage would be 0: no gradient, only cost
            continue
        mean, std = mean_std(rewards)
        for trajectory, reward in zip(trajectories, rewards, strict=True):
            advantage = reward - mean
            if scale_rewards:
                advantage /= std + ADVANTAGE_EPS
            scored.append((trajectory, advantage))

    reward_mean, reward_std = mean_std(all_rewards) if all_rewards else (0.0, 0.0)
    stats: dict[str, float] = {
        "groups": n_groups,
        "groups_zero_variance": n_zero_variance,
        "frac_groups_zero_variance": n_zero_variance / n_groups if n_groups else 0.0,
        "groups_too_small": n_too_small,
        "trajectories": len(all_rewards),
        "trajectories_kept": len(scored),
        "reward_mean": reward_mean,
        "reward_std": reward_std,
    }
    return scored, stats


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std (the group is the whole population GRPO compares against)."""
    mean = math.fsum(values) / len(values)
    var = math.fsum((v - mean) ** 2 for v in values) / len(values)
    return mean, math.sqrt(var)


def teacher_advantages(
    groups: Iterable[Iterable[Trajectory]],
) -> tuple[list[tuple[Trajectory, float]], dict[str, float]]:
    """On-policy distillation: every trajectory is kept (no group comparison, so no group is
    dropped), with a placeholder advantage of 0.0; the real, per-token advantage
    teacher_logprob - sampler_logprob is set by `build_all_sequences(..., teacher=True)`.

    Raises ValueError for a trajectory with a sampled turn that has no `teacher_logprobs`, or
    with no sampled turn at all (nothing the teacher could have scored).
    Statistics: as `compute_advantages` (nothing dropped), plus `teacher_kl`, the mean over
    distilled tokens of sampler_logprob - teacher_logprob (a per-token estimate of the reverse
    KL(student || teacher) on the student's own samples), and `teacher_tokens`, their count.
    Tokens a tool-call grammar chose are not distilled (`_teacher_gaps`).
    """
    scored: list[tuple[Trajectory, float]] = []
    rewards: list[float] = []
    gaps: list[float] = []
    n_groups = 0
    for gi, group in enumerate(groups):
        n_groups += 1
        for ti, trajectory in enumerate(group):
            turns = [t for h in trajectory.histories() for t in h.turns]
            if not turns or any(t.teacher_logprobs is None for t in turns):
                raise ValueError(
                    f"groups[{gi}].trajectories[{ti}] ({describe(trajectory)}) has "
                    f"{'no sampled turn' if not turns else 'a sampled turn without teacher_logprobs'}"
                    ": advantage='teacher' trains on the teacher's logprobs of the sampled tokens;"
                    " score the groups with art_core.distill.score_with_teacher first")
            for turn in turns:
                gaps += teacher_gaps(turn)
            rewards.append(trajectory.reward)
            scored.append((trajectory, 0.0))
    reward_mean, reward_std = mean_std(rewards) if rewards else (0.0, 0.0)
    stats: dict[str, float] = {
        "groups": n_groups,
        "groups_zero_variance": 0,
        "frac_groups_zero_variance": 0.0,
        "groups_too_small": 0,
        "trajectories": len(rewards),
        "trajectories_kept": len(scored),
        "reward_mean": reward_mean,
        "reward_std": reward_std,
        "teacher_kl": -math.fsum(gaps) / len(gaps) if gaps else 0.0,
        "teacher_tokens": len(gaps),
    }
    return scored, stats


def teacher_gaps(turn: SampledTurn) -> list[float]:
    """teacher_logprob - sampler_logprob of the turn's distilled tokens: all of them up to
    `constrained_from`. A grammar-chosen token's sampler logprob is of the masked distribution
    (`_sampler_logprobs`), so the gap would measure the mask, not the student: not distilled."""
    assert turn.teacher_logprobs is not None
    k = len(turn.logprobs) if turn.constrained_from is None else turn.constrained_from
    return [t - s for t, s in zip(turn.teacher_logprobs[:k], turn.logprobs[:k], strict=True)]


def teacher_token_advantages(traj_index: int, _history: int, turn: SampledTurn) -> list[float]:
    """The per-token advantage of each completion token of the turn: its gap, 0 where it is
    not distilled (the token still trains at ratio 1, with no push either way)."""
    if turn.teacher_logprobs is None:
        raise ValueError(
            f"trajectory {traj_index}: the sampled turn of message {turn.message_index} "
            "has no teacher_logprobs (score it with art_core.distill.score_with_teacher)")
    gaps = teacher_gaps(turn)
    return gaps + [0.0] * (len(turn.logprobs) - len(gaps))


def describe(trajectory: Trajectory) -> str:
    """A short identification for error messages (trajectories have no id of their own)."""
    n_assistant = sum(m.get("role") == "assistant" for m in trajectory.messages)
    parts = [f"reward={trajectory.reward}", f"{n_assistant} assistant messages"]
    if trajectory.metadata:
        parts.append(f"metadata={trajectory.metadata}")
    return ", ".join(parts)
