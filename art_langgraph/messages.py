"""LangChain messages and tools to the OpenAI chat format our `Trajectory` stores.

Our own small converter, not `convert_to_openai_messages`: that one differs from the wire format
(empty string vs null content, an extra `name` on tool messages; see FIELD-NOTES), and the same
converter must be used for every call so that "this call continues that conversation" can be
decided by comparing converted messages.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool",
          "developer": "developer", "chat": "user", "function": "tool"}


def _text(content: Any) -> str:
    """A message's content as text (the text parts of a multi-part content, joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
    return "".join(parts)


def _tool_calls(message: Any) -> list[dict[str, Any]]:
    # The wire form (arguments as the model wrote them) when the client kept it.
    raw = (getattr(message, "additional_kwargs", None) or {}).get("tool_calls")
    if raw:
        return [{"id": c["id"], "type": "function",
                 "function": {"name": c["function"]["name"],
                              "arguments": c["function"].get("arguments") or "{}"}}
                for c in raw]
    return [{"id": c["id"], "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c.get("args") or {})}}
            for c in getattr(message, "tool_calls", None) or []]


def to_openai_message(message: Any) -> dict[str, Any]:
    """One LangChain `BaseMessage` as an OpenAI chat message dict."""
    kind = getattr(message, "type", None)
    if kind == "AIMessageChunk":
        kind = "ai"
    role = _ROLES.get(kind or "")
    if role is None and kind == "chat":
        role = getattr(message, "role", "user")
    if role is None:
        raise ValueError(f"cannot record a LangChain message of type {kind!r}")
    out: dict[str, Any] = {"role": role, "content": _text(message.content)}
    if role == "assistant":
        calls = _tool_calls(message)
        if calls:
            out["tool_calls"] = calls
            out["content"] = out["content"] or None
    elif role == "tool":
        out["tool_call_id"] = getattr(message, "tool_call_id", None)
    return out


def same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal for the purpose of prefix matching: role, text, tool calls (parsed), call id."""
    if a["role"] != b["role"] or (a.get("content") or "") != (b.get("content") or ""):
        return False
    if a.get("tool_call_id") != b.get("tool_call_id"):
        return False

    def calls(m: dict[str, Any]) -> list[tuple[str, str, Any]]:
        out = []
        for c in m.get("tool_calls") or []:
            args = c["function"].get("arguments")
            with contextlib.suppress(ValueError):
                args = json.loads(args) if isinstance(args, str) else args
            out.append((c["id"], c["function"]["name"], args))
        return out

    return calls(a) == calls(b)


def is_prefix(prefix: list[dict[str, Any]], messages: list[dict[str, Any]]) -> bool:
    return len(prefix) <= len(messages) and all(
        same_message(a, b) for a, b in zip(prefix, messages, strict=False))


def to_openai_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tools from a call's invocation parameters, in OpenAI function format."""
    if not tools:
        return None
    out = []
    for t in tools:
        if isinstance(t, dict) and t.get("type") == "function" and "function" in t:
            out.append(t)
        else:  # another provider's format: let langchain-core convert it
            from langchain_core.utils.function_calling import convert_to_openai_tool

            out.append(convert_to_openai_tool(t))
    return out
