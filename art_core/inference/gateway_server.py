"""`GatewayServer`: runs a `Gateway` (art_core/inference/gateway.py) with uvicorn in a thread of its own.

The gateway gets its own event loop so that user code which blocks its own loop (a sync
LangGraph `invoke`) cannot stall inference. `call` runs a coroutine in the gateway's loop from
any other loop (backends publish checkpoints and pause/resume the gate through it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from art_core.inference.gateway import Gateway

T = TypeVar("T")


class GatewayServer:
    """Runs a `Gateway` with uvicorn in a thread of its own, with its own event loop."""

    def __init__(self, gateway: Gateway, host: str = "127.0.0.1", port: int = 0,
                 app: Any = None) -> None:
        """`app`: what to serve instead of `gateway.app` (the gateway behind a guard)."""
        self.gateway = gateway
        self.host = host
        self.port = port
        self.app = app or gateway.app
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 30.0) -> None:
        import uvicorn

        from art_core.host import free_port

        self.port = self.port or free_port()
        config = uvicorn.Config(self.app, host=self.host, port=self.port,
                                log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        started = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.call_soon(started.set)
            self.loop.run_until_complete(self._server.serve())
            self.loop.run_until_complete(self.gateway.aclose())

        self._thread = threading.Thread(target=run, name="art-gateway", daemon=True)
        self._thread.start()
        started.wait(timeout)
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the gateway did not start on {self.host}:{self.port}")
            time.sleep(0.02)

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run `fn()` in the gateway's loop and await its result from any loop."""
        assert self.loop is not None, "gateway not started"
        try:
            if asyncio.get_running_loop() is self.loop:
                return await fn()
        except RuntimeError:
            pass

        async def runner() -> T:
            return await fn()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(runner(), self.loop))

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
