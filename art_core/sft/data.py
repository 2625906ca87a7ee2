"""Supervised fine-tuning data: OpenAI chat-format examples read into `Trajectory` objects.

A JSONL file in OpenAI's fine-tuning chat format has one example a line:
`{"messages": [...], "tools": [...], "parallel_tool_calls": ...}` (tools optional, the last key
ignored). Assistant messages may carry OpenAI's `"weight": 0|1` (0: context, not trained); it is
kept in the message dict for the renderer (render.py).

Every example is checked before training starts, so a bad line fails in seconds with its file and
line number and what is wrong, instead of an opaque template or tokenizer error minutes later.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from art_core.trajectory import ROLES, Trajectory, TrajectoryGroup


class SFTDataError(ValueError):
    """An SFT example (or the data as a whole) that cannot be trained on; the message names
    where (`file:line`) and what is wrong."""


def load_chat_jsonl(path: str | Path) -> list[Trajectory]:
    """Read a JSONL file of OpenAI chat-format examples, one `Trajectory` (reward 0) a line.

    Blank lines are skipped. Raises FileNotFoundError for a missing file and SFTDataError,
    naming `path:line`, for the first invalid example."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SFT data file not found: {path}")
    trajectories = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                example = json.loads(line)
            except json.JSONDecodeError as e:
                raise SFTDataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            trajectories.append(example_to_trajectory(example, where))
    return trajectories


def as_trajectories(data: Any) -> list[Trajectory]:
    """What `model.train_sft(data)` accepts, as a flat list of trajectories: a path to a JSONL
    file, or a list mixing `Trajectory`, `TrajectoryGroup` (flattened) and chat-format dicts
    (checked like file lines; an error names `<data>:<index + 1>`)."""
    if isinstance(data, str | Path):
        trajectories = load_chat_jsonl(data)
    else:
        if isinstance(data, Trajectory | TrajectoryGroup | dict):
            data = [data]
        trajectories = []
        for i, item in enumerate(data):
            if isinstance(item, Trajectory):
                trajectories.append(item)
            elif isinstance(item, TrajectoryGroup):
                trajectories.extend(item.trajectories)
            elif isinstance(item, dict):
                trajectories.append(example_to_trajectory(item, f"<data>:{i + 1}"))
            else:
                raise SFTDataError(f"<data>:{i + 1}: a {type(item).__name__}; expected a "
                                   "Trajectory, a TrajectoryGroup or a chat-format dict")
    if not trajectories:
        raise SFTDataError(f"no examples in {data if isinstance(data, str | Path) else 'data'}")
    return trajectories


def example_to_trajectory(example: Any, where: str) -> Trajectory:
    """One chat-format example as a Trajectory; SFTDataError prefixed with `where` if invalid."""
    if not isinstance(example, dict):
        raise SFTDataError(f"{where}: an example is a JSON object, got {_kind(example)}")
    try:
        messages = _check_messages(example.get("messages"))
        tools = _check_tools(example.get("tools"))
    except SFTDataError as e:
        raise SFTDataError(f"{where}: {e}") from None
    try:
        return Trajectory(messages=messages, tools=tools, reward=0.0,
                          metadata={"source": where})
    except ValidationError as e:  # a rule of the data model these checks do not repeat
        raise SFTDataError(f"{where}: {e}") from None


# ---- the checks (their messages are prefixed with where the example is) ---------------------

def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise SFTDataError('missing "messages"')
    if not isinstance(messages, list) or not messages:
        raise SFTDataError('"messages" must be a non-empty list')
    calls: dict[str, int] = {}  # tool call id -> index of the assistant message that made it
    answered: set[str] = set()
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise SFTDataError(f"{at} is {_kind(m)}, not an object")
        role = m.get("role")
        if role not in ROLES:
            raise SFTDataError(f"{at} has role {role!r}; expected one of {', '.join(ROLES)}")
        if role == "assistant":
            for call_id in _check_assistant(m, at):
                calls[call_id] = i
        else:
            if "weight" in m:
                raise SFTDataError(f"{at} has a weight, which only assistant messages take")
            _check_content(m.get("content"), at)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id not in calls:
                raise SFTDataError(f"{at} is a tool message with tool_call_id={call_id!r}, which "
                                   "matches no tool call of an earlier assistant message")
            answered.add(call_id)
    for call_id, i in calls.items():
        if call_id not in answered:
            raise SFTDataError(f"messages[{i}] makes tool call {call_id!r}, which no later tool "
                               "message answers")
    if not any(m["role"] == "assistant" and m.get("weight", 1) != 0 for m in messages):
        raise SFTDataError("no assistant message to train on (none, or all with weight 0)")
    return messages


def _check_assistant(m: dict[str, Any], at: str) -> list[str]:
    """Check an assistant message; return the ids of its tool calls."""
    weight = m.get("weight", 1)
    if weight not in (0, 1) or isinstance(weight, bool):
        raise SFTDataError(f"{at}.weight is {weight!r}; expected 0 or 1")
    tool_calls = m.get("tool_calls")
    if tool_calls is None:
        _check_content(m.get("content"), at)
        return []
    if m.get("content") is not None:
        _check_content(m["content"], at)
    if not isinstance(tool_calls, list) or not tool_calls:
        raise SFTDataError(f"{at}.tool_calls must be a non-empty list")
    ids = []
    for j, call in enumerate(tool_calls):
        call_at = f"{at}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise SFTDataError(f"{call_at} has no function.name")
        if not _is_json_object(fn.get("arguments")):
            raise SFTDataError(f"{call_at}.function.arguments must be a JSON object or a string "
                               f"holding one, got {fn.get('arguments')!r}")
        # the tool message that answers a call names it by id (and the data model needs one)
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise SFTDataError(f"{call_at} has no id")
        ids.append(call["id"])
    return ids


def _check_content(content: Any, at: str) -> None:
    """Content is a string or a list of typed parts (text parts carry a string `text`)."""
    if isinstance(content, str):
        return
    if isinstance(content, list) and content:
        for k, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise SFTDataError(f"{at}.content[{k}] must be an object with a \"type\"")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise SFTDataError(f"{at}.content[{k}] is a text part without a string \"text\"")
        return
    raise SFTDataError(f"{at}.content must be a string or a non-empty list of parts, "
                       f"got {_kind(content)}")


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise SFTDataError(f'"tools" must be a list, got {_kind(tools)}')
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not fn["name"]):
            raise SFTDataError(f'tools[{k}] must be {{"type": "function", "function": '
                               f'{{"name": ..., ...}}}}, got {str(tool)[:120]}')
    return tools


def _is_json_object(arguments: Any) -> bool:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return False
    return isinstance(arguments, dict)


def _kind(value: Any) -> str:
    """A JSON value's kind, for messages ("a list", "null")."""
    if value is None:
        return "null"
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
             int: "a number", float: "a number"}
    return names.get(type(value), f"a {type(value).__name__}")
