"""Step environments (art_core/env/steps.py) without an engine: a scripted model plays each
shape; each step's reward is that turn's own, the episode's is their sum; observations come back
as user messages; an environment that raises or hangs fails that rollout only, naming the call
and the turn. The libraries' shims run against the real gymnasium, TextArena and reasoning-gym,
and their rewards match what the library itself gives for the same moves."""

from __future__ import annotations

import pytest

from art_core import TrajectoryGroup
from art_core.env import (
    EnvError,
    EnvFailed,
    GymnasiumText,
    OpenEnvText,
    ReasoningGymText,
    Step,
    TextArenaText,
    step_rollout,
)
from art_core.gather import gather_trajectory_groups
from tests.support.step_envs import BrokenEnv, GuessEnv, ScriptedModel, TupleEnv


@pytest.mark.parametrize(("replies", "max_turns", "turn_rewards", "done", "out_of_turns"), [
    (["5", "8", "6"], 10, [0.1, 0.0, 1.0], True, False),  # closer, further, found
    (["6"], 10, [1.0], True, False),
    (["1", "2", "3"], 3, [0.1, 0.1, 0.1], False, True),  # turns run out before the number
])
async def test_each_step_reward_is_its_turns_and_the_episode_sums_them(
        replies, max_turns, turn_rewards, done, out_of_turns):
    env = GuessEnv()
    model = ScriptedModel(replies)
    traj = await step_rollout(model, lambda: env, max_turns=max_turns, system_prompt="Play.")
    assert traj.turn_rewards == turn_rewards
    assert traj.reward == pytest.approx(sum(turn_rewards))
    assert traj.metrics["done"] is done and traj.metrics["ran_out_of_turns"] is out_of_turns
    assert traj.metrics["turns"] == len(replies) and env.closed == 1
    # reset's text opens the conversation; each observation is the next user message
    assert [m["role"] for m in traj.messages[:3]] == ["system", "user", "assistant"]
    assert traj.messages[1]["content"] == "Guess my number, 1 to 9."
    hints = [m["content"] for m in traj.messages if m["role"] == "user"][1:]
    assert len(hints) == len(replies) - int(done)
    assert model.asked[-1] == traj.messages[:len(model.asked[-1])]  # each request: the story so far


async def test_the_row_goes_to_reset_and_a_plain_tuple_is_a_step():
    traj = await step_rollout(ScriptedModel(["3"]), GuessEnv, {"target": 3})
    assert traj.turn_rewards == [1.0]
    traj = await step_rollout(ScriptedModel(["hi", "stop"]), TupleEnv)
    assert traj.turn_rewards == [0.5, 0.5] and traj.metrics["done"]
    assert traj.messages[2]["content"] == '{"text": "you said hi"}'  # reward is not shown


@pytest.mark.parametrize(("hang", "message"), [
    (False, "step at turn 1 failed: ConnectionError: environment server went away"),
    (True, "step at turn 1 did not answer within 0.5 s"),
])
async def test_an_environment_that_fails_ends_its_rollout_only(hang, message):
    broken = BrokenEnv(hang=hang)
    with pytest.raises(EnvFailed, match=message):
        await step_rollout(ScriptedModel(["a", "b"]), lambda: broken, step_timeout_s=0.5)
    assert broken.closed == 1  # closed anyway, its error kept

    def episode(make, replies, timeout_s=60.0):  # only the broken one is meant to time out
        return step_rollout(ScriptedModel(replies), make, step_timeout_s=timeout_s)

    groups = await gather_trajectory_groups(
        [[episode(lambda: BrokenEnv(hang=hang), ["a", "b"], 0.5), episode(GuessEnv, ["6"]),
          episode(GuessEnv, ["2", "6"])]], max_exceptions=1, show_progress=False)
    (group,) = groups
    assert isinstance(group, TrajectoryGroup) and len(group.trajectories) == 2
    assert len(group.exceptions) == 1 and message.split(":")[0] in group.exceptions[0].message


@pytest.mark.parametrize(("env", "problem"), [
    (object(), "object has no reset or step method"),
    (type("OnlyReset", (), {"reset": lambda self: "x"})(), "OnlyReset has no step method"),
])
async def test_an_object_without_the_step_shape_is_refused_by_name(env, problem):
    with pytest.raises(EnvError, match=problem):
        await step_rollout(ScriptedModel([]), lambda: env)


