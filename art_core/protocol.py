"""What crosses HTTP between our parts, owned by neither side (no FastAPI, no httpx here).

- The control API of `art serve` lives under `API_PREFIX`; a training request streams the
  phases in `TRAIN_PHASES`.
- Every gateway response carries the sampled tokens (vLLM's `prompt_token_ids` and per choice
  `token_ids`, with `logprobs`) plus our extension fields; `extend_response` writes them and
  `read_response` reads them back as a `Sampled`, the fields of a `SampledTurn`.
- The gateway's ledger keeps a `LedgerRecord` per response id (for clients that drop unknown
  fields, such as langchain-openai); `ledger_record` builds one from a response and
  `read_record` reads it back as a `Sampled`.
- Errors are one JSON shape everywhere, OpenAI's: `error_body`, with one status table.
- Invariant 8: `bind_refusal` says why a server must not listen on an address without a key.
"""

from __future__ import annotations

import ipaddress
import json
import re
from typing import Any, NotRequired, TypedDict

API_PREFIX = "/art/v1"
"""The control API of `art serve` (register, train, checkpoints, jobs)."""

LEDGER_PATH = "/art/completions"
"""Ledger routes under the OpenAI base URL (`.../v1`): `GET {LEDGER_PATH}/{id}` and
`POST {LEDGER_PATH}/batch {"ids": [...]}` -> `{"data": [records], "missing": [ids]}`."""

TRAIN_PHASES = ("journaled", "paused", "trained", "published", "done")
"""The progress events of one training step, in order ("paused" comes after "trained" when
the step keeps serving while it trains)."""

REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A train request's id: committed with the step it produced, so a retry never trains twice."""

# extension fields of a gateway response (besides vLLM's own prompt_token_ids / token_ids)
STEP = "art_step"
STARTED_AT = "art_started_at"
LATENCY_S = "art_latency_s"
SPLICE = "art_splice"  # {"spliced": bool, "reason": str | None}: token in (inference/splice.py)
CONSTRAINED_FROM = "art_constrained_from"  # per choice: first grammar-chosen token, or None


# ---- sampled tokens --------------------------------------------------------------------------


class Sampled(TypedDict):
    """The fields of a `SampledTurn` that the engine and the gateway provide."""

    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    step: int | None
    response_id: str | None
    finish_reason: str | None
    started_at: float | None
    latency_s: float | None
    constrained_from: int | None
    spliced: bool | None
    splice_reason: str | None


def logprob_list(choice: dict[str, Any], chat: bool = True) -> list[float]:
    """The sampled tokens' logprobs of one choice (chat: `logprobs.content[].logprob`;
    completions: `logprobs.token_logprobs`)."""
    lp = choice.get("logprobs") or {}
    if chat:
        return [t["logprob"] for t in lp.get("content") or []]
    return list(lp.get("token_logprobs") or [])


def extend_response(data: dict[str, Any], *, served: str, step: int | None,
                    started_at: float, latency_s: float) -> dict[str, Any]:
    """Write our fields onto a response from vLLM (in place; returned for chaining)."""
    data["model"] = served
    data[STEP] = step
    data[STARTED_AT] = started_at
    data[LATENCY_S] = round(latency_s, 6)
    return data


def _content_text(content: Any) -> Any:
    return content if isinstance(content, str | None) else json.dumps(content, sort_keys=True)


def message_key(m: dict[str, Any]) -> str:
    """What identifies a message in a conversation. An assistant message is identified by its
    tool-call ids when it has calls (clients re-serialise the arguments) and else by its text."""
    role = m.get("role")
    if role == "assistant":
        calls = m.get("tool_calls") or []
        if calls:
            return json.dumps(["assistant", [c.get("id") for c in calls if isinstance(c, dict)]])
        return json.dumps(["assistant", _content_text(m.get("content")) or ""])
    return json.dumps([role, _content_text(m.get("content")), m.get("tool_call_id"),
                       m.get("name")])


