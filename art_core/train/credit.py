"""Per-turn credit (`TrainConfig.advantage="turn"`): each sampled turn is credited with the
rewards of the turns from it on, against the other trajectories of its group at the same turn.

Why: one reward at the end of an episode, spread over every token, gives a right first move and
a wrong last answer the same sign. With a reward per turn (a step environment's, or one set
with `Trajectory.set_turn_reward`), a turn is credited only with what followed it.

The estimator, per group of n trajectories of one scenario:

1. Turn rewards r[i][k] for trajectory i's sampled turns k = 0..K_i-1 (the main conversation's
   turns in message order, then each additional conversation's). A turn without a reward of its
   own counts 0, and whatever of the episode's reward the turns do not account for
   (`reward - sum(r[i])`) goes to the last turn, so the return from turn 0 is always the
   episode's reward: episode-level rewards still train, credited to every turn.
2. Return-to-go G[i][k] = sum of r[i][j] for j >= k (undiscounted: episodes are a few turns, and
   G[i][0] stays the episode's reward); G[i][k] = 0 for k >= K_i (the episode has ended).
3. Baseline b[i][k] = mean of G[j][k] over the other trajectories j != i (leave-one-out, at the
   same turn index; one that ended earlier counts with its 0).
4. Every completion token of turn k of trajectory i trains with A[i][k] = G[i][k] - b[i][k];
   no division by a standard deviation.

Why the gradient stays unbiased (the point of verl's RFC #7244): turn k's term is
E[grad log pi(a_ik | s_ik) * (G_ik - b)], which equals the true E[grad log pi * G_ik] exactly
when E[grad log pi(a_ik | s_ik) * b] = 0, that is when b does not depend on a_ik or on anything
after it. b[i][k] comes only from the other trajectories, sampled independently of trajectory i
given the scenario: unbiased. A baseline that includes trajectory i itself (GRPO's group mean),
divides by a spread that includes G_ik, or uses i's own later turns would not be; counting the
trajectories that ended before turn k (with G = 0) keeps b independent of how far i itself got.
tests/unit/test_credit.py checks this by exact enumeration of a small two-turn problem.

Groups with fewer than two trajectories have no baseline and are dropped; a group whose
advantages are all 0 (within `ZERO_VARIANCE_TOL`) carries no signal and is dropped; both are
counted as `compute_advantages` counts them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from art_core.train.advantages import TokenAdvantages, mean_std
from art_core.trajectory import ZERO_VARIANCE_TOL, SampledTurn, Trajectory


def sampled_turns(trajectory: Trajectory) -> list[tuple[int, SampledTurn]]:
    """(history index, turn) of every sampled turn, in the order credit runs through them."""
    return [(h, turn) for h, history in enumerate(trajectory.histories())
            for turn in sorted(history.turns, key=lambda t: t.message_index)]


def turn_rewards(trajectory: Trajectory) -> list[float]:
    """r[k] per sampled turn (step 1 of the module docstring); [reward] with no sampled turn."""
    rewards = [turn.reward or 0.0 for _, turn in sampled_turns(trajectory)]
    if not rewards:
        return [trajectory.reward]
    rewards[-1] += trajectory.reward - math.fsum(rewards)
    return rewards


def group_turn_advantages(rewards: list[list[float]]) -> list[list[float]]:
    """A[i][k] for a group's turn rewards r[i][k] (steps 2-4 of the module docstring)."""
    returns = [[math.fsum(r[k:]) for k in range(len(r))] for r in rewards]
    n = len(returns)
    if n < 2:
        raise ValueError("per-turn credit needs at least two trajectories in a group")

    def g(j: int, k: int) -> float:
        return returns[j][k] if k < len(returns[j]) else 0.0

    return [[returns[i][k] - math.fsum(g(j, k) for j in range(n) if j != i) / (n - 1)
             for k in range(len(returns[i]))] for i in range(n)]


def has_turn_signal(trajectories: Sequence[Trajectory]) -> bool:
    """Whether per-turn credit trains on this group: two or more trajectories and a turn
    advantage that is not 0. Equal episode rewards can still differ turn by turn, so this is
    the rule dynamic sampling keeps groups by under `advantage="turn"`."""
    if len(trajectories) < 2:
        return False
    rows = group_turn_advantages([turn_rewards(t) for t in trajectories])
    return any(abs(a) > ZERO_VARIANCE_TOL for row in rows for a in row)


def turn_advantages(groups: Iterable[Iterable[Trajectory]]
                    ) -> tuple[list[tuple[Trajectory, float]], dict[str, float], TokenAdvantages]:
    """The kept trajectories (each with its first turn's advantage, used only where a
    trajectory has no sampled turn), the step's statistics (as `compute_advantages`'s, plus
    `turn_advantage_abs_mean`), and each sampled token's advantage for `build_all_sequences`."""
    scored: list[tuple[Trajectory, float]] = []
    per_turn: dict[tuple[int, int, int], float] = {}
    all_rewards: list[float] = []
    magnitudes: list[float] = []
    n_groups = n_zero = n_small = 0
    for group in groups:
        trajectories = list(group)
        n_groups += 1
        all_rewards.extend(t.reward for t in trajectories)
        if len(trajectories) < 2:
            n_small += 1
            continue
        advantages = group_turn_advantages([turn_rewards(t) for t in trajectories])
        if all(abs(a) <= ZERO_VARIANCE_TOL for row in advantages for a in row):
            n_zero += 1
            continue
        for trajectory, row in zip(trajectories, advantages, strict=True):
            index = len(scored)
            scored.append((trajectory, row[0]))
            for (h, turn), a in zip(sampled_turns(trajectory), row, strict=False):
                per_turn[(index, h, turn.message_index)] = a
            magnitudes.extend(abs(a) for a in row)

    def token_advantages(traj_index: int, history: int, turn: SampledTurn) -> list[float]:
        return [per_turn[(traj_index, history, turn.message_index)]] * len(turn.logprobs)

    mean, std = mean_std(all_rewards) if all_rewards else (0.0, 0.0)
    stats: dict[str, float] = {
        "groups": n_groups, "groups_zero_variance": n_zero,
        "frac_groups_zero_variance": n_zero / n_groups if n_groups else 0.0,
        "groups_too_small": n_small, "trajectories": len(all_rewards),
        "trajectories_kept": len(scored), "reward_mean": mean, "reward_std": std,
        "turn_advantage_abs_mean": math.fsum(magnitudes) / len(magnitudes) if magnitudes else 0.0,
    }
    return scored, stats, token_advantages