async def test_a_step_that_answers_something_else_or_a_nan_reward_is_refused():
    class Odd(GuessEnv):
        def step(self, reply):
            return "what"

    with pytest.raises(EnvFailed, match="step at turn 0 returned str; expected a Step"):
        await step_rollout(ScriptedModel(["1"]), Odd)

    class NaN(GuessEnv):
        def step(self, reply):
            return Step("x", float("nan"))

    with pytest.raises(ValueError, match="the reward of turn 0 must be a finite number"):
        await step_rollout(ScriptedModel(["1"]), NaN)


async def test_textarena_guess_the_number_rewards_match_the_librarys_own():
    ta = pytest.importorskip("textarena")
    guesses = [f"[{g}]" for g in (10, 5, 3, 14, 1, 2, 20, 19, 18, 17, 16, 15)]  # never 8

    plain = ta.make("GuessTheNumber-v0")  # the library alone, the same seed and moves
    plain.reset(num_players=1, seed=4)
    played = 0
    for g in guesses:
        played += 1
        if plain.step(g)[0]:
            break
    expected = plain.close()[0][0]
    assert 0 < expected < 1  # a partial reward: the library's own closeness score

    traj = await step_rollout(ScriptedModel(guesses),
                              lambda: TextArenaText(ta.make("GuessTheNumber-v0")),
                              {"seed": 4}, max_turns=12)
    assert traj.reward == pytest.approx(expected) and traj.turn_rewards[-1] == pytest.approx(
        expected)
    assert traj.metrics["done"] and traj.metrics["turns"] == played
    users = [m["content"] for m in traj.messages if m["role"] == "user"]
    assert "Guess The Number" in users[0] and len(users) == played
    assert all("Guess The Number" not in u for u in users[1:])  # only what is new is sent
    assert "[Player] [10]" in users[1]


@pytest.mark.parametrize(("reply", "right"), [(None, True), ("7", False)])
async def test_reasoning_gym_scores_with_its_own_score_answer(reply, right):
    rg = pytest.importorskip("reasoning_gym")
    dataset = rg.create_dataset("chain_sum", size=3, seed=1)
    entry = dataset[2]
    answer = entry["answer"] if reply is None else reply
    traj = await step_rollout(ScriptedModel([answer]), lambda: ReasoningGymText(dataset),
                              {"index": 2})
    assert traj.messages[0]["content"] == entry["question"]
    assert traj.reward == dataset.score_answer(answer=answer, entry=entry) == float(right)


async def test_a_gymnasium_text_environment_ends_on_terminated_or_truncated():
    gym = pytest.importorskip("gymnasium")

    class Echo(gym.Env):
        """Rewards a reply as long as the last observation; truncated after three steps."""

        observation_space = action_space = gym.spaces.Text(max_length=64)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t, self.last = 0, "abc"
            return self.last, {}

        def step(self, action):
            self.t += 1
            reward = float(len(action) == len(self.last))
            self.last = action + "!"
            return self.last, reward, action == "end", self.t >= 3, {}

    done = await step_rollout(ScriptedModel(["xyz", "end"]), lambda: GymnasiumText(Echo()))
    assert done.turn_rewards == [1.0, 0.0] and done.metrics["done"]
    cut = await step_rollout(ScriptedModel(["xyz", "abcd", "q"]), lambda: GymnasiumText(Echo()))
    assert cut.turn_rewards == [1.0, 1.0, 0.0] and cut.metrics["done"]  # truncated ends it
    assert cut.messages[2]["content"] == "xyz!"


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_openenv_step_results_from_a_sync_or_async_client(asynchronous):
    """The shape OpenEnv's clients return (`StepResult(observation, reward, done)`), from a
    client written here: OpenEnv 0.10 cannot be installed beside mcp 2 (its fastmcp pins mcp 1)."""

    class Result:
        def __init__(self, observation, reward, done):
            self.observation, self.reward, self.done = observation, reward, done

    class Client:
        def __init__(self):
            self.actions, self.closed = [], False

        def reset(self):
            return Result({"prompt": "count"}, None, False)

        def step(self, action):
            self.actions.append(action)
            return Result({"prompt": f"n={len(self.actions)}"}, 0.5, len(self.actions) == 2)

        def close(self):
            self.closed = True

    client = Client()
    if asynchronous:
        sync = Client

        class Client(sync):  # noqa: F811 (the same client, every method a coroutine)
            async def reset(self):
                return sync.reset(self)

            async def step(self, action):
                return sync.step(self, action)

            async def close(self):
                sync.close(self)

        client = Client()
    traj = await step_rollout(ScriptedModel(["one", "two"]), lambda: OpenEnvText(client))
    assert client.actions == [{"message": "one"}, {"message": "two"}] and client.closed
    assert traj.turn_rewards == [0.5, 0.5] and traj.reward == 1.0
    assert traj.messages[0]["content"] == '{"prompt": "count"}'
