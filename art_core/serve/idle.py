"""`art serve --idle-exit-minutes N`: stop the server after N minutes without a request.

Why: SkyPilot's auto-stop counts a cluster as idle only when no job runs, and `art serve` is a
job that never ends by itself; so a cluster started by `art launch` would never stop. The
server exits once nobody has used it for N minutes (no request other than /health, no request
in flight, no training step running); the job ends, and SkyPilot's auto-stop takes the cluster
down after its own idle time. Checkpoints are on disk; a relaunch serves them again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger("art_core.serve.app")


class ActivityTracker:
    """ASGI middleware that remembers when the last request (health checks aside) was seen."""

    def __init__(self, app: ASGIApp, ignore_paths: frozenset[str] = frozenset({"/health"})
                 ) -> None:
        self.app = app
        self.ignore_paths = ignore_paths
        self.last_activity = time.monotonic()
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.ignore_paths:
            await self.app(scope, receive, send)
            return
        self.active += 1
        self.last_activity = time.monotonic()
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
            self.last_activity = time.monotonic()

    def idle_seconds(self) -> float:
        return 0.0 if self.active else time.monotonic() - self.last_activity


async def exit_when_idle(tracker: ActivityTracker, minutes: float, busy: Callable[[], bool],
                         stop: Callable[[], None], poll_s: float = 30.0) -> None:
    """Call `stop()` once `tracker` has been idle for `minutes` and `busy()` is false."""
    limit = minutes * 60.0
    while True:
        await asyncio.sleep(min(poll_s, max(limit / 4, 0.05)))
        if busy():
            tracker.last_activity = time.monotonic()  # a long step is activity, not idleness
            continue
        if tracker.idle_seconds() >= limit:
            log.warning("no request for %.0f minutes: shutting down (--idle-exit-minutes)",
                        minutes)
            stop()
            return
