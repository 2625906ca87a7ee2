"""Strict tool calls: the gateway makes even a 135M model emit well-formed, schema-valid calls.

Why: offered tools with `tool_choice="auto"`, SmolLM2-135M almost never calls one, and with
`tool_choice="required"` vLLM 0.32 (hermes parser) constrains only the call's envelope unless the
function says `strict: true`, so the arguments are junk (FIELD-NOTES). When a chat request asks
for strict tools (a forced `tool_choice`: "required" or a named function; or `strict: true` on a
function), the gateway

1. sends it to vLLM with `tool_choice="none"` (the chat template still renders the tools into the
   prompt) and a `structured_outputs.structural_tag` whose grammar admits exactly the hermes text
   the template renders for an assistant tool call,
       <tool_call>\\n{"name": "<name>", "arguments": <JSON>}\\n</tool_call>
   with <JSON> held to the function's `parameters` schema, written on one line with the
   separators `json.dumps` uses (", " and ": "); with a forced choice only calls are allowed, with
   `strict` and "auto" free text may come first;
2. turns the sampled text back into an OpenAI response: `message.tool_calls` with `call_...` ids
   and the arguments *exactly as sampled*, `finish_reason: "tool_calls"`.

Token ids and logprobs are not touched, so the gateway records what was sampled, and the next
turn's prompt (the template renders the returned call verbatim) extends this turn's text.
A streaming request gets the finished response as one chunk per choice (buffered), because a
call is only known to be complete when the grammar ends. Requests without tools, with
`tool_choice="none"`, or "auto" without a strict function pass through unchanged.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from art_core.protocol import CONSTRAINED_FROM, STEP

CALL_BEGIN = '<tool_call>\n{"name": "'
CALL_END = "}\n</tool_call>"
# Arguments cannot hold a raw newline (JSON escapes it), so the first "}\n</tool_call>" ends them.
_CALL = re.compile(r'<tool_call>\n\{"name": "([^"\n]*)", "arguments": (.*?)\}\n</tool_call>',
                   re.DOTALL)


class ToolCallError(ValueError):
    """A request whose strict tools cannot be enforced (answered with HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    """How one request's tool calls are constrained."""

    tools: tuple[tuple[str, str], ...]  # (name, JSON schema of its arguments), in request order
    forced: bool  # a call is required (tool_choice "required" or named)
    parallel: bool  # more than one call allowed (only when parallel_tool_calls is true)

    def upstream(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request as sent to vLLM: tools still rendered, the call shape in the grammar."""
        tags = [{"type": "tag", "begin": f'{CALL_BEGIN}{name}", "arguments": ',
                 "content": _arguments_format(schema), "end": CALL_END}
                for name, schema in self.tools]
        if self.forced:
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                   "at_least_one": True, "stop_after_first": not self.parallel}
        else:
            fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
                   "at_least_one": False, "stop_after_first": not self.parallel}
        up = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        up["tool_choice"] = "none"
        # some models mark <tool_call> as a special token; "none" would let vLLM drop it from
        # the text we parse (its own tool path turns skipping off too)
        up.setdefault("skip_special_tokens", False)
        up["structured_outputs"] = {
            "structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}
        return up

    def convert(self, data: dict[str, Any]) -> dict[str, Any]:
        """Turn each choice whose text is complete calls into an OpenAI tool-call message, and
        mark from which token the grammar chose (`CONSTRAINED_FROM`): those tokens' logprobs
        are of the masked distribution, which the trainer must not use as the model's.

        A forced call that did not complete (cut by max_tokens) never comes back as content:
        the message is empty with finish_reason "length", an invalid action for the agent."""
        names = {name for name, _ in self.tools}
        for choice in data.get("choices") or []:
            msg = choice.get("message") or {}
            text = msg.get("content") or ""
            parsed = parse_calls(text, names)
            if self.forced:
                choice[CONSTRAINED_FROM] = 0
            elif "<tool_call>" in text:
                choice[CONSTRAINED_FROM] = _token_at(choice, text.find("<tool_call>"))
            if parsed is None:
                if self.forced:
                    msg["content"], msg["tool_calls"] = None, []
                    choice["finish_reason"] = "length"
                continue  # free text (auto with strict functions): left as it is
            content, calls = parsed
            msg["content"] = content
            msg["tool_calls"] = calls
            choice["finish_reason"] = "tool_calls"
        return data


def _token_at(choice: dict[str, Any], char: int) -> int:
    """Index of the sampled token that holds character `char` of the choice's text (from the
    logprobs' token strings; 0 when they are missing)."""
    seen = 0
    for k, t in enumerate(((choice.get("logprobs") or {}).get("content")) or []):
        seen += len(t.get("token") or "")
        if seen > char:
            return k
    return 0


def plan_tools(body: dict[str, Any]) -> ToolPlan | None:
    """The constraint a chat request asks for, or None when it asks for no strict tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools or choice == "none":
        return None
    functions = [t.get("function") for t in tools
                 if isinstance(t, dict) and t.get("type", "function") == "function"]
    functions = [f for f in functions if isinstance(f, dict) and isinstance(f.get("name"), str)]
    named = None
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name")
        if not isinstance(named, str):
            raise ToolCallError("tool_choice must be 'none', 'auto', 'required' or "
                                '{"type": "function", "function": {"name": ...}}', "tool_choice")
    forced = choice == "required" or named is not None
    if not forced and not any(f.get("strict") is True for f in functions):
        return None  # plain "auto": the model decides, vLLM parses, nothing is forced
    if named is not None:
        functions = [f for f in functions if f["name"] == named]
        if not functions:
            raise ToolCallError(f"tool_choice names the function {named!r}, which is not in "
                                "'tools'", "tool_choice")
    if not functions:
        raise ToolCallError("tool_choice requires a call but 'tools' has no function", "tools")
    rf = body.get("response_format")
    if body.get("structured_outputs") is not None or (
            isinstance(rf, dict) and rf.get("type") not in (None, "text")):
        raise ToolCallError("strict tools (a forced tool_choice or strict: true) cannot be "
                            "combined with response_format or structured_outputs: the tool "
                            "call's grammar already fixes the output", "response_format")
    for f in functions:
        if not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", f["name"]):
            raise ToolCallError(f"function name {f['name']!r} must be 1-64 letters, digits, "
                                "'_', '-', '.' or ':'", "tools")
    specs = tuple(
        (f["name"], json.dumps(cap_strings(f.get("parameters") or {"type": "object"}),
                               sort_keys=False)
         if forced or f.get("strict") is True else '{"type": "object"}')
        for f in functions)
    for _, schema in specs:
        _arguments_format(schema)  # an unsupported schema is the client's 400, not vLLM's 500
    return ToolPlan(specs, forced, body.get("parallel_tool_calls") is True)


STRING_CAP = 256
"""maxLength the grammar gives a string argument whose schema sets none: without a bound a
small model can ramble inside one string until max_tokens, and the call never closes."""


def cap_strings(schema: Any, cap: int = STRING_CAP) -> Any:
    """A copy of a JSON schema whose unbounded strings get `maxLength: cap`."""
    if isinstance(schema, list):
        return [cap_strings(s, cap) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: cap_strings(v, cap) if isinstance(v, dict | list) else v
           for k, v in schema.items()}
    kind = schema.get("type")
    is_string = kind == "string" or (isinstance(kind, list) and "string" in kind)
    if is_string and not {"maxLength", "enum", "const", "pattern", "format"} & schema.keys():
        out["maxLength"] = cap
    return out


@functools.lru_cache(maxsize=256)
def _arguments_grammar(schema: str) -> str | None:
    try:
        import xgrammar  # comes with vLLM (CPU and CUDA builds)
    except ImportError:
        return None
    try:
        grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False,
                                                    separators=(", ", ": "))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError variants
        raise ToolCallError(f"unsupported parameters schema: {e}", "tools") from None
    return str(grammar)


def _arguments_format(schema: str) -> dict[str, Any]:
    """A structural-tag format for one call's arguments: canonical one-line JSON when xgrammar
    is importable (it is wherever vLLM is), else the engine's own JSON-schema format."""
    grammar = _arguments_grammar(schema)
    if grammar is None:
        return {"type": "json_schema", "json_schema": json.loads(schema)}
    return {"type": "grammar", "grammar": grammar}


def parse_calls(text: str, names: set[str]) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content before the calls or None, tool calls) when `text` is optional free text followed
    by complete hermes calls separated by newlines; None otherwise (nothing is guessed)."""
    calls: list[dict[str, Any]] = []
    pos, content = 0, None
    for m in _CALL.finditer(text):
        gap = text[pos:m.start()]
        if calls and gap != "\n":
            return None
        if not calls:
            content = gap or None
        try:
            args = json.loads(m.group(2))
        except ValueError:
            return None
        if m.group(1) not in names or not isinstance(args, dict):
            return None
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": m.group(1), "arguments": m.group(2)}})
        pos = m.end()
    if not calls or text[pos:].strip():
        return None
    return content, calls


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """Hermes tool calls in free text, read as vLLM's `hermes` parser reads them (content
    before the first `<tool_call>`, each call's JSON, arguments re-serialised), for answers the
    gateway turns into chat completions itself (art_core/inference/splice.py). None when the
    text holds no call that parses."""
    if "<tool_call>" not in text:
        return None
    calls: list[dict[str, Any]] = []
    for m in _HERMES.finditer(text):
        try:
            call = json.loads((m.group(1) or m.group(2) or "").strip())
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        calls.append({"id": "chatcmpl-tool-" + secrets.token_hex(16), "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(
                          call.get("arguments", {}), ensure_ascii=False)}})
    content = text[: text.find("<tool_call>")]
    return (content or None), calls


def stream_chunks(data: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A finished chat response as SSE chunks: per choice one delta carrying the whole message
    (tool calls indexed, tokens and logprobs included), then its finish reason."""
    base = {"id": data.get("id"), "object": "chat.completion.chunk",
            "created": data.get("created"), "model": data.get("model")}
    chunks: list[dict[str, Any]] = []
    for i, c in enumerate(data.get("choices") or []):
        msg, index = c.get("message") or {}, c.get("index", i)
        delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content"),
                                 "id": data.get("id")}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [dict(tc, index=k) for k, tc in enumerate(msg["tool_calls"])]
        first = {**base, "choices": [{"index": index, "delta": delta, "logprobs": c.get("logprobs"),
                                      "finish_reason": None, "token_ids": c.get("token_ids")}]}
        if i == 0:
            first["prompt_token_ids"] = data.get("prompt_token_ids")
            first[STEP] = data.get(STEP)
        chunks.append(first)
        chunks.append({**base, "choices": [{"index": index, "delta": {},
                                            "finish_reason": c.get("finish_reason")}]})
    if include_usage:
        chunks.append({**base, "choices": [], "usage": data.get("usage")})
    return chunks
