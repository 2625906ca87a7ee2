"""The gateway: our OpenAI-compatible front door to vLLM that records exactly what was sampled.

For every request it
1. resolves the model name: "<name>" -> that model's latest checkpoint, "<name>@<step>" -> that
   step (loaded on demand), a base model's name -> the base; anything else is a 404;
2. waits at the gate while a training step runs (new requests wait, they do not fail);
3. asks vLLM for sampled-token logprobs and token ids (`logprobs`, `return_token_ids`);
4. records prompt ids, completion ids, logprobs, finish reason and serving step in a bounded
   ledger keyed by response id (`GET /v1/art/completions/{id}`), for recorders whose client
   drops unknown fields (langchain-openai), and returns them as extra fields in the response.
   A streamed chat response also carries its id in each choice's `delta`, because clients that
   merge deltas into a message (langchain-openai) keep nothing else of the response id;
5. enforces strict tool calls (a forced `tool_choice`, or `strict: true` on a function) with a
   grammar of the hermes call form and returns them as `tool_calls` (art_core/inference/tool_calls.py).

It runs in its own thread and event loop (`GatewayServer`, art_core/inference/gateway_server.py) so that
user code which blocks its own loop (a sync LangGraph `invoke`) cannot stall inference. What a
ledger record holds, and how a streamed response is accumulated into one:
art_core/inference/ledger.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from art_core.inference.engine import EngineError, VLLMEngine
from art_core.inference.ledger import Ledger, accumulate, new_stream, record_of_stream
from art_core.inference.tool_calls import ToolCallError, plan_tools, stream_chunks
from art_core.protocol import LEDGER_PATH, error_body, extend_response, ledger_record

log = logging.getLogger(__name__)


def openai_error(status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in OpenAI's format (`protocol.error_body`) as a response."""
    return JSONResponse(error_body(status, message, param=param), status_code=status,
                        headers=headers)


class GatewayError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class ServedModel:
    """A trainable model as the gateway sees it: its engine and its checkpoints."""

    name: str
    engine: VLLMEngine
    project: str = "default"
    checkpoints: dict[int, Path] = field(default_factory=dict)
    latest: int = 0
    keep_loaded: int = 3


@dataclass
class Route:
    engine: VLLMEngine
    upstream: str  # the name vLLM knows
    public: str  # the name we report ("name@step" or the base name)
    step: int | None