def read_response(data: dict[str, Any], choice: int = 0, chat: bool = True) -> Sampled | None:
    """The sampled tokens of one choice of a gateway response, or None when the response
    carries none (it was not served by our gateway)."""
    choices = data.get("choices") or []
    if not 0 <= choice < len(choices):
        return None
    ch = choices[choice]
    prompt, tokens = data.get("prompt_token_ids"), ch.get("token_ids")
    if chat and (ch.get("logprobs") or {}).get("content") is None:
        return None
    if not prompt or not tokens:
        return None
    splice = data.get(SPLICE) or {}
    return Sampled(prompt_token_ids=list(prompt), completion_token_ids=list(tokens),
                   logprobs=logprob_list(ch, chat), step=data.get(STEP),
                   response_id=data.get("id"), finish_reason=ch.get("finish_reason"),
                   started_at=data.get(STARTED_AT), latency_s=data.get(LATENCY_S),
                   constrained_from=ch.get(CONSTRAINED_FROM), spliced=splice.get("spliced"),
                   splice_reason=splice.get("reason"))


# ---- the ledger ------------------------------------------------------------------------------


class LedgerChoice(TypedDict, total=False):
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    constrained_from: int | None  # first token a tool-call grammar chose (tool_calls.py)


class LedgerRecord(TypedDict):
    """What the gateway keeps per response id: the model asked for and the one served
    ("name@step"), the prompt's token ids and per choice what was sampled."""

    id: str
    model: str | None
    served: str
    step: int | None
    prompt_token_ids: list[int] | None
    started_at: float | None
    latency_s: float | None
    choices: list[LedgerChoice]
    splice: NotRequired[dict[str, Any] | None]  # {"spliced", "reason"} (inference/splice.py)


def ledger_record(data: dict[str, Any], requested: str | None, chat: bool = True
                  ) -> LedgerRecord:
    """The ledger record of a whole (extended) gateway response."""
    return LedgerRecord(
        id=data["id"], model=requested, served=data.get("model") or "", step=data.get(STEP),
        prompt_token_ids=data.get("prompt_token_ids"), started_at=data.get(STARTED_AT),
        latency_s=data.get(LATENCY_S), splice=data.get(SPLICE),
        choices=[LedgerChoice(index=c.get("index", i), token_ids=c.get("token_ids") or [],
                              logprobs=logprob_list(c, chat),
                              finish_reason=c.get("finish_reason"),
                              constrained_from=c.get(CONSTRAINED_FROM))
                 for i, c in enumerate(data.get("choices") or [])])


def read_record(rec: dict[str, Any], choice: int = 0) -> Sampled | None:
    """The sampled tokens of one choice of a ledger record, or None if it has none."""
    choices = rec.get("choices") or []
    if not 0 <= choice < len(choices) or not choices[choice].get("token_ids"):
        return None
    if not rec.get("prompt_token_ids"):
        return None
    ch = choices[choice]
    return Sampled(prompt_token_ids=list(rec["prompt_token_ids"]),
                   completion_token_ids=list(ch["token_ids"]), logprobs=list(ch["logprobs"]),
                   step=rec.get("step"), response_id=rec.get("id"),
                   finish_reason=ch.get("finish_reason"), started_at=rec.get("started_at"),
                   latency_s=rec.get("latency_s"), constrained_from=ch.get("constrained_from"),
                   spliced=(rec.get("splice") or {}).get("spliced"),
                   splice_reason=(rec.get("splice") or {}).get("reason"))


# ---- errors ----------------------------------------------------------------------------------

STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                409: "conflict_error", 413: "invalid_request_error",
                422: "invalid_request_error", 503: "service_unavailable",
                507: "insufficient_storage"}


def error_body(status: int, message: str, code: str | int | None = None,
               param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_ or STATUS_TYPES.get(status, "server_error"),
                      "param": param, "code": code if code is not None else status}}


# ---- binding ---------------------------------------------------------------------------------


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; False for any other name or address."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_refusal(host: str, api_key: str | None) -> str | None:
    """Why a server must not listen on `host` with this key, or None when it may
    (ARCHITECTURE invariant 8: no non-loopback bind without an API key)."""
    if api_key or is_loopback_host(host):
        return None
    return (f"refusing to listen on {host!r} without an API key: anyone who can reach that "
            "address could run inference, train models and download checkpoints. Set an API "
            "key (art serve --api-key or the ART_API_KEY environment variable; "
            "LocalBackend(api_key=...)), or bind a loopback address such as 127.0.0.1.")
