"""The gateway's calls to vLLM when vLLM fails: restart-aware retries and disconnects.

- A request that fails because the engine died (a transport error, or vLLM's own 5xx saying
  its engine core is dead) waits for the supervisor's restart (`wait_recovered`, bounded) and is sent once more, to the new process. Sampling a completion again is safe: no
  state on the engine's side changed. If the engine does not come back in time, the caller
  gets `EngineUnavailable`: a 503 with Retry-After and a message saying what happened.
- A non-streamed request whose client has gone away is cancelled, which closes the upstream
  connection, and vLLM aborts the generation (its OpenAI server watches for disconnects):
  the engine and the gateway's in-flight count are freed at once instead of at max_tokens.
- A stream that breaks after it started ends with an SSE error event, which the openai SDK
  raises as an APIError, instead of a silent cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import httpx

from art_core.inference.engine import POLL_S, VLLMEngine
from art_core.protocol import error_body

T = TypeVar("T")

RETRY_AFTER_S = 15
"""What a 503 during a restart suggests: vLLM restarts in 20-30 s on CPU (FIELD-NOTES)."""

DEAD_ENGINE_SIGNS = ("EngineCore", "EngineDeadError", "engine is dead", "Engine loop")
"""Words of vLLM's 5xx bodies when its engine core died under a live API server."""


class EngineUnavailable(Exception):
    """The engine died and did not serve again in time (or stopped): a 503."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ClientGone(Exception):
    """The client disconnected before the answer: nothing is sent back."""


def _engine_died(r: httpx.Response) -> bool:
    return r.status_code >= 500 and any(s in r.text for s in DEAD_ENGINE_SIGNS)


async def wait_recovered(client: httpx.AsyncClient, engine: VLLMEngine,
                         since_generation: int, timeout: float) -> bool:
    """After a request to generation `since_generation` failed: True once the engine serves
    again (restarted since, or never down: /health answers), False if it stopped, failed to
    start, or did not come back within `timeout` seconds. Polls with the gateway's own
    client (a new one builds an SSL context: 20-200 ms of CPU per waiter) and holds no
    thread."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.state in ("stopped", "failed"):
            return False
        if engine.state == "ready" and engine.running:
            if engine.generation > since_generation:
                return True
            with contextlib.suppress(httpx.HTTPError):
                r = await client.get(engine.base_url + "/health", timeout=1.0)
                if r.status_code == 200:
                    return True
        await asyncio.sleep(POLL_S)
    return False


async def _recover_or_raise(client: httpx.AsyncClient, engine: VLLMEngine, generation: int,
                            failure: str, wait_s: float, attempt: int) -> None:
    """Wait for the engine to serve again after `failure`; raise EngineUnavailable if this
    was already the retry or it does not come back within `wait_s`."""
    if attempt == 0 and await wait_recovered(client, engine, generation, wait_s):
        return
    what = "stopped" if engine.state in ("stopped", "failed") else (
        f"is restarting (restart {engine.restarts})" if engine.state != "ready" else
        "failed the request again after a restart")
    raise EngineUnavailable(
        f"the inference engine of {engine.served_name!r} stopped answering ({failure}) and "
        f"{what}; retry in about {RETRY_AFTER_S} s")


async def post(client: httpx.AsyncClient, engine: VLLMEngine, path: str, body: dict[str, Any],
               wait_s: float) -> httpx.Response:
    """POST to vLLM; after an engine failure, once more when it serves again."""
    for attempt in (0, 1):
        generation = engine.generation
        try:
            r = await client.post(engine.base_url + path, json=body)
        except httpx.TransportError as e:
            failure = f"{type(e).__name__}: {e}"
        else:
            if not _engine_died(r):
                return r
            failure = f"vLLM answered {r.status_code}: {r.text[:200]}"
        await _recover_or_raise(client, engine, generation, failure, wait_s, attempt)
    raise AssertionError("unreachable")


async def open_stream(client: httpx.AsyncClient, engine: VLLMEngine, path: str,
                      body: dict[str, Any], wait_s: float) -> httpx.Response:
    """Open a streamed POST to vLLM, with the same recovery as `post` until it opens."""
    for attempt in (0, 1):
        generation = engine.generation
        try:
            req = client.build_request("POST", engine.base_url + path, json=body)
            r = await client.send(req, stream=True)
        except httpx.TransportError as e:
            failure = f"{type(e).__name__}: {e}"
        else:
            if r.status_code < 500:
                return r
            await r.aread()
            await r.aclose()
            if not _engine_died(r):
                return r
            failure = f"vLLM answered {r.status_code}: {r.text[:200]}"
        await _recover_or_raise(client, engine, generation, failure, wait_s, attempt)
    raise AssertionError("unreachable")


def sse_error(status: int, message: str) -> bytes:
    """An SSE event carrying an OpenAI error (the openai SDK raises it as APIError)."""
    return f"data: {json.dumps(error_body(status, message))}\n\n".encode()


async def unless_disconnected(receive: Any, work: Awaitable[T]) -> T:
    """`await work`, unless the client disconnects first: then `work` is cancelled (closing
    its upstream connection) and ClientGone is raised. `receive` is the ASGI receive of a
    request whose body has been read, so its next message is the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (watcher, task):
            if not t.done():
                t.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone
