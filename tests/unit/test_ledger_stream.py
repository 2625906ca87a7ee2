"""A streamed chat answer as the gateway accumulates it (art_core/inference/ledger.py): token
ids and logprobs concatenated per choice, the text, and tool calls whole (id, name, arguments
from their fragments), which a harness rollout records as the answer."""

from __future__ import annotations

from art_core.inference.ledger import accumulate, new_stream, record_of_stream


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
