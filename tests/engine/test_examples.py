"""Each example in examples/ runs its smallest setting (`--cpu-smoke`: tiny steps) on the
session's engine: rollouts through the gateway, real training steps.

In `make test` the examples whose calls are forced (the gateway's grammar holds any model to the
tools' schemas) run on the tiny random model: every line of the example's loop runs, in seconds.
The same smokes on the embedded SmolLM2, as `--cpu-smoke` runs them, are `nightly` (~4 min);
ruler_rewards needs a judge that answers, so it runs on SmolLM2 in both, one step in `make test`.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from art_core import TrainableModel
from tests.support.data import load_example as load
from tests.support.engine import tiny_config

pytestmark = pytest.mark.engine

SMOLLM2 = pytest.param("smollm2", marks=pytest.mark.nightly)


async def example_model(request: pytest.FixtureRequest, backend, name: str, base: str
                        ) -> TrainableModel:
    if base == "tiny":
        path = request.getfixturevalue("tiny_models")["llama"]
        model = TrainableModel(name=f"ex-{name}-tiny", project="examples", base_model=str(path),
                               config=tiny_config())
    else:
        request.getfixturevalue("smollm2_path")
        model = TrainableModel(name=f"ex-{name}", project="examples")
    await model.register(backend)
    return model


@pytest.mark.parametrize("base", ["tiny", SMOLLM2])
@pytest.mark.parametrize("name", ["game_2048", "email_agent"])
async def test_example_cpu_smoke_trains(request, backend, name, base):
    module = load(name)
    model = await example_model(request, backend, name.replace("_", "-"), base)
    cfg = module.CPU_SMOKE
    before = await model.get_step()  # the other parameter trained the same model first
    means = await module.train(model, cfg)
    assert await model.get_step() - before == len(means) >= 1
    if name == "game_2048":  # the forced tool makes every turn a move (the tiny model's
        traj = await module.rollout(model, 7, cfg)  # random call may run past max_tokens)
        assert traj.turns and (base == "tiny" or traj.metrics["moves"] >= 1)
    elif name == "email_agent":
        inbox = module.Inbox(0)
        traj = await module.rollout(model, inbox, inbox.questions[0], cfg)
        names = [c["function"]["name"] for m in traj.messages for c in m.get("tool_calls") or []]
        assert set(names) <= {"search_inbox", "read_email", "answer"} and traj.turns
        assert base == "tiny" or names  # the tiny model's random arguments may run past
        # max_tokens, which ends the rollout without a call


@pytest.mark.parametrize("steps", [1, pytest.param(None, marks=pytest.mark.nightly)])
async def test_ruler_rewards_example_cpu_smoke_trains(request, backend, steps):
    module = load("ruler_rewards")
    model = await example_model(request, backend, "ruler-rewards", "smollm2")
    cfg = module.CPU_SMOKE if steps is None else dataclasses.replace(module.CPU_SMOKE,
                                                                     steps=steps)
    before = await model.get_step()  # the other parameter trained the same model first
    means = await module.train(model, cfg)
    assert await model.get_step() - before == len(means) >= 1


@pytest.mark.parametrize("base", ["tiny", SMOLLM2])
async def test_langgraph_example_cpu_smoke_trains(request, backend, base):
    module = load("langgraph_agent")
    model = await example_model(request, backend, "langgraph", base)
    rewards = await module.train(model, module.CPU_SMOKE)
    assert len(rewards) == module.CPU_SMOKE.steps
    assert await model.get_step() == module.CPU_SMOKE.steps


@pytest.mark.parametrize("base", ["tiny", SMOLLM2])
async def test_calculator_environment_example_cpu_smoke_runs(request, backend, base):
    """A reasoning-gym task with a tool, as a TRL environment class: held-out accuracy before
    and after, a step on the groups with signal (the tiny model has none: nothing trained)."""
    module = load("calculator_env")
    model = await example_model(request, backend, "calculator", base)
    before, after = await module.train(model, module.CPU_SMOKE)
    for evaluation in (before, after):
        assert re.fullmatch(r"\d+/2 \[\d+%, \d+%\]", evaluation), evaluation
    assert await model.get_step() <= module.CPU_SMOKE.steps
