"""The gateway's ledger records: what was sampled for each response, keyed by response id.

A record holds what training needs and what a client that drops unknown response fields
(langchain-openai) cannot keep: the model asked for and the one served ("name@step"), the
prompt token ids, and per choice the sampled token ids, their logprobs and the finish reason.

    {"id", "model", "served", "step", "prompt_token_ids", "started_at", "latency_s",
     "choices": [{"index", "token_ids", "logprobs", "finish_reason"}]}

A whole response is turned into a record at once (`record_of`); a streamed one is
accumulated chunk by chunk as it passes (`accumulate`) and recorded when it ends
(`record_of_stream`). The gateway keeps the records in a bounded ledger (art_core/gateway.py)
served at `GET /v1/art/completions/{id}` and `POST /v1/art/completions/batch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from art_core.gateway import Route


def logprob_list(choice: dict[str, Any], chat: bool) -> list[float]:
    lp = choice.get("logprobs") or {}
    if chat:
        return [t["logprob"] for t in lp.get("content") or []]
    return list(lp.get("token_logprobs") or [])


def record_of(data: dict[str, Any], requested: str, route: Route, chat: bool
              ) -> dict[str, Any]:
    return {
        "id": data["id"], "model": requested, "served": route.public, "step": route.step,
        "prompt_token_ids": data.get("prompt_token_ids"),
        "started_at": data.get("art_started_at"), "latency_s": data.get("art_latency_s"),
        "choices": [
            {"index": c.get("index", i), "token_ids": c.get("token_ids") or [],
             "logprobs": logprob_list(c, chat), "finish_reason": c.get("finish_reason")}
            for i, c in enumerate(data.get("choices") or [])
        ],
    }


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


def record_of_stream(acc: dict[str, Any], requested: str, route: Route) -> dict[str, Any]:
    return {
        "id": acc["id"], "model": requested, "served": route.public, "step": route.step,
        "prompt_token_ids": acc["prompt_token_ids"],
        "choices": [dict(index=i, **c) for i, c in sorted(acc["choices"].items())],
    }
