"""OpenEnv's wire protocol, spoken directly: an OpenEnv server (`create_app` on a host, a Space, a
container) stepped by rollouts without the `openenv` package in the training environment.

Why not `GenericEnvClient` itself: openenv 0.10 depends on fastmcp 3, which needs an `mcp` older
than the one art_mcp uses, and importing its client imports its server and fastmcp; installing
it beside the trainer downgrades `mcp` (measured). The protocol its clients speak is small (read
from openenv 0.10's `EnvClient` and `http_server`): one WebSocket per session at
`<base_url>/ws`; JSON messages `{"type": "reset", "data": {reset kwargs}}`,
`{"type": "step", "data": {action fields}}`, `{"type": "close"}`; each answered with
`{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}` or
`{"type": "error", "data": {"message": ...}}`.

`OpenEnvSocket(url)` is such a client with `GenericEnvClient`'s async `reset(**kwargs)` /
`step(action dict)` / `close()` and `StepResult`-shaped answers, so
`OpenEnvText(OpenEnvSocket(url))` is a step environment for `step_rollout`, one session per
rollout. A server that refuses a message, closes the connection or does not answer within
`timeout_s` raises `EnvFailed` naming it: that rollout fails (counted), the step trains on the
others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from art_core.env.steps import EnvFailed


@dataclass
class StepResult:
    """OpenEnv's `StepResult`: the observation's fields, the reward, whether it ended."""

    observation: dict[str, Any] = field(default_factory=dict)
    reward: float | None = None
    done: bool = False


def socket_url(base_url: str) -> str:
    """`http(s)://host:port[/prefix]` (or ws(s)://) -> the session socket `ws(s)://.../ws`."""
    url = base_url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if url.startswith(http):
            url = ws + url[len(http):]
    if not url.startswith(("ws://", "wss://")):
        raise ValueError(f"an OpenEnv server's URL starts with http(s):// or ws(s)://, got "
                         f"{base_url!r}")
    return url if url.endswith("/ws") else url + "/ws"


class OpenEnvSocket:
    """One OpenEnv session over its WebSocket protocol (the module docstring)."""

    def __init__(self, base_url: str, *, timeout_s: float = 60.0) -> None:
        self.url, self.timeout_s = socket_url(base_url), timeout_s
        self._ws: Any = None

    async def _ask(self, kind: str, data: dict[str, Any]) -> StepResult:
        import websockets

        try:
            if self._ws is None:
                self._ws = await asyncio.wait_for(
                    websockets.connect(self.url, max_size=None), self.timeout_s)
            await self._ws.send(json.dumps({"type": kind, "data": data}))
            answer = json.loads(await asyncio.wait_for(self._ws.recv(), self.timeout_s))
        except TimeoutError:
            raise EnvFailed(f"the OpenEnv server at {self.url} did not answer the {kind} within "
                            f"{self.timeout_s:g} s") from None
        except (OSError, websockets.exceptions.WebSocketException) as e:
            raise EnvFailed(f"the OpenEnv server at {self.url} is gone ({kind}: "
                            f"{type(e).__name__}: {e})") from None
        payload = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(payload, dict):
            raise EnvFailed(f"the OpenEnv server at {self.url} answered the {kind} with "
                            f"{str(answer)[:200]!r}, not an observation")
        if answer.get("type") == "error":
            raise EnvFailed(f"the OpenEnv server at {self.url} refused the {kind}: "
                            f"{payload.get('message', 'error')} {payload.get('errors', '')}"
                            .strip())
        reward = payload.get("reward")
        return StepResult(observation=payload.get("observation") or {},
                          reward=None if reward is None else float(reward),
                          done=bool(payload.get("done", False)))

    async def reset(self, **kwargs: Any) -> StepResult:
        return await self._ask("reset", kwargs)

    async def step(self, action: dict[str, Any]) -> StepResult:
        return await self._ask("step", action)

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        with contextlib.suppress(Exception):  # the session ends either way
            await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), 5)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ws.close(), 5)
