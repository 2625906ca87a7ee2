"""A step environment played by SmolLM2 through the real engine (`art_core.env.step_rollout`):
each reply goes to `step`, each step's reward is kept on its turn and survives the journal, the
episode trains as one sequence per trajectory (token in, token out), and a step trains. The
libraries' shims (TextArena, reasoning-gym, gymnasium) are checked against the libraries
themselves in tests/unit/test_env_steps.py."""

from __future__ import annotations

import asyncio

import pytest

from art_core import TrainableModel, TrainConfig
from art_core.env import step_rollout
from art_core.gather import gather_trajectory_groups
from art_core.storage import ModelDir
from art_core.trajectory import continues
from tests.support.step_envs import GuessEnv

pytestmark = pytest.mark.engine

SYSTEM = "Guess the number. Answer with one digit."


@pytest.fixture(scope="module")
async def smol(backend, smollm2_path) -> TrainableModel:
    model = TrainableModel(name="env-steps", project="env")
    await model.register(backend)
    return model


async def test_a_step_environment_trains_with_a_reward_per_turn(smol, backend):
    def episode(target: int):
        return step_rollout(smol, GuessEnv, {"target": target}, max_turns=3, max_tokens=8,
                            system_prompt=SYSTEM)

    groups = await gather_trajectory_groups(
        [[episode(t) for _ in range(3)] for t in (3, 7)], show_progress=False)
    trajectories = [t for g in groups for t in g]
    assert len(trajectories) == 6
    for traj in trajectories:
        n = traj.metrics["turns"]
        assert 1 <= n <= 3 and len(traj.turns) == n and len(traj.turn_rewards) == n
        assert all(r is not None for r in traj.turn_rewards)
        assert traj.reward == pytest.approx(sum(traj.turn_rewards))
        assert traj.metrics["done"] or traj.metrics["ran_out_of_turns"]
        assert all(continues(t, p) for p, t in zip(traj.turns, traj.turns[1:], strict=False))
    print("turn rewards", [t.turn_rewards for t in trajectories])
    for g in groups:  # any two different rewards: the step must train both
        g.trajectories[0].reward += 1.0
    result = await smol.train(groups, TrainConfig(learning_rate=1e-3, bf16=False))
    assert result.metrics["trajectories_trained"] == 6
    assert result.metrics["sequences_per_history"] == 1.0
    stored = ModelDir(backend.root, smol.project, smol.name).journaled(result.step)
    assert [t.turn_rewards for g in stored for t in g] == [t.turn_rewards for t in trajectories]


async def test_an_openenv_server_trains_and_a_killed_one_fails_only_its_rollouts(smol):
    """OpenEnv's own `create_app` serving an `Environment` (side environment .venv-openenv),
    played by SmolLM2 through `OpenEnvSocket` (no openenv package here): one group's server is
    killed mid-episode; its rollouts fail, counted, and the step trains on the other group."""
    from art_core.env import OpenEnvSocket, OpenEnvText
    from tests.support.openenv_process import OpenEnvServer, unavailable_reason

    if unavailable_reason():
        pytest.skip(unavailable_reason())
    alive, doomed = OpenEnvServer(), OpenEnvServer()
    try:
        def episode(server: OpenEnvServer):
            return step_rollout(smol, lambda: OpenEnvText(OpenEnvSocket(server.url),
                                                          text=lambda o: o["text"]),
                                {"target": 4}, max_turns=3, max_tokens=8, system_prompt=SYSTEM)

        async def kill_soon():
            await asyncio.sleep(1.0)  # resets done, first replies being sampled
            doomed.kill()

        killer = asyncio.create_task(kill_soon())
        groups = await gather_trajectory_groups(
            [[episode(alive) for _ in range(3)], [episode(doomed) for _ in range(3)]],
            max_exceptions=3, show_progress=False)
        await killer
    finally:
        alive.kill()
        doomed.kill()
    failed = [e for g in groups for e in g.exceptions]
    assert failed and all("is gone" in e.message for e in failed), [e.message for e in failed]
    trained = [g for g in groups if len(g.trajectories) >= 2]
    assert trained and all(len(t.turns) == t.metrics["turns"] for g in trained for t in g)
    for g in trained:  # two different rewards: the step must train the group
        g.trajectories[0].reward += 1.0
    result = await smol.train(trained, TrainConfig(learning_rate=1e-3, bf16=False))
    assert result.metrics["trajectories_trained"] == sum(len(g.trajectories) for g in trained)
