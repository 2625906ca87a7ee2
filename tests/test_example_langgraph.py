"""examples/langgraph_agent.py in its smallest setting, on the session's engine."""

from __future__ import annotations

import pytest

from art_core import TrainableModel
from tests.test_examples import load


def test_the_lookup_tool_answers_from_the_table():
    module = load("langgraph_agent")
    assert "capital Velmor" in module.lookup_country.invoke({"country": "Zarnia"})
    assert "No country named" in module.lookup_country.invoke({"country": "Atlantis"})


@pytest.mark.engine
async def test_langgraph_example_cpu_smoke_trains(backend, smollm2_path):
    module = load("langgraph_agent")
    model = TrainableModel(name="ex-langgraph", project="examples")
    await model.register(backend)
    rewards = await module.train(model, module.CPU_SMOKE)
    assert len(rewards) == module.CPU_SMOKE.steps
    assert await model.get_step() == module.CPU_SMOKE.steps
