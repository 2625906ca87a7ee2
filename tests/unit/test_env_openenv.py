"""OpenEnv without the `openenv` package beside the trainer (art_core/env/openenv.py): an
OpenEnv `Environment` served by OpenEnv's own `create_app` in the side environment
(.venv-openenv, tests/support/openenv_server.py) is played through `OpenEnvSocket`, one
WebSocket session per rollout: rewards and `done` as the environment gives them, sessions that
do not share state, a refused action and a server killed mid-episode end that rollout with
`EnvFailed` naming it, and the rollouts beside it finish. The model is scripted (no engine);
tests/engine/test_env_steps.py plays it with SmolLM2."""

from __future__ import annotations

import asyncio

import pytest

from art_core.env import EnvFailed, OpenEnvSocket, OpenEnvText, step_rollout
from art_core.env.openenv import socket_url
from art_core.gather import gather_trajectory_groups
from tests.support.openenv_process import OpenEnvServer, unavailable_reason
from tests.support.step_envs import ScriptedModel

needs_server = pytest.mark.skipif(unavailable_reason() is not None,
                                  reason=str(unavailable_reason()))


@pytest.fixture(scope="module")
def server():
    s = OpenEnvServer()
    yield s
    s.kill()


def text(observation: dict) -> str:
    return observation["text"]


@pytest.mark.parametrize(("url", "socket"), [
    ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/ws"),
    ("https://env.example/space/", "wss://env.example/space/ws"),
    ("ws://h:1/ws", "ws://h:1/ws")])
def test_socket_urls(url, socket):
    assert socket_url(url) == socket


def test_a_url_that_is_not_http_is_refused():
    with pytest.raises(ValueError, match="starts with http"):
        socket_url("127.0.0.1:8000")


@needs_server
@pytest.mark.parametrize(("replies", "max_turns", "rewards", "done"), [
    (["7"], 3, [1.0], True),  # the number at once
    (["3", "9", "7"], 3, [0.1, 0.1, 1.0], True),
    (["no idea", "2", "4"], 3, [0.0, 0.1, 0.1], True),  # the environment ends it at 3 tries
    (["no idea", "2"], 2, [0.0, 0.1], False),  # our turn limit ends it first
])
async def test_rollouts_get_the_environments_rewards(server, replies, max_turns, rewards, done):
    traj = await step_rollout(ScriptedModel(replies),
                              lambda: OpenEnvText(OpenEnvSocket(server.url), text=text),
                              {"target": 7}, max_turns=max_turns)
    assert traj.turn_rewards == rewards and traj.reward == pytest.approx(sum(rewards))
    assert traj.metrics["done"] is done and traj.metrics["ran_out_of_turns"] is not done
    assert traj.messages[0]["content"].startswith("Guess my number")
    if len(replies) > 1:
        assert traj.messages[2]["content"] in ("higher.", "lower.", "no number.")


@needs_server
async def test_sessions_do_not_share_state(server):
    a, b = OpenEnvSocket(server.url), OpenEnvSocket(server.url)
    await a.reset(target=2)
    await b.reset(target=8)
    assert (await a.step({"message": "2"})).reward == 1.0
    assert (await b.step({"message": "2"})).observation["text"] == "higher."
    await a.close()
    await b.close()


@needs_server
async def test_a_refused_action_ends_the_rollout_naming_it(server):
    env = OpenEnvText(OpenEnvSocket(server.url), action=lambda reply: {"guess": reply})
    with pytest.raises(EnvFailed, match=r"step at turn 0 failed.*refused the step"):
        await step_rollout(ScriptedModel(["5"]), lambda: env, {"target": 7})


@needs_server
async def test_a_server_killed_mid_episode_fails_that_rollout_and_the_others_finish(server):
    doomed = OpenEnvServer()
    gate = asyncio.Event()

    class Waits(ScriptedModel):  # the doomed rollout's model waits until its server is gone
        def openai_client(self):
            inner = super().openai_client()

            class Completions:
                async def create(self, **kw):
                    await gate.wait()
                    return await inner.chat.completions.create(**kw)

            return type("Client", (), {"chat": type("Chat", (), {
                "completions": Completions()})()})()

    async def healthy(i: int):
        return await step_rollout(ScriptedModel(["1", "7"]),
                                  lambda: OpenEnvText(OpenEnvSocket(server.url), text=text),
                                  {"target": 7}, max_turns=3)

    async def killed():
        return await step_rollout(Waits(["1", "7"]),
                                  lambda: OpenEnvText(OpenEnvSocket(doomed.url), text=text),
                                  {"target": 7}, max_turns=3)

    async def kill_then_go():
        await asyncio.sleep(0.5)  # its reset is done: mid-episode
        doomed.kill()
        gate.set()

    killer = asyncio.create_task(kill_then_go())
    groups = await gather_trajectory_groups(
        [[healthy(0), healthy(1), killed()]], max_exceptions=1, show_progress=False)
    await killer
    assert len(groups) == 1 and len(groups[0].trajectories) == 2
    assert all(t.reward == pytest.approx(1.1) for t in groups[0].trajectories)
    assert len(groups[0].exceptions) == 1
    assert "is gone" in groups[0].exceptions[0].message
