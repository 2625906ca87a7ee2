"""The gateway's ledger: what was sampled for each response, keyed by response id.

A record (`art_core.protocol.LedgerRecord`) holds what training needs and what a client that
drops unknown response fields (langchain-openai) cannot keep: the model asked for and the one
served ("name@step"), the prompt token ids, and per choice the sampled token ids, their
logprobs and the finish reason.

A whole response becomes a record at once (`protocol.ledger_record`); a streamed one is
accumulated chunk by chunk as it passes (`accumulate`) and recorded when it ends
(`record_of_stream`). The gateway keeps the records in a bounded `Ledger`, served at
`GET /v1/art/completions/{id}` and `POST /v1/art/completions/batch`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from art_core.protocol import LedgerChoice, LedgerRecord, logprob_list


class Ledger(OrderedDict[str, LedgerRecord]):
    """Records by response id; the oldest are evicted beyond `size`."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def add(self, rec: LedgerRecord) -> None:
        self[rec["id"]] = rec
        while len(self) > self.size:
            self.popitem(last=False)


def new_stream() -> dict[str, Any]:
    """The accumulator of one streamed response."""
    return {"id": None, "prompt_token_ids": None, "choices": {}, "messages": {}}


def accumulate(acc: dict[str, Any], chunk: dict[str, Any], chat: bool) -> None:
    acc["id"] = acc["id"] or chunk.get("id")
    if chunk.get("prompt_token_ids") is not None:
        acc["prompt_token_ids"] = chunk["prompt_token_ids"]
    for c in chunk.get("choices") or []:
        slot = acc["choices"].setdefault(
            c.get("index", 0), {"token_ids": [], "logprobs": [], "finish_reason": None})
        slot["token_ids"] += c.get("token_ids") or []
        slot["logprobs"] += logprob_list(c, chat)
        if c.get("prompt_token_ids") is not None:  # /v1/completions puts it per choice
            acc["prompt_token_ids"] = c["prompt_token_ids"]
        slot["finish_reason"] = c.get("finish_reason") or slot["finish_reason"]
        delta = c.get("delta")
        if chat and isinstance(delta, dict):  # what identifies the message (splice.py)
            msg = acc["messages"].setdefault(c.get("index", 0), {"content": "", "tool_calls": []})
            msg["content"] += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                if not isinstance(tc, dict):
                    continue
                if tc.get("id"):  # a new call; the deltas after it extend it
                    msg["tool_calls"].append({"id": tc["id"], "type": "function",
                                              "function": {"name": "", "arguments": ""}})
                if msg["tool_calls"]:
                    fn, into = tc.get("function") or {}, msg["tool_calls"][-1]["function"]
                    into["name"] += fn.get("name") or ""
                    into["arguments"] += fn.get("arguments") or ""


def record_of_stream(acc: dict[str, Any], requested: str | None, served: str, step: int | None,
                     started_at: float, latency_s: float) -> LedgerRecord:
    return LedgerRecord(
        id=acc["id"], model=requested, served=served, step=step,
        prompt_token_ids=acc["prompt_token_ids"], started_at=started_at,
        latency_s=round(latency_s, 6),
        choices=[LedgerChoice(index=i, **c) for i, c in sorted(acc["choices"].items())])
