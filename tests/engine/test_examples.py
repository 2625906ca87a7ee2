"""Each example in examples/ runs its smallest setting (`--cpu-smoke`: the embedded model, tiny
steps) on the session's engine: rollouts through the gateway, real training steps."""

from __future__ import annotations

import pytest

from art_core import TrainableModel
from tests.support.data import load_example as load

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("name", ["game_2048", "email_agent", "ruler_rewards"])
async def test_example_cpu_smoke_trains(backend, smollm2_path, name):
    module = load(name)
    model = TrainableModel(name=f"ex-{name.replace('_', '-')}", project="examples")
    await model.register(backend)
    cfg = module.CPU_SMOKE
    means = await module.train(model, cfg)
    assert await model.get_step() == len(means) >= 1
    if name == "game_2048":  # the forced tool makes every turn a move
        traj = await module.rollout(model, 7, cfg)
        assert traj.metrics["moves"] >= 1 and traj.turns
    elif name == "email_agent":
        inbox = module.Inbox(0)
        traj = await module.rollout(model, inbox, inbox.questions[0], cfg)
        names = [c["function"]["name"] for m in traj.messages for c in m.get("tool_calls") or []]
        assert names and set(names) <= {"search_inbox", "read_email", "answer"}


async def test_langgraph_example_cpu_smoke_trains(backend, smollm2_path):
    module = load("langgraph_agent")
    model = TrainableModel(name="ex-langgraph", project="examples")
    await model.register(backend)
    rewards = await module.train(model, module.CPU_SMOKE)
    assert len(rewards) == module.CPU_SMOKE.steps
    assert await model.get_step() == module.CPU_SMOKE.steps
