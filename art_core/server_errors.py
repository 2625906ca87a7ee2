"""Errors of `art serve` (art_core/server.py) as the client sees them.

Every error is JSON in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, the
same as the gateway's. `ApiError` is an error meant for the client (its message is shown as it
is); anything else is mapped to one by `ArtServer._client_error`, which never shows a server
path or a traceback.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                409: "conflict_error", 413: "invalid_request_error",
                422: "invalid_request_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error meant for the client: its message is shown as it is."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when a streamed body passes the limit (FastAPI re-raises
    HTTPExceptions untouched, so this reaches our handler as a 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the server's limit of "
                              f"{size_text(limit)} (art serve --max-body-mb)")


def error_response(status: int, message: str, code: str | int | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    """The OpenAI error shape, the same as the gateway's `openai_error`."""
    return JSONResponse(
        {"error": {"message": message, "type": STATUS_TYPES.get(status, "server_error"),
                   "param": param, "code": code if code is not None else status}},
        status_code=status, headers=headers)


def size_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def validation_message(e: ValidationError, where: str) -> str:
    """A short, one-line account of a pydantic error (first few problems, no doc links)."""
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{where}{'.' + loc if loc else ''}: {err.get('msg')}")
    more = len(e.errors()) - 5
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
