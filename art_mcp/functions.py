"""Python functions as agent tools: OpenAI schemas from signatures and docstrings, and a session
that runs them the way `RecordingSession` runs an MCP server's tools.

    def lookup_order(order_id: str) -> str:
        '''Look up an order's status.

        Args:
            order_id: The order number, like "A-1042".
        '''

    function_tool(lookup_order)   # {"type": "function", "function": {"name": "lookup_order", ...}}
    session = FunctionSession([lookup_order])
    traj = await run_agent(model, session, "Where is order A-1042?")

The schema: the name is the function's, the description is the docstring up to its first
section, each parameter's type comes from its annotation (pydantic's JSON schema; an
unannotated parameter is a string) and its description from an `Args:` (Google) or `:param x:`
(Sphinx) entry; parameters without a default are required. Calls are checked against the
signature before the function runs: wrong arguments, a raised exception or a timeout come back
to the model as an error result (`is_error`), never as a crash of the rollout.

Functions are shared by all rollouts: keep them free of per-rollout state, or key it by input.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from art_core.recording import ToolEvent, current_recorder

_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns?|Raises|Yields|Examples?|Notes?)"
                      r"\s*:\s*$|^\s*:(param|returns?|raises)\b", re.I)


def _doc_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google- or Sphinx-style docstring."""
    doc = inspect.getdoc(fn) or ""
    lines = doc.splitlines()
    head: list[str] = []
    for line in lines:
        if _SECTION.match(line):
            break
        head.append(line)
    params: dict[str, str] = {}
    for m in re.finditer(r"^\s*:param\s+(?:[^:\s]+\s+)?(\w+)\s*:\s*(.+)$", doc, re.M):
        params[m.group(1)] = m.group(2).strip()
    in_args, current, params_indent = False, None, 0
    for line in lines:
        if re.match(r"^\s*(Args|Arguments|Parameters)\s*:\s*$", line):
            in_args, current = True, None
            continue
        if in_args:
            if not line.strip():
                continue
            if not line.startswith((" ", "\t")):  # a new section
                in_args = False
                continue
            m = re.match(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if m and (current is None or len(line) - len(line.lstrip()) <= params_indent):
                current, params_indent = m.group(1).lstrip("*"), len(line) - len(line.lstrip())
                params[current] = m.group(2).strip()
            elif current is not None:
                params[current] = f"{params[current]} {line.strip()}".strip()
    return " ".join(" ".join(head).split()), params


def _arguments_model(fn: Callable[..., Any]) -> type[BaseModel]:
    """A pydantic model of the function's named parameters (what a call must supply)."""
    hints = typing.get_type_hints(fn)
    fields: dict[str, Any] = {}
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in ("self", "cls"):
            continue
        annotation = hints.get(name, str)  # unannotated: a string, the safest for a small model
        fields[name] = (annotation, ... if p.default is p.empty else p.default)
    return create_model(f"{fn.__name__}_arguments", __config__=ConfigDict(extra="forbid"),
                        **fields)


def _drop_titles(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_drop_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: _drop_titles(v) for k, v in schema.items()
            if not (k == "title" and isinstance(v, str))}


def function_tool(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI function tool for `fn` (see the module docstring)."""
    description, docs = _doc_parts(fn)
    schema = _drop_titles(_arguments_model(fn).model_json_schema())
    for param, text in docs.items():
        if param in schema.get("properties", {}):
            schema["properties"][param]["description"] = text
    schema.setdefault("properties", {})
    return {"type": "function", "function": {"name": name or fn.__name__,
                                             "description": description, "parameters": schema}}


class _CallError(Exception):
    """A call that could not run as asked (unknown tool, wrong arguments, a timeout)."""


def result_text(value: Any) -> str:
    """What the model reads for a return value: a string as is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return repr(value)


class FunctionSession:
    """Python functions behind the session interface `run_agent` uses (`list_tools`,
    `call_tool`, `timeout_s`, `max_result_chars`, `closed`); calls are recorded into the
    current `art_core.recording` as `ToolEvent`s, like `RecordingSession`'s."""

    def __init__(self, functions: Sequence[Callable[..., Any]], *, timeout_s: float | None = 30.0,
                 max_result_chars: int | None = 8000) -> None:
        self.timeout_s = timeout_s
        self.max_result_chars = max_result_chars
        self.closed = False  # functions cannot go away; kept for the session interface
        self._functions: dict[str, tuple[Callable[..., Any], type[BaseModel]]] = {}
        self.tools: list[dict[str, Any]] = []
        for fn in functions:
            if not callable(fn):
                raise TypeError(f"a tool must be a function, got {type(fn).__name__}")
            tool = function_tool(fn)
            name = tool["function"]["name"]
            if name in self._functions:
                raise ValueError(f"two tools are named {name!r}")
            if name == "complete_task":
                raise ValueError("'complete_task' is the agent's own tool: rename the function")
            self._functions[name] = (fn, _arguments_model(fn))
            self.tools.append(tool)

    async def list_tools(self) -> list[dict[str, Any]]:
        """The tools as OpenAI function tools (recorded as `trajectory.tools`)."""
        recorder = current_recorder()
        if recorder is not None:
            recorder.record_tools(self.tools)
        return self.tools

    openai_tools = list_tools

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None, *,
                        tool_call_id: str | None = None) -> ToolEvent:
        """Run one call and record it; failures are error results, not exceptions."""
        arguments = dict(arguments or {})
        event = ToolEvent(name=name, arguments=arguments, tool_call_id=tool_call_id)
        start = time.perf_counter()
        try:
            event.structured = await self._run(name, arguments)
            event.content = result_text(event.structured)
        except _CallError as e:
            event.is_error, event.content = True, f"Error: {e}"
        except Exception as e:  # raised by the function itself
            event.is_error, event.content = True, f"Error: {type(e).__name__}: {e}"
        event.duration_s = time.perf_counter() - start
        if self.max_result_chars and len(event.content) > self.max_result_chars:
            cut = len(event.content) - self.max_result_chars
            event.content = (event.content[:self.max_result_chars]
                             + f"\n[... {cut} more characters cut]")
        recorder = current_recorder()
        if recorder is not None:
            recorder.record_tool_event(event)
        return event

    async def _run(self, name: str, arguments: dict[str, Any]) -> Any:
        if name not in self._functions:
            raise _CallError(f"no tool named {name!r}; the tools are "
                              f"{', '.join(self._functions)}")
        fn, model = self._functions[name]
        try:
            parsed = model.model_validate(arguments)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'arguments'}: {err['msg']}"
                                 for err in e.errors())
            raise _CallError(f"invalid arguments for {name}: {problems}") from None
        kwargs = {k: getattr(parsed, k) for k in type(parsed).model_fields}
        # a blocking function runs in a thread, so it does not stall the other rollouts
        call = fn(**kwargs) if inspect.iscoroutinefunction(fn) else asyncio.to_thread(fn, **kwargs)
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError:
            raise _CallError(f"{name} took more than {self.timeout_s:g} s") from None
