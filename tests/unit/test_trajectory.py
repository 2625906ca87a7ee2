"""The data model: exact JSONL round trips and validation errors that name the bad field."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from art_core.trajectory import (
    History,
    RolloutError,
    SampledTurn,
    Trajectory,
    TrajectoryGroup,
    read_groups_jsonl,
    write_groups_jsonl,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the inbox.",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def _turn(i: int, n: int = 3, step: int | None = 0) -> SampledTurn:
    return SampledTurn(
        message_index=i,
        prompt_token_ids=[1, 2, 3, 4 + i],
        completion_token_ids=list(range(10, 10 + n)),
        logprobs=[-0.5 / (k + 1) for k in range(n)],
        step=step,
        response_id=f"chatcmpl-{i}",
        finish_reason="stop",
    )


def _tool_trajectory(reward: float) -> Trajectory:
    """A two-turn tool-using conversation with both assistant turns sampled."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You search email."},
        {"role": "user", "content": "When is the meeting?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "meeting"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Meeting at 3pm, room ü."},
        {"role": "assistant", "content": "At 3pm."},
    ]
    return Trajectory(
        messages=messages,
        tools=TOOLS,
        turns=[_turn(2), _turn(4, n=2, step=1)],
        reward=reward,
        metrics={"tool_calls": 1, "correct": True, "latency_s": 0.25},
        metadata={"scenario": "s-1", "attempt": 2, "temperature": 0.7, "hard": False, "note": None},
        logs=["searched once"],
        additional_histories=[
            History(
                messages=[
                    {"role": "user", "content": "Summarize."},
                    {"role": "assistant", "content": "A meeting."},
                ],
                turns=[_turn(1, n=1)],
            ),
            History(messages=[{"role": "user", "content": "context only"}]),
        ],
    )


def _groups() -> list[TrajectoryGroup]:
    try:
        raise ValueError("tool server went away")
    except ValueError as e:
        error = RolloutError.from_exception(e)
    return [
        TrajectoryGroup(
            trajectories=[_tool_trajectory(1.0), _tool_trajectory(-0.25)],
            exceptions=[error],
            metadata={"scenario_id": 7, "split": "train"},
        ),
        TrajectoryGroup(trajectories=[_tool_trajectory(0.1 + 0.2)]),  # an inexact float
        TrajectoryGroup(),
    ]


def test_jsonl_round_trip_is_exact(tmp_path):
    groups = _groups()
    first = write_groups_jsonl(groups, tmp_path / "a" / "groups.jsonl")
    back = read_groups_jsonl(first)

    assert back == groups
    assert [g.model_dump() for g in back] == [g.model_dump() for g in groups]
    assert back[1].trajectories[0].reward == 0.1 + 0.2
    # types survive: an int stays an int, a bool a bool, None None
    meta = back[0].trajectories[0].metadata
    assert [type(meta[k]) for k in ("attempt", "temperature", "hard", "note")] == [
        int,
        float,
        bool,
        type(None),
    ]
    assert back[0].exceptions[0].type == "ValueError"
    assert "tool server went away" in back[0].exceptions[0].traceback

    second = write_groups_jsonl(back, tmp_path / "b.jsonl")
    assert second.read_bytes() == first.read_bytes()
    assert first.read_text(encoding="utf-8").count("\n") == len(groups)
    assert not list(tmp_path.rglob("*.tmp"))  # the temp file was renamed away


def test_read_names_the_bad_line(tmp_path):
    path = write_groups_jsonl(_groups()[:1], tmp_path / "g.jsonl")
    with path.open("a", encoding="utf-8") as f:
        f.write("\n")  # blank lines are skipped
        f.write('{"trajectories": [{"reward": "NaN"}]}\n')
    with pytest.raises(ValueError, match=r"g\.jsonl:3: invalid trajectory group") as info:
        read_groups_jsonl(path)
    assert "reward" in str(info.value)


def _assistant_with_call(call_id: str = "call_1") -> dict[str, Any]:
    return {
        "role": "assistant",
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }


