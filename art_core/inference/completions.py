"""One chat or text completion through the gateway (art_core/inference/gateway.py):

1. parse and check the body (a 400 names what is wrong; a nested body too deep to decode is a
   400 too); plan strict tool calls (art_core/inference/tool_calls.py);
2. wait at the gate while a training step runs, then count the request in flight;
3. resolve the model name to an adapter of an engine; give a request without a generation cap
   the engine's `default_max_tokens`;
4. plan the splice (art_core/inference/splice.py): a chat that continues one this gateway served
   goes to vLLM's `/v1/completions` as token ids (never streamed upstream: a streaming client
   gets the finished answer in chunks) and comes back as a chat completion;
5. ask vLLM for the sampled tokens (`return_token_ids`, `logprobs`), through
   art_core/inference/upstream.py: retried once across an engine restart, cancelled when the
   client goes away;
6. record what was sampled in the ledger, remember it for the next turn's splice, and answer
   with our extension fields (`protocol.extend_response`); a streamed answer is relayed chunk by
   chunk and recorded at its end, and ends with an error event if vLLM dies in the middle.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from art_core.inference import upstream
from art_core.inference.ledger import accumulate, new_stream, record_of_stream
from art_core.inference.lora_turns import LoraTurns
from art_core.inference.splice import (
    SPLICE,
    Plan,
    Splicer,
    chat_response,
    completions_body,
    top_logprobs,
)
from art_core.inference.tool_calls import ToolCallError, plan_tools, stream_chunks
from art_core.protocol import error_body, extend_response, ledger_record

if TYPE_CHECKING:
    from art_core.inference.engine import VLLMEngine
    from art_core.inference.ledger import Ledger


class Route(Protocol):
    engine: VLLMEngine
    upstream: str  # the name vLLM knows
    public: str  # the name we report ("name@step" or the base name)
    step: int | None


class Gateway(Protocol):
    """What a completion needs of the gateway (art_core/inference/gateway.py)."""

    client: httpx.AsyncClient
    ledger: Ledger
    splicer: Splicer
    turns: LoraTurns
    restart_wait_s: float

    async def wait_gate(self) -> None: ...

    def enter(self) -> None: ...

    def exit(self) -> None: ...

    async def resolve(self, requested: Any) -> Route: ...


class GatewayError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def openai_error(status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in OpenAI's format (`protocol.error_body`) as a response."""
    return JSONResponse(error_body(status, message, param=param), status_code=status,
                        headers=headers)


def unavailable(e: upstream.EngineUnavailable) -> GatewayError:
    return GatewayError(503, e.message, headers={"Retry-After": str(upstream.RETRY_AFTER_S)})


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise GatewayError(400, "request body is nested too deeply to decode") from None
    except ValueError as e:
        raise GatewayError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "request body must be a JSON object")
    return body


Recorded = Callable[[dict[str, Any], dict[str, Any], dict[str, Any]], None]
"""`(request body, assistant message, ledger record)` of each answered chat request: a harness
rollout's record (harness.py)."""


