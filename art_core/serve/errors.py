"""Errors of `art serve` (art_core/serve/app.py) as the client sees them.

Every error is JSON in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, the
same as the gateway's (`art_core.protocol.error_body`). `ApiError` is an error meant for the client (its message is shown as it
is); anything else is mapped to one by `ArtServer._client_error`, which never shows a server
path or a traceback.
"""

from __future__ import annotations

from pydantic import ValidationError


class ApiError(Exception):
    """An error meant for the client: its message is shown as it is."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def validation_message(e: ValidationError, where: str) -> str:
    """A short, one-line account of a pydantic error (first few problems, no doc links)."""
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{where}{'.' + loc if loc else ''}: {err.get('msg')}")
    more = len(e.errors()) - 5
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
