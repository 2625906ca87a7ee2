"""`RecordingSession`: an MCP `ClientSession` whose tool traffic lands in the current trajectory.

Wrap any initialized `mcp.ClientSession` (stdio, streamable HTTP, in-memory) and use it as
before. Inside `art_core.recording(trajectory)`:

- `list_tools()` records the tools, converted to OpenAI function tools, as `trajectory.tools`;
- `call_tool()` records an `art_core.ToolEvent` (name, arguments, text given back, structured
  content, `is_error`, a raised error, duration) which the recording turns into the tool message
  answering the assistant's call (matched by id, see `art_core.recording`).

Outside a recording the wrapper records nothing and changes nothing. Errors the server raises
(timeouts, a closed connection) are recorded and then raised as they would be unwrapped.

`connect(server)` opens a session on a `ServerSpec` (a command for stdio, or a URL), so a
rollout can own its server: with a command, each connection starts its own process, in its own
working directory (`ART_MCP_ROLLOUT_DIR`), and a crash ends only that rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_core.recording import ToolEvent, current_recorder

ROLLOUT_DIR_ENV = "ART_MCP_ROLLOUT_DIR"
"""Environment variable naming the fresh directory a rollout's stdio server may keep state in."""


class ServerGone(RuntimeError):
    """The MCP server's connection closed (the process crashed or was killed)."""


def openai_tool(tool: Any) -> dict[str, Any]:
    """An MCP `Tool` as an OpenAI function tool (the schema the model sees)."""
    schema = dict(getattr(tool, "input_schema", None) or {"type": "object", "properties": {}})
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})
    schema.pop("title", None)  # "<name>Arguments": noise in the prompt
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description or "",
                         "parameters": schema}}


def result_text(result: Any) -> str:
    """The text of a `CallToolResult` as the model reads it: every block, with what the model
    needs to act on it (a resource link's uri and name, an embedded resource's uri, mime type
    and text, the size of binary data), never just its type."""
    parts = [block_text(block) for block in getattr(result, "content", None) or []]
    if not parts and getattr(result, "structured_content", None) is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


def block_text(block: Any) -> str:
    """One content block of a tool result as text (see `result_text`)."""
    kind = getattr(block, "type", "")
    if kind == "text":
        return block.text
    if kind == "resource_link":
        fields = [f"uri={block.uri}", f"name={block.name!r}"]
        fields += [f"{k}={v!r}" for k in ("title", "description", "mime_type", "size")
                   if (v := getattr(block, k, None)) is not None]
        return f"[resource link: {', '.join(fields)}]"
    if kind == "resource":
        res = block.resource
        head = f"[resource uri={res.uri}" + (f", mime_type={res.mime_type!r}"
                                             if res.mime_type else "")
        if getattr(res, "text", None) is not None:
            return f"{head}]\n{res.text}"
        return f"{head}, binary, {_decoded_size(res.blob)} bytes not shown]"
    if kind in ("image", "audio"):
        return (f"[{kind}, mime_type={block.mime_type!r}, {_decoded_size(block.data)} bytes "
                "not shown]")
    return f"[{kind or type(block).__name__} content not shown]"


