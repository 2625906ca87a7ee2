"""The MCP agent loop: a model works on a task with an MCP server's tools until it is done.

One rollout, plainly:

1. List the server's tools (recorded as `trajectory.tools`) and add `complete_task(summary)`.
2. Each turn, ask the model (`model.openai_client()`, so the gateway records the exact sampled
   tokens) for its next action and append it with `trajectory.add_completion`.
3. Run the tool calls on the session inside `art_core.recording(trajectory)`: the one recording
   path (`RecordingSession` -> `ToolEvent` -> tool message matched by call id) adds the results.
   Parallel calls run concurrently and are recorded in the order the model made them.
4. Stop on `complete_task`, on a plain-text final answer, or at `max_turns`.

Three ways to ask for an action (`AgentConfig.action_format`):

- `"strict_tools"` (default): native tool calls with `strict: true` functions and
  `tool_choice="required"`. Our gateway enforces these with a grammar of the hermes call form
  (art_core/inference/tool_calls.py), so even SmolLM2-135M makes schema-valid calls (FIELD-NOTES: with
  `tool_choice="auto"` it made 0 calls in 64 tries), the sampled text is exactly what the chat
  template renders for the call, and the next turn's prompt extends it. OpenAI and other
  strict-capable endpoints accept the same request.
- `"json"`: for endpoints that enforce only `response_format`: a strict json_schema `anyOf`
  over `{"name": <tool>, "arguments": <its input schema>}`. The JSON becomes a tool call in the
  message (with an id we make); the sampled tokens stay exactly what was sampled. One call per
  turn.
- `"tools"`: native tool calling with `tool_choice="auto"`, parallel calls allowed, a text reply
  is the final answer. For models that call tools on their own.

A tool that fails gives the model an `is_error` result; one that hangs is cut by
`tool_timeout_s` and reported to the model; a server that goes away ends the rollout with
`ServerGone` (after recording the failed call), which `gather_trajectory_groups` keeps in the
group's exceptions. Metrics: turns, tool_calls, tool_errors, completed, ran_out_of_turns.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from art_core.recording import ToolEvent, recording
from art_core.trajectory import Trajectory
from art_mcp.session import RecordingSession, ServerGone

if TYPE_CHECKING:
    from art_mcp.functions import FunctionSession

COMPLETE_TASK = "complete_task"

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent that completes tasks by calling tools. Call one tool at a time, read its "
    "result, and when the task is done call complete_task with a one-sentence summary."
)
JSON_ACTION_HINT = (
    '\nReply with one JSON action only: {"name": <tool name>, "arguments": {...}}.'
)


@dataclass
class WorkedExample:
    """One solved task for `AgentConfig.examples`: the task, the tool calls that solve it
    (each `{"name", "arguments", "result"}`, the result as the tool answered) and the summary
    given to `complete_task`."""

    task: str
    calls: list[dict[str, Any]]
    summary: str

    @classmethod
    def parse(cls, data: dict[str, Any]) -> WorkedExample:
        """From a JSON object, with an error naming what is wrong."""
        if not isinstance(data, dict) or not isinstance(data.get("task"), str) \
                or not isinstance(data.get("summary"), str) \
                or not isinstance(data.get("calls"), list):
            raise ValueError('a worked example is {"task": str, "calls": [{"name", "arguments", '
                             f'"result"}}, ...], "summary": str}}, got {str(data)[:200]}')
        for c in data["calls"]:
            if not (isinstance(c, dict) and isinstance(c.get("name"), str)
                    and isinstance(c.get("arguments", {}), dict)
                    and isinstance(c.get("result"), str)):
                raise ValueError(f"a worked example's call needs name (str), arguments (object) "
                                 f"and result (str), got {str(c)[:200]}")
        return cls(task=data["task"], calls=data["calls"], summary=data["summary"])

    def messages(self, index: int) -> list[dict[str, Any]]:
        """The example as chat turns: the task, each call and its result, then `complete_task`."""
        out: list[dict[str, Any]] = [{"role": "user", "content": self.task}]
        steps = [*((c["name"], c.get("arguments", {}), c["result"]) for c in self.calls),
                 (COMPLETE_TASK, {"summary": self.summary}, "Task complete.")]
        for k, (name, arguments, result) in enumerate(steps):
            call_id = f"example_{index}_{k}"
            out += [{"role": "assistant", "content": None, "tool_calls": [
                        {"id": call_id, "type": "function",
                         "function": {"name": name, "arguments": json.dumps(arguments)}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": result}]
        return out

    @classmethod
    def load(cls, path: str | Path) -> list[WorkedExample]:
        """Worked examples from a JSON list or a JSONL file; errors name the file."""
        text = Path(path).read_text()
        try:
            data = json.loads(text) if text.lstrip().startswith("[") else \
                [json.loads(line) for line in text.splitlines() if line.strip()]
            return [cls.parse(d) for d in data]
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


@dataclass
class AgentConfig:
    """How one rollout runs."""

    max_turns: int = 6
    """Model calls per rollout; a rollout that reaches it has `ran_out_of_turns`."""
    max_tokens: int = 128
    """Tokens per model call: an action is short; a long reply is a rambling one."""
    temperature: float = 1.0
    """1.0 samples the policy as it is (what GRPO assumes); use 0 for a greedy evaluation."""
    action_format: Literal["strict_tools", "json", "tools"] = "strict_tools"
    """'json': strict json_schema action; 'strict_tools': native calls held to the schemas;
    'tools': native calls, free (see the module docstring)."""
    parallel_tool_calls: bool = False
    """'strict_tools'/'tools': allow several calls in one turn."""
    tool_timeout_s: float = 30.0
    """Seconds a tool call may take before it is cut and reported to the model as an error."""
    max_result_chars: int = 2000
    """Longer tool results are cut, with a note saying how much, before the model sees them."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_string_chars: int | None = 100
    """'json' only: a cap on free strings in arguments, so a small model cannot ramble a string
    past `max_tokens` (that would leave the JSON unfinished)."""
    examples: list[WorkedExample] = field(default_factory=list)
    """Solved tasks shown before the task, as earlier turns of the conversation (context, not
    trained on). Production agents are prompted this way; for a small model they are the
    difference between rarely finishing a task and finishing most (examples/mcp_rl.py: the
    embedded 135M model solved 8/86 inventory rollouts without and 23/86 with two)."""


