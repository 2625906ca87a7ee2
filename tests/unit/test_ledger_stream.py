"""A streamed chat answer as the gateway accumulates it (art_core/inference/ledger.py): token
ids and logprobs concatenated per choice, the text, and tool calls whole (id, name, arguments
from their fragments), which a harness rollout records as the answer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx

from art_core.inference.completions import _stream
from art_core.inference.ledger import Ledger, accumulate, new_stream, record_of_stream


def chunk(delta: dict, token_ids: list[int], finish: str | None = None, **top) -> dict:
    return {"id": "chatcmpl-1", **top, "choices": [{
        "index": 0, "delta": delta, "token_ids": token_ids, "finish_reason": finish,
        "logprobs": {"content": [{"logprob": -0.1 * t} for t in token_ids]}}]}


def test_a_streamed_answer_with_two_tool_calls_is_rebuilt_whole():
    acc = new_stream()
    stream = [
        chunk({"role": "assistant", "content": "Let me "}, [1], prompt_token_ids=[7, 8, 9]),
        chunk({"content": "look."}, [2]),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "look_", "arguments": ""}}]}, [3]),
        chunk({"tool_calls": [{"index": 0, "function": {"name": "up", "arguments": '{"q": '}}]},
              [4]),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"pens"}'}}]}, [5]),
        chunk({"tool_calls": [{"index": 1, "id": "call_b",
                               "function": {"name": "move", "arguments": "{}"}}]}, [6],
              finish="tool_calls"),
    ]
    for c in stream:
        accumulate(acc, c, chat=True)
    assert acc["messages"][0] == {"content": "Let me look.", "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "look_up", "arguments": '{"q": "pens"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "move", "arguments": "{}"}}]}
    rec = record_of_stream(acc, "agent", "agent@2", 2, started_at=1.0, latency_s=0.5)
    assert rec["prompt_token_ids"] == [7, 8, 9] and rec["step"] == 2
    (choice,) = rec["choices"]
    assert choice["token_ids"] == [1, 2, 3, 4, 5, 6] and choice["finish_reason"] == "tool_calls"
    assert choice["logprobs"] == [-0.1 * t for t in range(1, 7)]


async def test_a_stream_is_in_the_ledger_before_its_end_marker_is_sent():
    """A recorder or harness reads the ledger as soon as its stream ends (the openai SDK ends it at
    `[DONE]`): the record must exist by then. Seen failing: test_langgraph's streamed modes once
    asked before the relay had recorded."""
    chunks = [{"id": "cmpl-1", "choices": [{"index": 0, "text": t, "token_ids": [i],
                                            "prompt_token_ids": [5, 6] if i == 1 else None,
                                            "finish_reason": "length" if i == 2 else None}]}
              for i, t in ((1, "a"), (2, "b"))]
    sse = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"
    vllm = httpx.MockTransport(lambda _: httpx.Response(
        200, content=sse, headers={"content-type": "text/event-stream"}))
    released: list[str] = []
    gw = SimpleNamespace(client=httpx.AsyncClient(transport=vllm), restart_wait_s=1.0,
                         ledger=Ledger(8), exit=lambda: released.append("gateway"))
    engine = SimpleNamespace(base_url="http://vllm", generation=0, served_name="m")
    route = SimpleNamespace(engine=engine, public="m@0", step=0)
    response, handed = await _stream(gw, route, "/v1/completions", {}, "m", False, 0.0, {},
                                     None, False, lambda: released.append("turn"))
    assert handed
    seen_at_end = None
    async for part in response.body_iterator:
        if part.startswith(b"data: [DONE]"):
            seen_at_end = dict(gw.ledger)
    assert seen_at_end is not None and list(seen_at_end) == ["cmpl-1"]
    assert seen_at_end["cmpl-1"]["choices"][0]["token_ids"] == [1, 2]
    assert released == ["turn", "gateway"]