def _decoded_size(b64: str) -> int:
    """Bytes of base64 data, without decoding it."""
    b64 = b64.strip()
    return max(0, len(b64) * 3 // 4 - b64[-2:].count("="))


def needs_task(tool: Any) -> bool:
    """True for a tool that runs only as a task (`execution.taskSupport == "required"`): our
    client calls tools directly, so such a call always fails; it is not offered."""
    execution = getattr(tool, "execution", None)
    return getattr(execution, "task_support", None) == "required"


def cut(text: str, limit: int | None) -> str:
    """`text` cut to `limit` characters with a note the model can see saying how much is gone."""
    if limit is None or len(text) <= limit:
        return text
    return text[:limit] + f"\n[... cut: {len(text) - limit} more characters not shown]"


def is_connection_closed(exc: BaseException) -> bool:
    """True for the error a session raises once its server is gone."""
    from mcp.types import CONNECTION_CLOSED

    if isinstance(exc, ServerGone):
        return True
    code = getattr(exc, "code", None)
    return code == CONNECTION_CLOSED or type(exc).__name__ in (
        "ClosedResourceError", "BrokenResourceError", "EndOfStream")


class RecordingSession:
    """Wraps a `ClientSession`; records `list_tools` and `call_tool` into the current recording.

    `timeout_s` bounds each `call_tool` (unless the call passes its own `read_timeout_seconds`);
    `max_result_chars` cuts long results in what is recorded (and given to the model), with a
    visible note. Every other attribute is the wrapped session's.
    """

    def __init__(self, session: Any, *, timeout_s: float | None = 60.0,
                 max_result_chars: int | None = 8000) -> None:
        self.session = session
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self.closed = False
        """True once a call found the server gone; later calls fail at once."""
        self.task_only_tools: list[str] = []
        """Tools `list_tools` left out because they run only as tasks (`needs_task`)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)

    async def list_tools(self, *args: Any, **kwargs: Any) -> Any:
        """List the server's tools (all pages when called with no cursor) and record them."""
        result = await self._guard(self.session.list_tools(*args, **kwargs))
        tools = list(result.tools)
        cursor = getattr(result, "next_cursor", None)
        while cursor and not args and not kwargs:  # follow pagination so the model sees all tools
            from mcp.types import PaginatedRequestParams

            page = await self._guard(
                self.session.list_tools(params=PaginatedRequestParams(cursor=cursor)))
            tools.extend(page.tools)
            cursor = getattr(page, "next_cursor", None)
        self.task_only_tools = [t.name for t in tools if needs_task(t)]
        tools = [t for t in tools if not needs_task(t)]
        result = result.model_copy(update={"tools": tools, "next_cursor": None})
        recorder = current_recorder()
        if recorder is not None:
            recorder.record_tools([openai_tool(t) for t in tools])
        return result

    async def openai_tools(self) -> list[dict[str, Any]]:
        """The server's tools as OpenAI function tools (recorded like `list_tools`)."""
        return [openai_tool(t) for t in (await self.list_tools()).tools]

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None,
                        read_timeout_seconds: float | None = None, *args: Any,
                        tool_call_id: str | None = None, **kwargs: Any) -> Any:
        """Call a tool and record the call. `tool_call_id` names the assistant's call this
        answers (without it the recording matches by name and arguments)."""
        arguments = dict(arguments or {})
        timeout = read_timeout_seconds if read_timeout_seconds is not None else self.timeout_s
        event = ToolEvent(name=name, arguments=arguments, tool_call_id=tool_call_id)
        start = time.perf_counter()
        try:
            result = await self._guard(
                self.session.call_tool(name, arguments, timeout, *args, **kwargs),
                # a backstop for transports that never answer (a hung process)
                None if timeout is None else timeout + 5.0)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                raise  # the rollout is being cancelled: nothing to answer
            event.error = _describe(e, timeout)
            event.content = f"Error: {event.error}"
            event.is_error = True
            event.duration_s = time.perf_counter() - start
            self._record(event)
            raise
        event.duration_s = time.perf_counter() - start
        event.is_error = bool(getattr(result, "is_error", False))
        event.structured = getattr(result, "structured_content", None)
        event.content = cut(result_text(result), self.max_result_chars)
        self._record(event)
        return result

    async def _guard(self, aw: Any, timeout: float | None = None) -> Any:
        if self.closed:
            if hasattr(aw, "close"):
                aw.close()
            raise ServerGone("the MCP server's connection is closed")
        try:
            if timeout is None:
                return await aw
            try:
                return await asyncio.wait_for(aw, timeout)
            except TimeoutError:
                raise TimeoutError(f"no answer from the MCP server within {timeout:.0f} s") from None
        except Exception as e:
            if is_connection_closed(e):
                self.closed = True
            raise

    @staticmethod
    def _record(event: ToolEvent) -> None:
        recorder = current_recorder()
        if recorder is not None:
            recorder.record_tool_event(event)