AGENT_START = "agent_start"
"""Trajectory metadata: index of the task's user message; messages before it are the system
prompt and the worked examples, which are not the agent's (see `agent_messages`)."""


def agent_messages(trajectory: Trajectory) -> list[dict[str, Any]]:
    """The agent's own part of a rollout: the task and everything after it, without the system
    prompt and the worked examples shown before it. A reward that counts the agent's calls or
    reads its tool results should read these, not `trajectory.messages`."""
    start = trajectory.metadata.get(AGENT_START)
    if not isinstance(start, int) or isinstance(start, bool):
        return list(trajectory.messages)
    return list(trajectory.messages[start:])


def complete_task_tool() -> dict[str, Any]:
    """The tool the agent calls to say it is done."""
    return {"type": "function", "function": {
        "name": COMPLETE_TASK,
        "description": "Call when the task is done, with a one-sentence summary of what you did.",
        "parameters": {"type": "object", "properties": {"summary": {"type": "string"}},
                       "required": ["summary"]}}}


def _tighten(schema: Any, max_string: int | None) -> Any:
    """A copy of a JSON schema with objects closed (no extra keys unless `additionalProperties`
    is itself a schema), title annotations dropped and free strings capped, as strict
    structured outputs expect."""
    if isinstance(schema, list):
        return [_tighten(s, max_string) for s in schema]
    if not isinstance(schema, dict):
        return schema
    # a "title" annotation is a string; a property named "title" is a schema (kept)
    out = {k: _tighten(v, max_string) for k, v in schema.items()
           if not (k == "title" and isinstance(v, str))}
    if out.get("type") == "object":
        out.setdefault("properties", {})
        if not isinstance(out.get("additionalProperties"), dict):
            out["additionalProperties"] = False
    if out.get("type") == "string" and max_string and not {"enum", "const", "maxLength"} & set(out):
        out["maxLength"] = max_string
    return out


DEFS = ("$defs", "definitions")


def _hoist_defs(params: dict[str, Any], prefix: str, into: dict[str, Any]) -> dict[str, Any]:
    """Move a tool schema's local definitions into the action schema's root `$defs` (under
    `prefix`), and point its `$ref`s there: nested under `anyOf[i].properties.arguments`, a
    `#/$defs/X` would otherwise name the root, where X is not (xgrammar: "Cannot find field
    $defs"). Remote `$ref`s are left as they are (the grammar does not follow them)."""
    local = {f"#/{key}/{name}": f"#/$defs/{prefix}{name}"
             for key in DEFS for name in (params.get(key) or {})}

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(n) for n in node]
        if not isinstance(node, dict):
            return node
        return {k: (local.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v))
                for k, v in node.items()}

    for key in DEFS:
        for name, schema in (params.get(key) or {}).items():
            into[f"{prefix}{name}"] = rewrite(schema)
    return rewrite({k: v for k, v in params.items() if k not in DEFS})


