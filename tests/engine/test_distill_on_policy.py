"""On-policy distillation on the real engine (the embedded SmolLM2 behind our gateway): the
teacher's prompt logprobs of the student's own samples, through `name@0`, are the sampler's
logprobs when both are the same weights, and a distillation step commits a checkpoint."""

from __future__ import annotations

import math

import pytest

from art_core import Model, TrainableModel, TrainConfig
from art_core.distill import distill_on_policy, score_with_teacher
from art_core.gather import gather_trajectory_groups
from tests.support.engine import rollout

# nightly (~38 s beyond the SmolLM2 engine's start): the step's algorithm is
# tests/unit/test_distill_on_policy.py, and that vLLM's prompt logprobs of a step are the
# trainer's is checked at every publish by the served-policy check (test_policy_check.py)
pytestmark = [pytest.mark.engine, pytest.mark.nightly]


async def test_distill_from_the_same_weights_scores_like_the_sampler(backend, smollm2_path):
    student = TrainableModel(name="distill-student", project="distill")
    await student.register(backend)
    teacher = Model(name=f"{student.name}@0", base_url=student.base_url)
    groups = await gather_trajectory_groups(
        ([rollout(student, i) for i in range(3)] for _ in range(2)), show_progress=False)
    scored = await score_with_teacher(groups, teacher)  # one at a time: see MAX_CONCURRENCY
    pairs = [(s, t) for g in scored for tr in g for turn in tr.turns
             for s, t in zip(turn.logprobs, turn.teacher_logprobs, strict=True)]
    assert len(pairs) >= 6
    # same weights, prompt scoring vs decoding: the trainer-vs-sampler bound of FIELD-NOTES
    prob_diff = sum(abs(math.exp(s) - math.exp(t)) for s, t in pairs) / len(pairs)
    assert prob_diff < 0.03, prob_diff

    results = await distill_on_policy(
        student, teacher, lambda i: rollout(student, i), list(range(4)), steps=1,
        groups_per_step=2, rollouts_per_group=2, config=TrainConfig(learning_rate=1e-4))
    [result] = results
    assert result.step == 1 and await student.get_step() == 1
    assert result.metrics["teacher_tokens"] > 0
    assert abs(result.metrics["teacher_kl"]) < 0.1, result.metrics["teacher_kl"]
    assert result.metrics["trajectories_kept"] == 4  # nothing dropped for equal rewards
