"""The LangGraph recorder without an engine: message conversion, how calls group into
conversations, and loud failures when nothing was recorded (tests/engine/test_langgraph.py runs
real graphs through the real gateway)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from art_langgraph import (
    NothingRecordedError,
    TrajectoryRecorder,
    record,
)
from art_langgraph.messages import same_message, to_openai_message
from art_langgraph.recorder import _Call, _conversations

# ---- unit: conversion and grouping -----------------------------------------------------------

CALL = {"id": "c1", "name": "lookup", "args": {"q": "x"}, "type": "tool_call"}


@pytest.mark.parametrize(("message", "expected"), [
    (SystemMessage("be brief"), {"role": "system", "content": "be brief"}),
    (HumanMessage("hi"), {"role": "user", "content": "hi"}),
    (HumanMessage([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
     {"role": "user", "content": "ab"}),
    (AIMessage("done"), {"role": "assistant", "content": "done"}),
    (AIMessage("", tool_calls=[CALL]),
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function",
          "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]}),
    (ToolMessage("42", tool_call_id="c1", name="lookup"),
     {"role": "tool", "content": "42", "tool_call_id": "c1"}),
], ids=["system", "human", "human-parts", "ai", "ai-tool-call", "tool"])
def test_to_openai_message(message, expected):
    assert to_openai_message(message) == expected


def test_same_message_compares_parsed_tool_arguments():
    a = to_openai_message(AIMessage("", tool_calls=[CALL]))
    b = {**a, "tool_calls": [{**a["tool_calls"][0], "function": {
        "name": "lookup", "arguments": '{ "q" : "x" }'}}]}
    assert same_message(a, b)
    assert not same_message(a, {**a, "tool_calls": []})


def _call(order: int, inputs: list[Any], output: Any, tools: Any = None) -> _Call:
    return _Call(order=order, inputs=inputs, tools=tools, model="m", base_url=None,
                 output=output, response_id=f"r{order}")


SYS, USER = SystemMessage("sys"), HumanMessage("question")
A1 = AIMessage("", tool_calls=[CALL])
T1 = ToolMessage("42", tool_call_id="c1")
A2 = AIMessage("the answer is 42")
SUM_IN = [SystemMessage("Summarize."), HumanMessage("the answer is 42")]
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}

GROUPING = [
    # (calls, tool outputs, expected [(n messages, trained indexes)] per conversation)
    ("one-call", [_call(0, [SYS, USER], A2)], {}, [(3, [2])]),
    ("continuation", [_call(0, [SYS, USER], A1), _call(1, [SYS, USER, A1, T1], A2)], {},
     [(5, [2, 4])]),
    ("summarizer-apart", [_call(0, [SYS, USER], A2), _call(1, SUM_IN, AIMessage("42"))], {},
     [(3, [2]), (3, [2])]),
    ("edited-history-starts-anew", [_call(0, [SYS, USER], A1), _call(1, [USER, A1, T1], A2)],
     {}, [(3, [2]), (4, [3])]),
    ("last-tool-result-from-on_tool_end", [_call(0, [SYS, USER], A1)], {"c1": T1},
     [(4, [2])]),
    ("parallel-subagents-same-input", [_call(0, [USER], A2), _call(1, [USER], A2)], {},
     [(2, [1]), (2, [1])]),
]


@pytest.mark.parametrize(("calls", "tool_outputs", "expected"),
                         [c[1:] for c in GROUPING], ids=[c[0] for c in GROUPING])
def test_calls_group_into_conversations(calls, tool_outputs, expected):
    convs = _conversations(calls, tool_outputs)
    assert [(len(c.messages), [i for i, _ in c.turns]) for c in convs] == expected
    for c in convs:
        for i, _ in c.turns:
            assert c.messages[i]["role"] == "assistant"


def test_tools_are_kept_per_conversation():
    convs = _conversations([_call(0, [USER], A1, tools=[TOOL]),
                            _call(1, [USER, A1, T1], A2, tools=[TOOL])], {})
    assert convs[0].tools == [TOOL]


@pytest.mark.parametrize("on_empty", ["raise", "warn"])
def test_nothing_recorded_is_loud(on_empty):
    rec = TrajectoryRecorder(base_url="http://127.0.0.1:9/v1", on_empty=on_empty)
    if on_empty == "raise":
        with pytest.raises(NothingRecordedError, match="callbacks"):
            rec.finish()
    else:
        with pytest.warns(UserWarning, match="no chat-model call"):
            assert rec.finish().messages == []


def test_record_block_with_no_call_raises():
    with pytest.raises(NothingRecordedError, match="record\\(\\)"), record():
        pass
