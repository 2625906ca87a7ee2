"""Turn-level RULER (ruler/turns.py) against a scripted judge whose P(Yes) grows with each good
step it reads: the group is judged after each turn, a turn's reward is the change in its
trajectory's standing, the reward is the final judgement, and a turn-credit step trains on it."""

from __future__ import annotations

import math
from typing import Any

import pytest

import ruler
from art_core import Trajectory, TrajectoryGroup
from art_core.train.credit import turn_advantages
from ruler.testing import Reply, ScriptedJudge


def judge(body: dict[str, Any]) -> Reply:
    p = (1 + body["messages"][-1]["content"].count("good")) / 10
    return Reply(top_logprobs={"Yes": math.log(p), "No": math.log(1 - p)})


def trajectory(*replies: str) -> Trajectory:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Plan a trip."}]
    turns = []
    for k, reply in enumerate(replies):
        if k:
            messages.append({"role": "user", "content": "Next?"})
        turns.append({"message_index": len(messages), "prompt_token_ids": [1, 2],
                      "completion_token_ids": [3 + k], "logprobs": [-1.0]})
        messages.append({"role": "assistant", "content": reply})
    return Trajectory(messages=messages, turns=turns, reward=7.0)


async def test_each_turn_is_rewarded_with_the_standing_it_gained():
    group = TrajectoryGroup(trajectories=[trajectory("good", "good"), trajectory("bad", "good"),
                                          trajectory("good")])
    with ScriptedJudge(judge) as server:
        scored = await ruler.score_turns(group, "openai/judge", mode="yesno",
                                         api_base=server.api_base, api_key="x", cache=False,
                                         num_retries=0, timeout=10)
        asked = len(server.requests)
    assert asked == 5  # turn 0: 2 distinct answers ('good' twice); turn 1: all 3
    assert [t.reward for t in scored] == pytest.approx([0.3, 0.2, 0.2])
    own = [t.turn_rewards for t in scored]
    assert own[0] == pytest.approx([0.2, 0.1]) and own[1] == pytest.approx([0.1, 0.1])
    assert own[2] == pytest.approx([0.2])
    for t in scored:
        assert sum(t.turn_rewards) == pytest.approx(t.reward)  # the return from turn 0
        assert t.metrics["independent_reward"] == 7.0 and t.metrics["ruler_turn_judgements"] == 2
        assert t.logs[-1].startswith("RULER per turn openai/judge [yesno]")
    assert [t.reward for t in group] == [7.0] * 3  # the input is not changed
    # per-turn credit on the judge's turn rewards: the bad first turn is the one pushed down
    _, _, per_token = turn_advantages([scored])
    assert per_token(1, 0, scored.trajectories[1].turns[0])[0] < 0
    assert per_token(0, 0, scored.trajectories[0].turns[0])[0] > 0


async def test_a_failing_judge_drops_the_group_only_when_asked():
    group = TrajectoryGroup(trajectories=[trajectory("a", "b"), trajectory("c")])
    with ScriptedJudge(lambda body: Reply(status=500, error="down")) as server:
        args = dict(mode="yesno", api_base=server.api_base, api_key="x", cache=False,
                    num_retries=0, max_retries=0, timeout=10)
        assert await ruler.score_turns(group, "openai/judge", swallow_exceptions=True,
                                       **args) is None
        with pytest.raises(ruler.RulerError):
            await ruler.score_turns(group, "openai/judge", **args)
    with pytest.raises(ValueError, match="mode"):
        await ruler.score_turns(group, "openai/judge", mode="nonsense")


async def test_a_group_without_sampled_turns_is_scored_whole():
    plain = [Trajectory(messages=[{"role": "user", "content": "Plan."},
                                  {"role": "assistant", "content": text}]) for text in
             ("good good", "bad")]
    with ScriptedJudge(judge) as server:
        scored = await ruler.score_turns(TrajectoryGroup(trajectories=plain), "openai/judge",
                                         mode="yesno", api_base=server.api_base, api_key="x",
                                         cache=False, num_retries=0, timeout=10)
    assert [t.reward for t in scored] == pytest.approx([0.3, 0.1])
    assert all("ruler_turn_judgements" not in t.metrics for t in scored)
