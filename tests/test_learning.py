"""The learning test: RL must actually improve the model, and this test can fail.

SmolLM2-135M on the demo's task (told to answer briefly, which it mostly ignores; reward =
1 - words/40 for a finished sentence of three or more words): eight GRPO steps on CPU must raise
the mean reward of fresh evaluation rollouts (questions never trained on) clearly above the
step-0 mean. The full curve is printed (run with -s to see it). Measured on a 2-core CPU, about
3 min per run:
    0.046 0.078 0.534 0.719 0.557 0.653 0.633 0.624 0.667
A broken loss, advantage sign, adapter swap or step-to-step resume leaves it near the start.
"""

from __future__ import annotations

import pytest

from art_core import TrainableModel, TrainConfig
from art_core.demo import QUESTIONS, evaluate, rollout
from art_core.gather import gather_trajectory_groups

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STEPS = 8
EVAL_QUESTIONS = QUESTIONS[-8:]
TRAIN_QUESTIONS = QUESTIONS[:-8]


async def test_brevity_reward_rises_on_fresh_rollouts(backend, smollm2_path):
    model = TrainableModel(name="learning", project="learning")
    await model.register(backend)
    before = await evaluate(model, EVAL_QUESTIONS, n=3)
    curve = [before]
    for step in range(STEPS):
        questions = [TRAIN_QUESTIONS[(step * 4 + k) % len(TRAIN_QUESTIONS)] for k in range(4)]
        groups = await gather_trajectory_groups(
            ([rollout(model, q) for _ in range(6)] for q in questions), show_progress=False)
        await model.train(groups, TrainConfig(learning_rate=1e-3))
        curve.append(await evaluate(model, EVAL_QUESTIONS, n=3))
    print("eval reward per step:", " ".join(f"{r:.3f}" for r in curve))
    after = max(curve[-2:])
    assert after > before + 0.3, f"no clear improvement: {curve}"
