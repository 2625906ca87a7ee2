"""A TRL-style tool environment (tests/support/envs.py, written as TRL's docs write one) run
unchanged through the real engine by `art_core.env.tool_rollout`: every tool call of the
trajectory reached its method (the environment's total, its reward, is what the tool results
said), a method that raises came back as a tool error and the rollout went on, every assistant
turn carries its sampled tokens and the episode trains as one sequence, and a group trains one
step. SmolLM2 with forced calls (`tool_choice="required"`: the gateway holds each call to the
tools' schemas), as it makes no unforced call (FIELD-NOTES); the tiny random model fills a
forced integer with digits until max_tokens."""

from __future__ import annotations

import json
import re

import pytest

from art_core import TrainableModel, TrainConfig
from art_core.env import tool_rollout
from art_core.gather import gather_trajectory_groups
from art_core.trajectory import continues
from tests.support.envs import CounterEnv

pytestmark = pytest.mark.engine

ROW = {"prompt": [{"role": "user", "content": "Use the tools."}], "start": 2}


@pytest.fixture(scope="module")
async def smol(backend, smollm2_path) -> TrainableModel:
    model = TrainableModel(name="env-smol", project="env")
    await model.register(backend)
    return model


async def test_a_trl_environment_class_runs_unchanged_and_trains(smol):
    (group,) = await gather_trajectory_groups(
        [[tool_rollout(smol, CounterEnv, ROW, tool_choice="required", max_turns=3,
                       max_tokens=128) for _ in range(6)]], show_progress=False)
    assert len(group.trajectories) == 6
    failures = 0
    for traj in group.trajectories:
        m = traj.metrics
        assert traj.messages[0]["content"] == "Use the tools. The total starts at 2."  # reset
        calls = [c for msg in traj.messages if msg["role"] == "assistant"
                 for c in msg.get("tool_calls") or []]
        results = [msg["content"] for msg in traj.messages if msg["role"] == "tool"]
        assert m["tool_calls"] == len(calls) == len(results) and m["turns"] == len(traj.turns)
        # every add reached the method: the reward (the env's total) is the last total reported
        totals = [int(x) for r in results for x in re.findall(r"^total (-?\d+)$", r)]
        assert traj.reward == float(totals[-1] if totals else 2)
        errors = [r for r in results if r.startswith("{")]
        assert m["tool_failures"] == len(errors)
        assert all("exploded" in json.loads(e)["error"] for e in errors)
        failures += len(errors)
        # token in, token out: each turn's prompt extends the previous turn's
        assert all(continues(t, p) for p, t in zip(traj.turns, traj.turns[1:], strict=False))
    calls = sum(t.metrics["tool_calls"] for t in group.trajectories)
    print(f"rewards {group.rewards}, tool calls {calls}, tool errors {failures}")
    assert calls >= 6  # the forced calls were made (not cut at max_tokens)
    assert len(set(group.rewards)) > 1  # sampled at temperature 1: the totals differ
    result = await smol.train([group], TrainConfig(learning_rate=1e-3, bf16=False))
    assert result.metrics["trajectories_trained"] == 6
    assert result.metrics["sequences_per_history"] == 1.0
