"""A scripted OpenAI-compatible judge server, for tests and dry runs of RULER.

`ScriptedJudge` serves `POST /v1/chat/completions` on 127.0.0.1 (a free port) from a thread and
answers each request with the next scripted `Reply`, or with whatever a callable returns for the
request body. It records every request body it gets, so a test can check what RULER sent. It uses
only the standard library, so it runs anywhere the package does.

    with ScriptedJudge(['{"scores": [...]}', Reply(top_logprobs={"Yes": -0.1, "No": -2.4})]) as server:
        await ruler.score(lists, judge="openai/judge", api_base=server.api_base, api_key="x")
        assert len(server.requests) == 1
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """One scripted answer: chat `content` with HTTP 200, or an error `status` with a message.

    `delay` seconds are slept before answering, to provoke client timeouts. `top_logprobs`
    (token -> logprob) are returned as the candidates of the first generated token, as OpenAI and
    vLLM do for `logprobs=True, top_logprobs=k`; without them the reply has no logprobs. The
    content defaults to the most likely of them.
    """

    content: str | None = None
    top_logprobs: dict[str, float] | None = None
    status: int = 200
    error: str = "scripted error"
    delay: float = 0.0
    tool_calls: list[tuple[str, dict[str, Any]]] | None = None
    """(name, arguments) of tool calls the assistant makes (with ids `call_<n>`), for scripting
    an agent: the reply then has `finish_reason: "tool_calls"`."""
    usage: dict[str, int] = field(
        default_factory=lambda: {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
    )


Script = Iterable[Reply | str] | Callable[[dict[str, Any]], Reply | str]


class ScriptedJudge:
    """An OpenAI-compatible chat server that answers from a script and records requests."""

    def __init__(self, script: Script = ()) -> None:
        self._responder = script if callable(script) else None
        self._queue: deque[Reply | str] = deque() if callable(script) else deque(script)
        self._lock = threading.Lock()
        self.requests: list[dict[str, Any]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True  # a handler still sleeping must not block shutdown
        # a short poll interval makes stop() quick (the default waits up to 0.5 s)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @property
    def api_base(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def push(self, *replies: Reply | str) -> None:
        """Append replies to the script."""
        with self._lock:
            self._queue.extend(replies)

    def start(self) -> ScriptedJudge:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ScriptedJudge:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _next_reply(self, body: dict[str, Any]) -> Reply:
        with self._lock:
            self.requests.append(body)
            if self._responder is not None:
                reply = self._responder(body)
            elif self._queue:
                reply = self._queue.popleft()
            else:
                reply = Reply(status=500, error="ScriptedJudge: the script has no reply left")
        return Reply(content=reply) if isinstance(reply, str) else reply

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                reply = judge._next_reply(body)
                time.sleep(reply.delay)
                if reply.status != 200:
                    error = {"message": reply.error, "type": "invalid_request_error", "code": None}
                    self._send(reply.status, {"error": error})
                    return
                self._send(200, _completion(body.get("model", "judge"), reply))

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout): nothing to answer

        return Handler


def _logprobs(reply: Reply) -> dict[str, Any] | None:
    if reply.top_logprobs is None:
        return None
    top = sorted(reply.top_logprobs.items(), key=lambda kv: -kv[1])
    candidates = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]
    first = dict(candidates[0]) if candidates else {"token": "", "logprob": 0.0, "bytes": []}
    return {"content": [{**first, "top_logprobs": candidates}]}


def _completion(model: str, reply: Reply) -> dict[str, Any]:
    """A minimal `chat.completion` object, as OpenAI and vLLM return it."""
    content = reply.content
    if content is None and reply.top_logprobs:
        content = max(reply.top_logprobs.items(), key=lambda kv: kv[1])[0]
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{time.monotonic_ns()}_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(arguments)}}
            for i, (name, arguments) in enumerate(reply.tool_calls)]
    return {
        "id": f"chatcmpl-scripted-{time.monotonic_ns()}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs(reply),
                "finish_reason": "tool_calls" if reply.tool_calls else "stop",
            }
        ],
        "usage": reply.usage,
    }
