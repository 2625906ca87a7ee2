"""The current recording: where tool calls made during a rollout are written.

Recorders that see tool calls from different places share this one context variable, so that
they compose: an MCP tool called from a LangGraph agent lands in the trajectory the LangGraph
recorder is building, and an MCP tool called from a hand-written loop lands in that loop's
trajectory. The variable is a `contextvars.ContextVar`, so each asyncio task (each rollout of a
gather) sees its own recording and parallel rollouts never mix.

    traj = art.Trajectory(messages=[...])
    with art.recording(traj):                       # a plain trajectory: tool results become
        ...                                         # tool messages matched to the calls by id
        await session.call_tool("lookup", {...})    # (art_mcp.RecordingSession)

A recorder that builds messages itself (the LangGraph callback) passes its own `Recorder`, whose
`record_tool_event` keeps the call's details without adding a second copy of the message.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from art_core.trajectory import Trajectory


@dataclass
class ToolEvent:
    """One tool call as the tool side saw it."""

    name: str
    arguments: dict[str, Any]
    content: str = field(default="", metadata={"help": "The text given back to the model."})
    structured: Any = None
    is_error: bool = False
    error: str | None = field(
        default=None, metadata={"help": "A raised error (protocol error, timeout, crash)."})
    duration_s: float = 0.0
    tool_call_id: str | None = None


class Recorder(Protocol):
    """What a recording does with the tools offered and the tool calls made."""

    trajectory: Trajectory

    def record_tools(self, tools: list[dict[str, Any]]) -> None: ...

    def record_tool_event(self, event: ToolEvent) -> str | None: ...


def count_tool_event(trajectory: Trajectory, event: ToolEvent) -> None:
    """Add one call to the trajectory's tool metrics (calls, errors, seconds)."""
    m = trajectory.metrics
    m["tool_calls"] = int(m.get("tool_calls", 0)) + 1
    m["tool_errors"] = int(m.get("tool_errors", 0)) + int(event.is_error or bool(event.error))
    m["tool_seconds"] = round(float(m.get("tool_seconds", 0.0)) + event.duration_s, 6)
    if event.error:
        trajectory.log(f"tool {event.name} failed: {event.error}")


class MessageRecorder:
    """Records into a plain `Trajectory`: tools offered become `trajectory.tools`, and each tool
    result becomes a tool message answering the assistant's call with the same id (or, without
    an id, the first unanswered call of that name and those arguments)."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory

    def record_tools(self, tools: list[dict[str, Any]]) -> None:
        known = {t["function"]["name"] for t in self.trajectory.tools or []}
        new = [t for t in tools if t["function"]["name"] not in known]
        if new:
            self.trajectory.tools = [*(self.trajectory.tools or []), *new]

    def record_tool_event(self, event: ToolEvent) -> str | None:
        """Append the tool message; returns the tool_call_id it answers (None: no call matched,
        which is logged in the trajectory instead)."""
        count_tool_event(self.trajectory, event)
        call_id = event.tool_call_id or self._pending_call(event.name, event.arguments)
        if call_id is None:
            self.trajectory.log(
                f"tool {event.name} was called outside any assistant tool call: "
                f"{json.dumps(event.arguments)[:200]}")
            return None
        self.trajectory.messages.append(
            {"role": "tool", "tool_call_id": call_id, "content": event.content})
        return call_id

    def _pending_call(self, name: str, arguments: dict[str, Any]) -> str | None:
        answered = {m.get("tool_call_id") for m in self.trajectory.messages
                    if m.get("role") == "tool"}
        for m in reversed(self.trajectory.messages):
            if m.get("role") != "assistant" or not m.get("tool_calls"):
                continue
            for call in m["tool_calls"]:
                if call["id"] in answered or call["function"]["name"] != name:
                    continue
                if _parse_arguments(call["function"].get("arguments")) == arguments:
                    return call["id"]
            return None  # only the latest assistant turn's calls can be open
        return None


def _parse_arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw or "{}")
        except ValueError:
            return raw
    return raw


_CURRENT: ContextVar[Recorder | None] = ContextVar("art_current_recording", default=None)


def current_recorder() -> Recorder | None:
    """The recording active in this context (asyncio task), or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def recording(target: Trajectory | Recorder) -> Iterator[Recorder]:
    """Make `target` the current recording inside the block (a `Trajectory` is wrapped in a
    `MessageRecorder`). Nested blocks shadow outer ones; leaving restores the outer one."""
    recorder: Recorder = MessageRecorder(target) if isinstance(target, Trajectory) else target
    token = _CURRENT.set(recorder)
    try:
        yield recorder
    finally:
        _CURRENT.reset(token)