def action_schema(tools: list[dict[str, Any]], max_string: int | None = 100) -> dict[str, Any]:
    """The json_schema of one action: `{"name": <tool>, "arguments": {...}}` for any tool.
    Each tool's `$defs` are carried to the root (`_hoist_defs`)."""
    options, defs = [], {}
    for i, t in enumerate(tools):
        fn = t["function"]
        params = _tighten(copy.deepcopy(fn.get("parameters") or {"type": "object"}), max_string)
        params = _hoist_defs(params, f"t{i}_", defs)
        options.append({"type": "object", "additionalProperties": False,
                        "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                       "arguments": params},
                        "required": ["name", "arguments"]})
    return {"anyOf": options, **({"$defs": defs} if defs else {})}


class _Collect:
    """A recorder that keeps events, so parallel calls can be recorded in call order."""

    def __init__(self, trajectory: Trajectory) -> None:
        self.trajectory = trajectory
        self.events: list[ToolEvent] = []

    def record_tools(self, tools: list[dict[str, Any]]) -> None:  # pragma: no cover - unused
        pass

    def record_tool_event(self, event: ToolEvent) -> str | None:
        self.events.append(event)
        return event.tool_call_id


async def run_agent(model: Any, session: RecordingSession | FunctionSession, task: str, *,
                    config: AgentConfig | None = None, trajectory: Trajectory | None = None,
                    model_name: str | None = None,
                    after_turn: Callable[[Trajectory, int], Awaitable[None]] | None = None,
                    ) -> Trajectory:
    """Run one rollout of `task` with the tools of `session` (an MCP server's, or Python
    functions' through `art_mcp.functions.FunctionSession`); returns the trajectory.

    `model` is an `art_core.Model` (a `TrainableModel` records exact tokens; another endpoint
    gives context-only turns, counted in `metrics["untrainable_turns"]`). `model_name` overrides
    the name sent (e.g. "agent@0" to evaluate a fixed step). `after_turn(trajectory, k)` is
    awaited after each sampled turn k (its index in `trajectory.turns`) once that turn's tool
    calls have run, while the server still holds the state they left: where a per-turn reward
    is read (`art_mcp.train.rollout`'s `turn_reward`)."""
    cfg = config or AgentConfig()
    traj = trajectory or Trajectory()
    with recording(traj):
        await session.list_tools()
    traj.tools = [*(traj.tools or []), complete_task_tool()]
    if not traj.messages:
        system = cfg.system_prompt + (JSON_ACTION_HINT if cfg.action_format == "json" else "")
        shown = [m for i, ex in enumerate(cfg.examples) for m in ex.messages(i)]
        traj.messages = [{"role": "system", "content": system}, *shown,
                         {"role": "user", "content": task}]
        traj.metadata[AGENT_START] = len(traj.messages) - 1  # worked examples come before it
    session.timeout_s, session.max_result_chars = cfg.tool_timeout_s, cfg.max_result_chars
    m = traj.metrics
    m.update(turns=0, tool_calls=0, tool_errors=0, completed=False, ran_out_of_turns=False)
    if task_only := getattr(session, "task_only_tools", None):
        m["tools_not_offered"] = len(task_only)  # they run only as tasks: see needs_task
    client = model.openai_client()
    request: dict[str, Any] = {"model": model_name or model.name, "max_tokens": cfg.max_tokens,
                               "temperature": cfg.temperature, "tools": traj.tools}
    if cfg.action_format == "json":
        request["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "action", "strict": True,
            "schema": action_schema(traj.tools, cfg.max_string_chars)}}
    else:
        request["parallel_tool_calls"] = cfg.parallel_tool_calls
    if cfg.action_format == "strict_tools":
        traj.tools = [{**t, "function": {**t["function"], "strict": True}} for t in traj.tools]
        request.update(tools=traj.tools, tool_choice="required")
    done = False
    stop = False
    while not (done or stop) and m["turns"] < cfg.max_turns:  # the client is shared
        response = await client.chat.completions.create(messages=traj.messages, **request)
        m["turns"] += 1
        sampled = len(traj.turns)
        message = _append(traj, response)
        if cfg.action_format == "json":
            calls = _json_action(traj, message)
        else:
            calls = message.get("tool_calls") or []
        if not calls and cfg.action_format == "strict_tools":
            # a forced call cut off at max_tokens comes back empty: an invalid action
            m["invalid_actions"] = int(m.get("invalid_actions", 0)) + 1
            traj.log(f"invalid action: the tool call did not finish within max_tokens="
                     f"{cfg.max_tokens}")
            stop = True
        elif not calls:  # a text reply: the final answer (in "json", an unfinished action)
            m["final_answer"] = cfg.action_format != "json"
            stop = True
        else:
            done = await _run_calls(traj, session, calls)
        if after_turn is not None and len(traj.turns) > sampled:
            await after_turn(traj, len(traj.turns) - 1)
    m["ran_out_of_turns"] = (not done and not m.get("final_answer")
                             and not m.get("invalid_actions") and m["turns"] >= cfg.max_turns)
    return traj


