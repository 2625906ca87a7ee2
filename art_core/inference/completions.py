"""One chat or text completion through the gateway (art_core/inference/gateway.py):

1. parse and check the body (a 400 names what is wrong; a nested body too deep to decode is a
   400 too); plan strict tool calls (art_core/inference/tool_calls.py);
2. wait at the gate while a training step runs, then count the request in flight;
3. resolve the model name to an adapter of an engine;
4. ask vLLM for the sampled tokens (`return_token_ids`, `logprobs`), through
   art_core/inference/upstream.py: retried once across an engine restart, cancelled when the
   client goes away;
5. record what was sampled in the ledger and answer with our extension fields
   (`protocol.extend_response`); a streamed answer is relayed chunk by chunk and recorded at
   its end, and ends with an error event if vLLM dies in the middle.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from art_core.inference import upstream
from art_core.inference.ledger import accumulate, new_stream, record_of_stream
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


async def completion(gw: Gateway, request: Request, path: str) -> Response:
    started_at = time.time()  # wall clock: the call's latency, as the caller sees it
    try:
        body = parse_body(await request.body())
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
        try:
            route = await gw.resolve(requested)
            up = dict(body, model=route.upstream, return_token_ids=True)
            if chat:
                up["logprobs"] = True
            elif not isinstance(body.get("logprobs"), int):
                up["logprobs"] = 0  # sampled-token logprobs only
            if plan is not None:
                up = plan.upstream(up)  # never streamed upstream: see tool_calls.py
            elif body.get("stream"):
                response, handed_off = await _stream(gw, route, path, up, requested, chat,
                                                     started_at)
                return response
            r = await upstream.unless_disconnected(
                request.receive,
                upstream.post(gw.client, route.engine, path, up, gw.restart_wait_s))
            if r.status_code >= 400:
                return Response(r.content, status_code=r.status_code,
                                media_type="application/json")
            data = r.json()
            if plan is not None:
                data = plan.convert(data)
            extend_response(data, served=route.public, step=route.step,
                            started_at=started_at, latency_s=time.time() - started_at)
            gw.ledger.add(ledger_record(data, requested, chat))
            if body.get("stream"):  # strict tools, streamed: the finished response, chunked
                return _sse(stream_chunks(data, _include_usage(body)))
            return JSONResponse(data)
        finally:
            if not handed_off:
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
                  requested: str, chat: bool, started_at: float) -> tuple[Response, bool]:
    """Relay vLLM's SSE stream, recording tokens as they pass. Returns (response, whether
    the in-flight slot was handed to the stream, which releases it when it ends)."""
    opened = await upstream.open_stream(gw.client, route.engine, path, up, gw.restart_wait_s)
    if opened.status_code >= 400:
        content = await opened.aread()
        await opened.aclose()
        return Response(content, status_code=opened.status_code,
                        media_type="application/json"), False

    async def relay() -> AsyncIterator[bytes]:
        acc = new_stream()
        try:
            async for line in opened.aiter_lines():
                if not line:
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
                gw.ledger.add(record_of_stream(acc, requested, route.public, route.step,
                                               started_at, time.time() - started_at))
        except httpx.HTTPError as e:  # vLLM died mid-stream: say so, do not just stop
            yield upstream.sse_error(503, f"the inference engine of {route.engine.served_name!r}"
                                     f" stopped in the middle of this response ({type(e).__name__})"
                                     f" and is restarting; retry in about "
                                     f"{upstream.RETRY_AFTER_S} s")
            yield b"data: [DONE]\n\n"
        finally:
            await opened.aclose()
            gw.exit()

    return StreamingResponse(relay(), media_type="text/event-stream"), True


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def _sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    lines = [f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks]
    return StreamingResponse(iter([*lines, "data: [DONE]\n\n"]), media_type="text/event-stream")
