"""The learning test: RL must make the demo's agent answer more held-out questions correctly.

The task is `art demo`'s (art_langgraph.demo): a LangGraph agent (model -> ToolNode -> model,
recorded by one `TrajectoryRecorder` callback) answers questions about made-up countries with a
`lookup_country` tool; success = the final answer names the value asked for and no other value
of the record. SmolLM2-135M succeeds on a few percent of held-out questions before training.

Four GRPO steps (6 questions x 4 episodes each, the demo's defaults) on the shared engine must
raise the success rate on the 24 held-out questions x 2 episodes (countries never trained on),
sampled with the same settings before and after, by at least 10 of 48 episodes (21 points).
Measured on a 2-core CPU with 6 steps and 1 episode per question: 12/24 -> 20/24, training
successes per step 9, 17, 20, 19, 17, 19 of 24 (8.5 min). A broken loss, advantage sign, adapter
swap, recorder or tool-call constraint leaves it near the start. The counts are printed (run
with -s to see them).
"""

from __future__ import annotations

import pytest

from art_core import TrainableModel, TrainConfig
from art_core.gather import gather_trajectory_groups
from art_core.loop import evaluate
from art_langgraph.chat_model import init_chat_model
from art_langgraph.demo import (
    HELD_OUT_COUNTRIES,
    MAX_TOKENS,
    TEMPERATURE,
    TRAIN_COUNTRIES,
    build_agent,
    episode,
    questions,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.nightly]

STEPS = 4
GROUPS, ROLLOUTS = 6, 4
EVAL_SAMPLES = 2
MIN_GAIN = 10  # of 48 held-out episodes


async def test_agent_success_rate_rises_on_held_out_questions(backend, smollm2_path):
    model = TrainableModel(name="learning-agent", project="learning")
    await model.register(backend)
    graph = build_agent(init_chat_model(model, max_tokens=MAX_TOKENS, temperature=TEMPERATURE))
    held_out = questions(HELD_OUT_COUNTRIES)
    train = questions(TRAIN_COUNTRIES)
    def rollout(q):
        return episode(graph, q)

    before = (await evaluate(rollout, held_out, 0, rollouts=EVAL_SAMPLES)).rate("success")
    successes = []
    for step in range(STEPS):
        batch = [train[(step * GROUPS + k) * 7 % len(train)] for k in range(GROUPS)]
        groups = await gather_trajectory_groups(
            ([episode(graph, q) for _ in range(ROLLOUTS)] for q in batch), show_progress=False)
        await model.train(groups, TrainConfig(learning_rate=1e-3))
        successes.append(sum(bool(t.metrics["success"]) for g in groups for t in g))
    after = (await evaluate(rollout, held_out, STEPS, rollouts=EVAL_SAMPLES)).rate("success")
    print(f"held-out success {before.k}/{before.n} -> {after.k}/{after.n}; training "
          f"successes per step {successes}")
    assert after.n == before.n == EVAL_SAMPLES * len(held_out)
    assert after.k >= before.k + MIN_GAIN, (before, after, successes)
