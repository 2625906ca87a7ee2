"""Harness mode on the real engine: agent programs nobody here wrote (a Python script on the
`openai` SDK, a Node script on the `openai` npm package; tests/support/harness_agent.*) get a
rollout's base URL through their environment and run unchanged; every completion they make,
streamed or not, lands in that rollout's trajectory with the exact sampled tokens (the
ledger's), the conversation trains as one sequence, and a finished rollout refuses more."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

import openai
import pytest

from art_core import TrainableModel, TrainConfig, TrajectoryGroup
from art_core.env import HarnessError, harness_rollout
from art_core.train.batch import build_all_sequences
from tests.support.engine import check_against_ledger

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
NODE_MODULES = ROOT / ".venv" / "node" / "node_modules"


def command(agent: str) -> list[str]:
    if agent == "python":
        return [sys.executable, str(ROOT / "tests/support/harness_agent.py")]
    if not shutil.which("node") or not (NODE_MODULES / "openai").is_dir():
        pytest.skip("node or the openai npm package (scripts/setup.sh --dev installs it into "
                    ".venv/node) is missing")
    return ["node", str(ROOT / "tests/support/harness_agent.cjs")]


@pytest.fixture(scope="module")
async def smol(backend, smollm2_path) -> TrainableModel:
    model = TrainableModel(name="harness-smol", project="harness")
    await model.register(backend)
    return model


async def run(agent: str, env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(
        *command(agent), env={**os.environ, "NODE_PATH": str(NODE_MODULES), **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


@pytest.mark.parametrize("agent", ["python", "node"])
async def test_a_harness_we_do_not_own_is_recorded_exactly_and_trains(smol, agent):
    step = await smol.get_step()
    rollouts = [await harness_rollout(smol) for _ in range(2)]
    printed = await asyncio.gather(*(run(agent, r.env) for r in rollouts))
    trajectories = [await r.finish() for r in rollouts]
    for traj, text in zip(trajectories, printed, strict=True):
        assert [m["role"] for m in traj.messages] == ["system", "user", "assistant", "user",
                                                      "assistant"]
        assert check_against_ledger(traj, smol.base_url) == 2 and not traj.additional_histories
        assert (traj.messages[-1]["content"] or "") == text  # the streamed answer, as printed
        assert all(t.step == step for t in traj.turns)  # served by the rollout's model
        _, metrics = build_all_sequences([(traj, 1.0)])
        assert metrics["sequences_per_history"] == 1.0
        assert metrics["redundant_token_ratio"] == 1.0
    trajectories[0].reward, trajectories[1].reward = 0.0, 1.0
    result = await smol.train([TrajectoryGroup(trajectories=trajectories)],
                              TrainConfig(learning_rate=1e-3, bf16=False))
    assert result.metrics["trajectories_trained"] == 2
    # a finished rollout is closed: a second finish and a late request get 409
    with pytest.raises(HarnessError, match="409"):
        await rollouts[0].finish()
    late = openai.AsyncOpenAI(base_url=rollouts[0].base_url, api_key=rollouts[0].api_key)
    with pytest.raises(openai.APIStatusError) as e:
        await late.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 409
    await late.close()
