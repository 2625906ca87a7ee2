"""The guard in front of every route we serve over a socket (`art serve`, art_core/serve/app.py,
and LocalBackend's gateway): API key, body size, last-resort errors. It lives below both (the
request path's room), so that the backend never imports the server.

ARCHITECTURE invariant 8: with an API key every route but /health needs
`Authorization: Bearer <key>` (compared in constant time); a body is capped (Content-Length
checked before reading, and counted while streaming); an exception that escapes a route
returns a generic message with an error id, and its traceback goes to the log.
"""

from __future__ import annotations

import hmac
import logging
import uuid

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from art_core.protocol import bind_refusal, error_body

log = logging.getLogger("art_core.serve.app")

PUBLIC_PATHS = frozenset({"/health"})

DEFAULT_MAX_BODY_BYTES = 64 * 2**20  # a few hundred long agent trajectories; raise with --max-body-mb


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when a streamed body passes the limit (FastAPI re-raises
    HTTPExceptions untouched, so this reaches our handler as a 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the server's limit of "
                              f"{size_text(limit)} (art serve --max-body-mb)")


def error_response(status: int, message: str, code: str | int | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    """The OpenAI error shape (`protocol.error_body`) as a response."""
    return JSONResponse(error_body(status, message, code, param), status_code=status,
                        headers=headers)


def size_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def check_bind(host: str, api_key: str | None) -> None:
    """Raise ValueError for a bind that invariant 8 refuses (non-loopback without a key): the
    one check before any of our HTTP servers opens a socket (`art serve`, LocalBackend's
    gateway)."""
    refusal = bind_refusal(host, api_key)
    if refusal:
        raise ValueError(refusal)


def guarded(app: ASGIApp, *, host: str, api_key: str | None,
            max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ASGIApp:
    """`app` behind the `Guard`, after `check_bind`: what every socket we open serves."""
    check_bind(host, api_key)
    return Guard(app, api_key=api_key, max_body_bytes=max_body_bytes)


class Guard:
    """Pure ASGI middleware (streams pass through untouched) in front of every route.

    Order matters: an unauthenticated request is refused before its body is read; a body whose
    Content-Length is over the limit is refused before it is read; a chunked body is counted
    as it arrives. An exception that escapes a route becomes a 500 with an error id.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") not in PUBLIC_PATHS:
            given = headers.get("authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(),
                                                                      self.api_key):
                message = ("missing API key: send 'Authorization: Bearer <key>'" if not given
                           else "invalid API key")
                await error_response(401, message, "invalid_api_key",
                                     headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await error_response(400, "invalid Content-Length header")(scope, receive, send)
                return
            if int(length) > self.max_body_bytes:
                await error_response(413, BodyTooLarge(self.max_body_bytes).detail,
                                     "body_too_large")(scope, receive, send)
                return

        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as e:
            if not started:
                await error_response(413, str(e.detail), "body_too_large")(scope, receive, send)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("unhandled error %s in %s %s", error_id, scope.get("method"),
                          scope.get("path"))
            if not started:
                await error_response(
                    500, f"internal server error (error id {error_id}; details are in the "
                    "server's log)", "internal_error")(scope, receive, send)