class Gateway:
    """The FastAPI app and the state behind it (engines, models, gate, ledger)."""

    def __init__(self, *, ledger_size: int = 50_000, gate_timeout_s: float = 3600.0,
                 drain_timeout_s: float = 600.0) -> None:
        self.engines: dict[str, VLLMEngine] = {}
        self.models: dict[str, ServedModel] = {}
        self.ledger = Ledger(ledger_size)
        self.gate_timeout_s = gate_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.in_flight = 0
        self._gate_open: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._client: httpx.AsyncClient | None = None
        self._load_lock: asyncio.Lock | None = None
        self.app = FastAPI(title="art gateway", docs_url=None, redoc_url=None)
        self._add_routes(self.app)

    # ---- state shared with backends (call in the gateway's loop) --------------------------

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._gate_open is None or self._idle is None:
            self._gate_open, self._idle = asyncio.Event(), asyncio.Event()
            self._gate_open.set()
            self._idle.set()
        return self._gate_open, self._idle

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=10.0),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128),
            )
        return self._client

    def add_engine(self, engine: VLLMEngine) -> None:
        self.engines[engine.served_name] = engine

    async def publish(self, name: str, engine: VLLMEngine, step: int, path: Path,
                      project: str | None = None) -> None:
        """Load checkpoint `step` of model `name` and make it what "<name>" serves."""
        served = self.models.setdefault(name, ServedModel(name, engine, project or "default"))
        served.checkpoints[step] = Path(path)
        await asyncio.to_thread(engine.load_adapter, f"{name}@{step}", path)
        served.latest = max(served.checkpoints)
        self._unload_old(served)

    def forget_checkpoints(self, name: str, steps: list[int]) -> None:
        served = self.models.get(name)
        for step in steps:
            if served is not None and step != served.latest:
                served.checkpoints.pop(step, None)
                served.engine.unload_adapter(f"{name}@{step}")

    def _unload_old(self, served: ServedModel) -> None:
        loaded = sorted(
            int(n.rsplit("@", 1)[1]) for n in served.engine.adapters
            if n.rsplit("@", 1)[0] == served.name
        )
        for step in loaded[: max(0, len(loaded) - served.keep_loaded)]:
            if step != served.latest:
                served.engine.unload_adapter(f"{served.name}@{step}")

    async def pause(self) -> None:
        """Close the gate and wait until requests already running have finished.

        The wait is bounded (`drain_timeout_s`): a request whose client vanished must not be
        able to hold training back forever."""
        gate, idle = self._events()
        gate.clear()
        try:
            await asyncio.wait_for(idle.wait(), self.drain_timeout_s)
        except TimeoutError:
            log.warning("%d requests still running after %.0f s; training starts anyway",
                        self.in_flight, self.drain_timeout_s)

    def resume(self) -> None:
        self._events()[0].set()

    @property
    def paused(self) -> bool:
        return not self._events()[0].is_set()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ---- request path ----------------------------------------------------------------------

    async def resolve(self, requested: Any) -> Route:
        if not isinstance(requested, str) or not requested:
            raise GatewayError(400, "'model' is required and must be a string", "model")
        if requested in self.engines:
            engine = self.engines[requested]
            if engine.config.serve_merged and engine.adapters:
                raise GatewayError(404, f"The model '{requested}' is not served as it is: its "
                                   f"engine serves {next(iter(engine.adapters))} as merged "
                                   "weights (EngineConfig.serve_merged)", "model")
            return Route(engine, requested, requested, None)
        name, sep, step_s = requested.rpartition("@")
        if not sep:
            name, step_s = requested, ""
        served = self.models.get(name)
        if served is None:
            known = sorted([*self.models, *self.engines])
            raise GatewayError(404, f"The model '{requested}' does not exist. Served: {known}",
                               "model")
        if not step_s:
            step = served.latest
        elif step_s.isdigit():
            step = int(step_s)
        else:
            raise GatewayError(400, f"invalid step in model name '{requested}'", "model")
        if step not in served.checkpoints:
            raise GatewayError(404, f"The model '{name}' has no step {step}; steps: "
                               f"{sorted(served.checkpoints)}", "model")
        upstream = f"{name}@{step}"
        if served.engine.config.serve_merged:  # only the latest step, as the base's weights
            try:
                return Route(served.engine, served.engine.upstream_name(upstream), upstream,
                             step)
            except EngineError as e:
                raise GatewayError(404, f"The model '{requested}' is not served: {e}",
                                   "model") from None
        if upstream not in served.engine.adapters:  # an older step, unloaded: load on demand
            if self._load_lock is None:
                self._load_lock = asyncio.Lock()
            async with self._load_lock:
                await asyncio.to_thread(served.engine.load_adapter, upstream,
                                        served.checkpoints[step])
        return Route(served.engine, upstream, upstream, step)

    async def _wait_gate(self) -> None:
        gate, _ = self._events()
        if not gate.is_set():
            try:
                await asyncio.wait_for(gate.wait(), self.gate_timeout_s)
            except TimeoutError:
                raise GatewayError(503, f"the model is training and did not resume within "
                                   f"{self.gate_timeout_s:.0f} s") from None

    def _enter(self) -> None:
        self.in_flight += 1
        self._events()[1].clear()

    def _exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._events()[1].set()

    async def _send(self, route: Route, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST to vLLM; if the engine is down (restarting), wait for it once and retry."""
        for attempt in (0, 1):
            try:
                return await self.client.post(route.engine.base_url + path, json=body)
            except httpx.TransportError:
                if attempt:
                    raise
                try:
                    await asyncio.to_thread(route.engine.wait_ready)
                except EngineError as e:
                    raise GatewayError(503, f"the inference engine is down: {e}") from e
        raise AssertionError("unreachable")

    async def _open_stream(self, route: Route, path: str, body: dict[str, Any]
                           ) -> httpx.Response:
        for attempt in (0, 1):
            try:
                req = self.client.build_request("POST", route.engine.base_url + path, json=body)
                return await self.client.send(req, stream=True)
            except httpx.TransportError:
                if attempt:
                    raise
                await asyncio.to_thread(route.engine.wait_ready)
        raise AssertionError("unreachable")

    async def completion(self, request: Request, path: str) -> Response:
        started_at = time.time()  # wall clock: the call's latency, as the caller sees it
        try:
            raw = await request.body()
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise GatewayError(400, f"request body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise GatewayError(400, "request body must be a JSON object")
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
            await self._wait_gate()
            self._enter()
            handed_off = False  # a stream releases its in-flight slot when it ends
            try:
                route = await self.resolve(requested)
                up = dict(body, model=route.upstream, return_token_ids=True)
                if chat:
                    up["logprobs"] = True
                elif not isinstance(body.get("logprobs"), int):
                    up["logprobs"] = 0  # sampled-token logprobs only
                if plan is not None:
                    up = plan.upstream(up)  # never streamed upstream: see tool_calls.py
                elif body.get("stream"):
                    response, handed_off = await self._stream(route, path, up, requested, chat,
                                                              started_at)
                    return response
                r = await self._send(route, path, up)
                if r.status_code >= 400:
                    return Response(r.content, status_code=r.status_code,
                                    media_type="application/json")
                data = r.json()
                if plan is not None:
                    data = plan.convert(data)
                extend_response(data, served=route.public, step=route.step,
                                started_at=started_at, latency_s=time.time() - started_at)
                self.ledger.add(ledger_record(data, requested, chat))
                if body.get("stream"):  # strict tools, streamed: the finished response, chunked
                    return _sse(stream_chunks(data, _include_usage(body)))
                return JSONResponse(data)
            finally:
                if not handed_off:
                    self._exit()
        except GatewayError as e:
            return openai_error(e.status, e.message, param=e.param)
        except httpx.HTTPError as e:
            return openai_error(502, f"inference engine error: {type(e).__name__}: {e}")

    async def _stream(self, route: Route, path: str, up: dict[str, Any], requested: str,
                      chat: bool, started_at: float) -> tuple[Response, bool]:
        """Relay vLLM's SSE stream, recording tokens as they pass. Returns (response, whether
        the in-flight slot was handed to the stream, which releases it when it ends)."""
        upstream = await self._open_stream(route, path, up)
        if upstream.status_code >= 400:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code,
                            media_type="application/json"), False

        async def relay() -> AsyncIterator[bytes]:
            acc = new_stream()
            try:
                async for line in upstream.aiter_lines():
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
                    self.ledger.add(record_of_stream(acc, requested, route.public, route.step,
                                                  started_at, time.time() - started_at))
            finally:
                await upstream.aclose()
                self._exit()

        return StreamingResponse(relay(), media_type="text/event-stream"), True

    def _add_routes(self, app: FastAPI) -> None:
        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self.completion(request, "/v1/chat/completions")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.completion(request, "/v1/completions")

        @app.get("/v1/models")
        async def list_models() -> dict[str, Any]:
            now = int(time.time())
            data = [{"id": n, "object": "model", "created": now, "owned_by": "art"}
                    for n in self.engines]
            for m in self.models.values():
                data.append({"id": m.name, "object": "model", "created": now,
                             "owned_by": "art", "root": m.engine.served_name,
                             "art_step": m.latest})
                data += [{"id": f"{m.name}@{s}", "object": "model", "created": now,
                          "owned_by": "art", "root": m.engine.served_name, "art_step": s}
                         for s in sorted(m.checkpoints)]
            return {"object": "list", "data": data}

        @app.get("/v1" + LEDGER_PATH + "/{completion_id}")
        async def get_completion(completion_id: str) -> Response:
            rec = self.ledger.get(completion_id)
            if rec is None:
                return openai_error(404, f"no recorded completion with id '{completion_id}' "
                                    "(unknown, or evicted from the ledger)")
            return JSONResponse(rec)

        @app.post("/v1" + LEDGER_PATH + "/batch")
        async def get_completions(request: Request) -> Response:
            """Many ledger records in one round trip: {"ids": [...]} -> {"data", "missing"}."""
            try:
                ids = (await request.json()).get("ids")
            except (ValueError, AttributeError):
                ids = None
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                return openai_error(400, "body must be {\"ids\": [completion ids]}", param="ids")
            found = {i: self.ledger[i] for i in ids if i in self.ledger}
            return JSONResponse({"data": list(found.values()),
                                 "missing": [i for i in ids if i not in found]})

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return {"status": "ok", "paused": self.paused, "in_flight": self.in_flight,
                    "engines": {n: e.running for n, e in self.engines.items()}}


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    return isinstance(opts, dict) and bool(opts.get("include_usage"))


def _sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    lines = [f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks]
    return StreamingResponse(iter([*lines, "data: [DONE]\n\n"]), media_type="text/event-stream")
