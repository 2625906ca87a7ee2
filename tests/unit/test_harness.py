"""Harness mode without an engine: the gateway's rollout routes (start, 404 for an unknown id,
409 once finished, a bad body named) and how a rollout's recorded calls become a trajectory
(continuations extend a conversation, a rewritten history starts another, the main one has the
most turns). The recording of real agent programs: tests/engine/test_harness.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from art_core.env import HarnessError, build_trajectory
from art_core.inference.engine import VLLMEngine
from art_core.inference.gateway import Gateway, ServedModel

SYSTEM = {"role": "system", "content": "Be brief."}


def gateway(tmp_path: Path) -> Gateway:
    gw = Gateway(drain_timeout_s=5)
    engine = VLLMEngine(str(tmp_path), served_name="base-model")
    engine.adapters = {"m@0": "x"}  # as if loaded
    gw.add_engine(engine)
    gw.models["m"] = ServedModel("m", engine, checkpoints={0: tmp_path}, latest=0)
    return gw


async def test_rollout_routes_start_refuse_unknown_and_finished_ids(tmp_path):
    gw = gateway(tmp_path)
    transport = httpx.ASGITransport(app=gw.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        r = await c.post("/v1/art/rollouts", json={"model": "nope"})
        assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]
        r = await c.post("/v1/art/rollouts", json={"name": "m"})
        assert r.status_code == 400 and '{"model"' in r.json()["error"]["message"]
        started = (await c.post("/v1/art/rollouts", json={"model": "m"})).json()
        rid = started["id"]
        assert started["path"] == f"/v1/art/rollouts/{rid}/v1"
        chat = {"model": "anything", "messages": [{"role": "user", "content": "hi"}]}
        r = await c.post("/v1/art/rollouts/0123/v1/chat/completions", json=chat)
        assert r.status_code == 404 and "no rollout with id '0123'" in r.json()["error"]["message"]
        r = await c.post(f"/v1/art/rollouts/{rid}/finish")
        assert r.status_code == 200 and r.json() == {"model": "m", "calls": []}
        for path in (f"/v1/art/rollouts/{rid}/finish", f"{started['path']}/chat/completions"):
            r = await c.post(path, json=chat)
            assert r.status_code == 409 and "has finished" in r.json()["error"]["message"]


def record(n: int, prompt: list[int]) -> dict:
    return {"id": f"r{n}", "step": 0, "prompt_token_ids": prompt,
            "choices": [{"index": 0, "token_ids": [100 + n], "logprobs": [-0.5],
                         "finish_reason": "stop"}]}


def call(n: int, messages: list[dict], answer: dict, prompt: list[int] | None = None) -> dict:
    return {"messages": messages, "tools": None, "message": {"role": "assistant", **answer},
            "record": record(n, prompt or [1, 2, n])}


def test_calls_become_conversations_main_first_by_turns():
    q1 = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    a1 = {"content": "Red."}
    calls_ = {"x": {"id": "c1", "type": "function",
                    "function": {"name": "look", "arguments": '{"a": 1}'}}}
    # the follow-up re-serialises the tool call's arguments: still the same message (by id)
    q2 = [*q1, {"role": "assistant", "content": "Red.", "tool_calls": None},
          {"role": "user", "content": "Look it up."}]
    a2 = {"content": None, "tool_calls": [calls_["x"]]}
    q3 = [*q2, {"role": "assistant", "content": None, "tool_calls": [
        {**calls_["x"], "function": {"name": "look", "arguments": '{ "a":1 }'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "red is #f00"}]
    side = [{"role": "user", "content": "Summarise: red."}]  # a sub-agent's own conversation
    traj = build_trajectory([call(1, q1, a1), call(2, side, {"content": "Red."}),
                             call(3, q2, a2), call(4, q3, {"content": "#f00"})])
    assert [t.message_index for t in traj.turns] == [2, 4, 6]
    assert [t.response_id for t in traj.turns] == ["r1", "r3", "r4"]
    assert traj.messages[-1] == {"role": "assistant", "content": "#f00"}
    assert traj.messages[2]["tool_calls"] is None  # the request's own messages are kept
    (sub,) = traj.additional_histories
    assert [t.response_id for t in sub.turns] == ["r2"] and sub.messages[0] == side[0]


def test_a_rewritten_history_starts_a_new_conversation():
    q = [SYSTEM, {"role": "user", "content": "Name a colour."}]
    rewritten = [SYSTEM, {"role": "user", "content": "Name a colour, please."},
                 {"role": "assistant", "content": "Red."}, {"role": "user", "content": "More?"}]
    traj = build_trajectory([call(1, q, {"content": "Red."}), call(2, rewritten,
                                                                   {"content": "Blue."})])
    assert len(traj.turns) == 1 and len(traj.additional_histories) == 1


@pytest.mark.parametrize(("calls", "problem"), [
    ([], "made no chat completion through its rollout's base URL"),
    ([{**call(1, [SYSTEM], {"content": "x"}), "record": {"id": "r", "choices": []}}],
     "call 0 of the rollout carries no sampled tokens"),
])
def test_a_rollout_with_nothing_to_train_is_refused(calls, problem):
    with pytest.raises(HarnessError, match=problem):
        build_trajectory(calls)