def _append(traj: Trajectory, response: Any) -> dict[str, Any]:
    """Append the reply with its sampled tokens; a reply from an endpoint that sends none
    (not our gateway) is kept as context and counted."""
    try:
        return traj.add_completion(response)
    except ValueError:
        data = response if isinstance(response, dict) else response.model_dump()
        msg = data["choices"][0]["message"]
        message = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                for c in msg["tool_calls"]]
        traj.messages.append(message)
        traj.metrics["untrainable_turns"] = int(traj.metrics.get("untrainable_turns", 0)) + 1
        return message


def _json_action(traj: Trajectory, message: dict[str, Any]) -> list[dict[str, Any]]:
    """Turn a JSON action reply into one tool call on the message (in place). A reply that is
    not a valid action (cut off at max_tokens) stays text and ends the rollout."""
    try:
        action = json.loads(message.get("content") or "")
        name, arguments = action["name"], action["arguments"]
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise TypeError("name must be a string and arguments an object")
    except (ValueError, KeyError, TypeError) as e:
        traj.metrics["invalid_actions"] = int(traj.metrics.get("invalid_actions", 0)) + 1
        traj.log(f"invalid action ({type(e).__name__}: {e}): {(message.get('content') or '')[:200]}")
        return []
    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
    message["content"] = None
    message["tool_calls"] = [call]
    return [call]


async def _run_calls(traj: Trajectory, session: RecordingSession | FunctionSession,
                     calls: list[dict[str, Any]]) -> bool:
    """Run one turn's tool calls concurrently, record them in call order; True when the agent
    called `complete_task`. Raises `ServerGone` once the results are recorded, if the server
    went away."""
    collect = _Collect(traj)
    done = False

    async def one(call: dict[str, Any]) -> BaseException | None:
        nonlocal done
        fn = call["function"]
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
            if not isinstance(arguments, dict):
                raise ValueError("arguments must be a JSON object")
        except ValueError as e:
            collect.record_tool_event(ToolEvent(
                name=fn["name"], arguments={}, tool_call_id=call["id"], is_error=True,
                content=f"Error: the arguments are not a JSON object ({e})"))
            return None
        if fn["name"] == COMPLETE_TASK:
            done = True
            traj.metadata["summary"] = str(arguments.get("summary", ""))[:500]
            collect.events.append(ToolEvent(name=COMPLETE_TASK, arguments=arguments,
                                            tool_call_id=call["id"], content="Task complete."))
            return None
        try:
            with recording(collect):
                await session.call_tool(fn["name"], arguments, tool_call_id=call["id"])
        except Exception as e:  # recorded by the session already; the model reads the error
            return e
        return None

    errors = await asyncio.gather(*(one(c) for c in calls))
    order = {c["id"]: i for i, c in enumerate(calls)}
    with recording(traj) as recorder:
        for event in sorted(collect.events, key=lambda e: order.get(e.tool_call_id or "", 0)):
            if event.name == COMPLETE_TASK:  # not an MCP call: answered, not counted as one
                traj.messages.append({"role": "tool", "tool_call_id": event.tool_call_id,
                                      "content": event.content})
            else:
                recorder.record_tool_event(event)
    traj.metrics["completed"] = bool(traj.metrics.get("completed")) or done
    gone = next((e for e in errors if e is not None and session.closed), None)
    if gone is not None:
        raise ServerGone(f"the MCP server went away during the rollout: {gone}") from gone
    return done