async def completion(gw: Gateway, request: Request, path: str, *, model: str | None = None,
                     on_recorded: Recorded | None = None) -> Response:
    """One completion request through the gateway. `model` replaces the body's (a harness
    rollout serves its own model); `on_recorded` sees each answered chat request."""
    started_at = time.time()  # wall clock: the call's latency, as the caller sees it
    try:
        body = parse_body(await request.body())
        if model is not None:
            body["model"] = model
        chat = path.endswith("chat/completions")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise GatewayError(400, "'messages' is required: a non-empty list of "
                                   "messages", "messages")
        elif "prompt" not in body:
            raise GatewayError(400, "'prompt' is required", "prompt")
        try:  # strict tools: the call's shape is enforced by a grammar (tool_calls.py)
            plan = plan_tools(body) if chat else None
        except ToolCallError as e:
            raise GatewayError(400, str(e), e.param) from None
        requested = body.get("model")
        await gw.wait_gate()
        gw.enter()
        handed_off = False  # a stream releases its in-flight slot when it ends
        release = None
        try:
            route = await gw.resolve(requested)
            release = await gw.turns.admit(route.engine, route.upstream)  # lora_turns.py
            up = dict(body, model=route.upstream, return_token_ids=True)
            capped = _apply_default_cap(up, route.engine.config.default_max_tokens)
            if chat:
                up["logprobs"] = True
            elif not isinstance(body.get("logprobs"), int):
                up["logprobs"] = 0  # sampled-token logprobs only
            # token in, token out: a continued chat goes to vLLM as ids (splice.py)
            turn = await gw.splicer.plan(route.engine, body) if chat else Plan()
            if route.engine.config.oldest_first and "priority" not in body:
                up["priority"] = priority(turn.born or started_at)
            if plan is not None:
                up = plan.upstream(up)  # never streamed upstream: see tool_calls.py
            elif body.get("stream") and not turn.spliced:
                response, handed_off = await _stream(gw, route, path, up, requested, chat,
                                                     started_at, body, turn, capped,
                                                     release, on_recorded)
                return response
            target = path
            if turn.spliced:
                assert turn.prompt_ids is not None
                up, target = completions_body(up, turn.prompt_ids), "/v1/completions"
            r = await upstream.unless_disconnected(
                request.receive,
                upstream.post(gw.client, route.engine, target, up, gw.restart_wait_s))
            if r.status_code >= 400:
                return Response(r.content, status_code=r.status_code,
                                media_type="application/json")
            data = r.json()
            if turn.spliced:
                assert turn.prompt_ids is not None
                parse = plan is None and bool(body.get("tools")) and \
                    body.get("tool_choice") != "none"
                data = chat_response(data, turn.prompt_ids, parse, top_logprobs(body))
            if plan is not None:
                data = plan.convert(data)
            extend_response(data, served=route.public, step=route.step,
                            started_at=started_at, latency_s=time.time() - started_at)
            if chat:
                data[SPLICE] = {"spliced": turn.spliced, "reason": turn.reason}
                gw.splicer.remember(route.engine, body, data, turn, started_at)
            if capped:
                _warn_truncated(route, data)
            rec = ledger_record(data, requested, chat)
            gw.ledger.add(rec)
            if on_recorded is not None and chat:
                message = (data.get("choices") or [{}])[0].get("message") or {}
                on_recorded(body, {k: message[k] for k in ("content", "tool_calls")
                                   if message.get(k) is not None}, dict(rec))
            if body.get("stream"):  # strict tools, streamed: the finished response, chunked
                return _sse(stream_chunks(data, _include_usage(body)))
            return JSONResponse(data)
        finally:
            if not handed_off:
                if release is not None:
                    release()
                gw.exit()
    except GatewayError as e:
        return openai_error(e.status, e.message, param=e.param, headers=e.headers)
    except upstream.EngineUnavailable as e:
        err = unavailable(e)
        return openai_error(err.status, err.message, headers=err.headers)
    except upstream.ClientGone:
        return Response(status_code=499)  # nobody reads it
    except httpx.HTTPError as e:
        return openai_error(502, f"inference engine error: {type(e).__name__}: {e}")