def _describe(e: BaseException, timeout: float | None) -> str:
    from mcp.types import REQUEST_TIMEOUT

    if getattr(e, "code", None) == REQUEST_TIMEOUT:
        return f"the tool did not answer within {timeout:g} s (timed out)"
    if is_connection_closed(e):
        return "the MCP server's connection closed (the server crashed or exited)"
    return f"{type(e).__name__}: {e}"


@dataclass
class ServerSpec:
    """How to reach an MCP server: `command` (stdio; a process per connection) or `url`
    (streamable HTTP; every connection shares that server's state).

    A stdio server gets the MCP SDK's safe default environment (PATH, HOME, USER, ...: no
    keys of the trainer's, such as WANDB_API_KEY or cloud credentials) plus `env`: name there
    what the server needs."""

    command: Sequence[str] | None = None
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (stdio) or url (streamable HTTP)")
        if self.command is not None and not list(self.command):
            raise ValueError("command is empty")

    def describe(self) -> str:
        return self.url or " ".join(self.command or [])


@contextlib.asynccontextmanager
async def connect(server: ServerSpec, *, workdir: str | Path | None = None,
                  timeout_s: float | None = 60.0, max_result_chars: int | None = 8000,
                  init_timeout_s: float = 60.0) -> AsyncIterator[RecordingSession]:
    """An initialized `RecordingSession` on `server`. A stdio server is started with
    `ART_MCP_ROLLOUT_DIR=workdir` (and its stderr written to `workdir/server.log`), and stopped
    when the block ends. `timeout_s` bounds each tool call; `init_timeout_s` the handshake."""
    try:
        async with _open(server, workdir, init_timeout_s) as session:
            yield RecordingSession(session, timeout_s=timeout_s, max_result_chars=max_result_chars)
    except BaseExceptionGroup as group:
        # the transports' task groups wrap whatever ended the block: give back the one error
        # (ServerGone, a timeout, the caller's own) so callers see the type they expect
        leaf = _single_leaf(group)
        if leaf is None:
            raise
        raise leaf from None


def _single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    while isinstance(group, BaseExceptionGroup):
        if len(group.exceptions) != 1:
            return None
        group = group.exceptions[0]
    return group


@contextlib.asynccontextmanager
async def _open(server: ServerSpec, workdir: str | Path | None,
                init_timeout_s: float) -> AsyncIterator[Any]:
    from mcp import ClientSession

    async with contextlib.AsyncExitStack() as stack:
        if server.command is not None:
            from mcp.client.stdio import (
                StdioServerParameters,
                get_default_environment,
                stdio_client,
            )

            env = {**get_default_environment(), **server.env}  # never the trainer's secrets
            errlog: Any = sys.stderr
            if workdir is not None:
                Path(workdir).mkdir(parents=True, exist_ok=True)
                env[ROLLOUT_DIR_ENV] = str(workdir)
                errlog = stack.enter_context(open(Path(workdir) / "server.log", "w"))  # noqa: SIM115
            command = list(server.command)
            params = StdioServerParameters(command=command[0], args=command[1:], env=env,
                                           cwd=server.cwd)
            read, write = await stack.enter_async_context(stdio_client(params, errlog=errlog))
        else:
            from mcp.client.streamable_http import streamable_http_client

            http_client = None
            if server.headers:
                from mcp.client.streamable_http import create_mcp_http_client

                http_client = await stack.enter_async_context(
                    create_mcp_http_client(headers=server.headers))
            read, write = await stack.enter_async_context(
                streamable_http_client(server.url or "", http_client=http_client))
        session = await stack.enter_async_context(ClientSession(read, write))
        await asyncio.wait_for(session.initialize(), init_timeout_s)
        yield session