INVALID: list[tuple[str, Any, list[str]]] = [
    ("nan-reward", lambda: Trajectory(reward=math.nan), ["reward", "finite"]),
    ("inf-reward", lambda: Trajectory(reward=math.inf), ["reward", "finite"]),
    ("neg-inf-reward", lambda: Trajectory(reward=-math.inf), ["reward", "finite"]),
    ("nan-metric", lambda: Trajectory(metrics={"acc": math.nan}), ["metrics['acc']", "finite"]),
    (
        "nan-metadata",
        lambda: Trajectory(metadata={"score": math.nan}),
        ["metadata['score']", "finite"],
    ),
    (
        "inf-group-metadata",
        lambda: TrajectoryGroup(metadata={"difficulty": math.inf}),
        ["metadata['difficulty']", "finite"],
    ),
    (
        "logprobs-shorter",
        lambda: SampledTurn(
            message_index=0, prompt_token_ids=[1], completion_token_ids=[1, 2], logprobs=[-0.1]
        ),
        ["logprobs", "completion_token_ids", "same length"],
    ),
    (
        "logprobs-longer",
        lambda: SampledTurn(
            message_index=0, prompt_token_ids=[1], completion_token_ids=[1], logprobs=[-0.1, -0.2]
        ),
        ["logprobs", "completion_token_ids", "same length"],
    ),
    (
        "empty-completion",
        lambda: SampledTurn(
            message_index=0, prompt_token_ids=[1], completion_token_ids=[], logprobs=[]
        ),
        ["completion_token_ids", "empty"],
    ),
    (
        "nan-logprob",
        lambda: SampledTurn(
            message_index=0, prompt_token_ids=[1], completion_token_ids=[1], logprobs=[math.nan]
        ),
        ["logprobs", "NaN"],
    ),
    (
        "tool-without-call",
        lambda: History(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "x", "content": ""},
            ]
        ),
        ["messages[1]", "tool_call_id='x'", "matches no tool call"],
    ),
    (
        "tool-with-other-call-id",
        lambda: History(
            messages=[
                _assistant_with_call("a"),
                {"role": "tool", "tool_call_id": "b", "content": ""},
            ]
        ),
        ["messages[1]", "tool_call_id='b'"],
    ),
    (
        "tool-before-its-call",
        lambda: History(
            messages=[
                {"role": "tool", "tool_call_id": "a", "content": ""},
                _assistant_with_call("a"),
            ]
        ),
        ["messages[0]", "tool_call_id='a'"],
    ),
    (
        "tool-call-without-id",
        lambda: History(messages=[{"role": "assistant", "tool_calls": [{"type": "function"}]}]),
        ["messages[0].tool_calls", "without an id"],
    ),
    (
        "unknown-role",
        lambda: History(
            messages=[{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]
        ),
        ["messages[1].role", "'bot'"],
    ),
    (
        "missing-role",
        lambda: History(messages=[{"content": "a"}]),
        ["messages[0].role", "None"],
    ),
    (
        "turn-points-at-user",
        lambda: History(messages=[{"role": "user", "content": "a"}], turns=[_turn(0)]),
        ["message_index=0", "assistant"],
    ),
    (
        "turn-out-of-range",
        lambda: History(messages=[{"role": "assistant", "content": "a"}], turns=[_turn(1)]),
        ["message_index=1", "assistant"],
    ),
    (
        "turn-negative-index",
        lambda: History(messages=[{"role": "assistant", "content": "a"}], turns=[_turn(-1)]),
        ["message_index=-1", "assistant"],
    ),
    (
        "two-turns-same-message",
        lambda: History(
            messages=[{"role": "assistant", "content": "a"}], turns=[_turn(0), _turn(0)]
        ),
        ["two records", "message_index=0"],
    ),
    (
        "bad-additional-history",
        lambda: Trajectory(additional_histories=[{"messages": [{"role": "x"}]}]),
        ["additional_histories", "messages[0].role"],
    ),
    (
        "unknown-field",
        lambda: Trajectory(rewards=1.0),
        ["rewards", "Extra inputs are not permitted"],
    ),
]


@pytest.mark.parametrize(
    ("make", "fragments"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_validation_error_names_the_field(make, fragments):
    with pytest.raises(ValidationError) as info:
        make()
    text = str(info.value)
    for fragment in fragments:
        assert fragment in text


def test_nan_reward_rejected_when_read_from_json():
    with pytest.raises(ValidationError, match="reward"):
        Trajectory.model_validate_json('{"reward": NaN}')


def test_trainable():
    context = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert not Trajectory(messages=context).trainable
    assert Trajectory(messages=context, turns=[_turn(1)]).trainable
    # a sampled turn in a sub-agent's conversation makes the whole rollout trainable
    sub = History(messages=context, turns=[_turn(1)])
    assert Trajectory(messages=context, additional_histories=[sub]).trainable
    assert not Trajectory(
        messages=context, additional_histories=[History(messages=context)]
    ).trainable
    assert sub.trainable and not History(messages=context).trainable


def test_group_helpers_and_histories():
    group = _groups()[0]
    assert len(group) == 2
    assert [t.reward for t in group] == group.rewards == [1.0, -0.25]
    t = group.trajectories[0]
    assert list(t.histories()) == [t, *t.additional_histories]
    t.log("more")
    assert t.logs[-1] == "more"


def test_rollout_error_from_exception_keeps_type_message_traceback():
    def fail() -> None:
        raise KeyError("missing")

    try:
        fail()
    except KeyError as e:
        error = RolloutError.from_exception(e)
    assert error.type == "KeyError"
    assert error.message == "'missing'"
    assert "in fail" in error.traceback and error.traceback.startswith("Traceback")