async def _stream(gw: Gateway, route: Route, path: str, up: dict[str, Any],
                  requested: str, chat: bool, started_at: float, body: dict[str, Any],
                  turn: Plan, capped: bool, release: Callable[[], None],
                  on_recorded: Recorded | None = None) -> tuple[Response, bool]:
    """Relay vLLM's SSE stream, recording tokens as they pass. Returns (response, whether
    the in-flight slot and the engine's turn (`release`) were handed to the stream, which
    releases them when it ends)."""
    opened = await upstream.open_stream(gw.client, route.engine, path, up, gw.restart_wait_s)
    if opened.status_code >= 400:
        content = await opened.aread()
        await opened.aclose()
        return Response(content, status_code=opened.status_code,
                        media_type="application/json"), False

    async def relay() -> AsyncIterator[bytes]:
        acc = new_stream()
        done: list[bytes] = []  # the end marker waits for the ledger (see below)
        try:
            async for line in opened.aiter_lines():
                if not line:
                    continue
                if line.strip() == "data: [DONE]":
                    # a client that reads the ledger right after the stream ends (a recorder,
                    # a harness) must find the record: it is written before the marker is sent
                    done.append((line + "\n\n").encode())
                    continue
                if line.startswith("data: {"):
                    with contextlib.suppress(ValueError):
                        chunk = json.loads(line[6:])
                        accumulate(acc, chunk, chat)
                        chunk["model"] = route.public
                        if chat:  # clients that merge deltas (langchain) keep the id
                            for c in chunk.get("choices") or []:
                                if isinstance(c.get("delta"), dict):
                                    c["delta"].setdefault("id", acc["id"])
                        line = "data: " + json.dumps(chunk, separators=(",", ":"))
                yield (line + "\n\n").encode()
            if acc["id"] is not None:
                rec = record_of_stream(acc, requested, route.public, route.step,
                                       started_at, time.time() - started_at)
                if chat:
                    rec["splice"] = {"spliced": False, "reason": turn.reason}
                    gw.splicer.remember(route.engine, body, {
                        "prompt_token_ids": rec["prompt_token_ids"],
                        "choices": [{"token_ids": c["token_ids"], "message": acc["messages"][
                            c["index"]]} for c in rec["choices"]]}, turn, started_at)
                if capped:
                    _warn_truncated(route, {"choices": rec["choices"]})
                gw.ledger.add(rec)
                if on_recorded is not None and chat:
                    streamed = acc["messages"].get(0) or {}
                    message: dict[str, Any] = {"content": streamed.get("content") or None}
                    if streamed.get("tool_calls"):
                        message["tool_calls"] = streamed["tool_calls"]
                    on_recorded(body, message, dict(rec))
            for line_bytes in done:
                yield line_bytes
        except httpx.HTTPError as e:  # vLLM died mid-stream: say so, do not just stop
            yield upstream.sse_error(503, f"the inference engine of {route.engine.served_name!r}"
                                     f" stopped in the middle of this response ({type(e).__name__})"
                                     f" and is restarting; retry in about "
                                     f"{upstream.RETRY_AFTER_S} s")
            yield b"data: [DONE]\n\n"
        finally:
            await opened.aclose()
            release()
            gw.exit()

    return StreamingResponse(relay(), media_type="text/event-stream"), True


_EPOCH = time.time()


def priority(born: float) -> int:
    """vLLM's request priority (lower is scheduled first) for a conversation that began at
    `born`: its age in milliseconds since this process started, so older ones go first."""
    return max(0, int((born - _EPOCH) * 1000))


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def _sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    lines = [f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks]
    return StreamingResponse(iter([*lines, "data: [DONE]\n\n"]), media_type="text/event-stream")


def _apply_default_cap(up: dict[str, Any], cap: int | None) -> bool:
    """Give a request that sets no generation cap the engine's default; True if it did."""
    if cap is None or up.get("max_tokens") is not None or \
            up.get("max_completion_tokens") is not None:
        return False
    up["max_tokens"] = cap
    return True


_warned_cap: weakref.WeakSet[Any] = weakref.WeakSet()  # engines warned about (once each)


def _warn_truncated(route: Route, data: dict[str, Any]) -> None:
    """Warn once per engine when the default cap (not the client's own) cut an answer."""
    if route.engine in _warned_cap:
        return
    if any(c.get("finish_reason") == "length" for c in data.get("choices") or []):
        _warned_cap.add(route.engine)
        logging.getLogger(__name__).warning(
            "an answer of %s was cut at EngineConfig.default_max_tokens=%s because the request "
            "set no max_tokens; set max_tokens on the request or raise the default (the step "
            "metrics count such turns as truncated_turns)", route.public,
            route.engine.config.default_max_tokens)

