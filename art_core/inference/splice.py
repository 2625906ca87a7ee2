"""Token in, token out: a continued chat is sent to vLLM as token ids, never re-rendered.

Why: vLLM renders a chat request's whole message list through the template, and that does not
reproduce what the model sampled (token boundaries the tool-call grammar let it choose, call
JSON re-serialised, terminators, thinking stripped). The trainer then sees a prompt that does
not extend the previous turn and trains the prefix again (ARCHITECTURE invariant 1).

The rule, per chat request (art_core/inference/completions.py calls `Splicer.plan`):

1. Every answer the gateway gives is remembered under a hash of (engine, tools, template
   options, the request's messages, the answer's assistant message: its tool-call ids, or its
   content). The record holds the prompt ids and the sampled ids of that choice.
2. A request whose messages contain assistant turns is looked up by the same hash at its last
   assistant turn. Found: the prompt is
       earlier prompt ids + earlier sampled ids + ids of the new messages' rendering
   (the rendering derived from the template: art_core/inference/chat_tokens.py), sent to
   vLLM's `/v1/completions` as a token-id prompt, and the answer is turned back into an
   ordinary chat completion (tool calls parsed as the hermes parser does; strict calls as
   art_core/inference/tool_calls.py does).
3. Not found, or the template cannot be split, or the request asks for what the completions
   route cannot do: the request goes to vLLM's chat route as before, and the reason is put on
   the answer (`art_splice`), so the trainer can say why a sequence split.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_core.inference.chat_tokens import TemplateSplitError, check_template, suffix_ids
from art_core.protocol import SPLICE, message_key

__all__ = ["SPLICE", "Plan", "Splicer", "chat_response", "completions_body", "top_logprobs"]

if TYPE_CHECKING:
    from art_core.inference.engine import VLLMEngine

log = logging.getLogger(__name__)

CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
             "add_generation_prompt", "continue_final_message", "documents",
             "max_completion_tokens", "top_logprobs", "logprobs", "stream", "stream_options",
             "reasoning_effort", "include_reasoning", "functions", "function_call")
"""Fields of a chat request that the completions route does not take (converted or dropped)."""

UNSPLICEABLE = ("chat_template", "continue_final_message", "documents", "mm_processor_kwargs")
"""Request fields that change the rendering in ways the splice cannot reproduce."""


@dataclass(frozen=True)
class Served:
    """One remembered choice: what the engine saw and sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    born: float = 0.0  # when the conversation's first turn reached the gateway (time.time())


@dataclass
class Plan:
    """The outcome of `Splicer.plan`: token ids to send, or the reason not to."""

    prompt_ids: list[int] | None = None
    reason: str | None = None  # set when the request continues a chat and was not spliced
    exact_prefix: bool = True
    history: Any = None  # the hash of the request's history (`Splicer._chain`), for `remember`
    born: float | None = None  # when the conversation began, if it continues one we served

    @property
    def spliced(self) -> bool:
        return self.prompt_ids is not None


class Splicer:
    """The gateway's memory of served turns and the per-engine tokenizers that extend them."""

    def __init__(self, size: int = 50_000) -> None:
        self.size = size
        self._served: OrderedDict[bytes, Served] = OrderedDict()
        self._answers: OrderedDict[str, None] = OrderedDict()  # served answers alone: reasons
        self._tokenizers: dict[str, Any] = {}
        self._problems: dict[str, list[str]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.counts: dict[str, int] = {}

    # ---- tokenizers ----------------------------------------------------------------------

    async def prepare(self, engine: VLLMEngine) -> list[str]:
        """Load the engine's tokenizer and check its template (warned once per engine)."""
        key = engine.served_name
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._tokenizers:
                try:
                    tok = await asyncio.to_thread(_load_tokenizer, engine)
                    problems = await asyncio.to_thread(check_template, tok)
                except Exception as e:  # noqa: BLE001 - no tokenizer: nothing is spliced
                    tok, problems = None, [f"its tokenizer does not load ({e})"]
                self._tokenizers[key], self._problems[key] = tok, problems
                if problems:
                    log.warning("the chat template of %s cannot always be continued from the "
                                "sampled tokens, so some multi-turn conversations will train as "
                                "several sequences: %s", key, "; ".join(problems))
        return self._problems[key]

    # ---- the rule ------------------------------------------------------------------------

    @staticmethod
    def _chain(engine: VLLMEngine, body: dict[str, Any]) -> tuple[Any, dict[int, bytes]]:
        """The hash of (engine, tools, template options, every message), and its digest after
        each assistant message: the keys `remember` stores and `plan` looks up."""
        h = hashlib.sha256()
        h.update(json.dumps([engine.served_name, body.get("tools"),
                             body.get("chat_template_kwargs")], sort_keys=True).encode())
        at: dict[int, bytes] = {}
        for i, m in enumerate(body["messages"]):
            h.update(message_key(m).encode() if isinstance(m, dict) else b"?")
            if isinstance(m, dict) and m.get("role") == "assistant":
                at[i] = h.digest()
        return h, at

    async def plan(self, engine: VLLMEngine, body: dict[str, Any]) -> Plan:
        messages = body["messages"]
        if not engine.config.splice_turns:
            continued = any(isinstance(m, dict) and m.get("role") == "assistant"
                            for m in messages)
            return self._count(Plan(reason="splicing_off")) if continued else Plan()
        history, at = self._chain(engine, body)  # once per request: `remember` reuses it
        assistants = sorted(at)
        if not assistants:
            return Plan(history=history)  # a first turn: nothing to continue
        if any(body.get(k) is not None for k in UNSPLICEABLE) or \
                body.get("add_generation_prompt") is False or \
                messages[-1].get("role") == "assistant":
            return self._count(Plan(reason="unsupported_request", history=history))
        if body.get("tools") and engine.config.tool_call_parser not in (None, "hermes"):
            return self._count(Plan(reason="tool_parser_unsupported", history=history))
        hits: list[tuple[int, Served]] = []
        for i in assistants:
            if (served := self._served.get(at[i])) is not None:
                hits.append((i, served))
                self._served.move_to_end(at[i])
        born = hits[0][1].born if hits else None  # the conversation's age, for scheduling
        if not hits or hits[-1][0] != assistants[-1]:
            # an answer we served, in a history that is not the one we served it in: the client
            # edited, dropped or summarised; else the last assistant turn is the client's own
            known = hits or message_key(messages[assistants[-1]]) in self._answers
            return self._count(Plan(reason="rewritten_history" if known
                                    else "unknown_prior_turn", history=history, born=born))
        upto, served = hits[-1]
        await self.prepare(engine)
        tok = self._tokenizers[engine.served_name]
        if tok is None:
            return self._count(Plan(reason="tokenizer_unavailable", history=history))
        try:
            sfx = await asyncio.to_thread(
                suffix_ids, tok, messages, upto, served.completion_ids, tools=body.get("tools"),
                template_kwargs=body.get("chat_template_kwargs"))
        except TemplateSplitError as e:
            return self._count(Plan(reason=e.reason, history=history))
        except Exception as e:  # noqa: BLE001 - a template may raise anything on odd input
            log.debug("splice render failed: %s", e)
            return self._count(Plan(reason="template_error", history=history))
        plan = Plan(prompt_ids=served.prompt_ids + served.completion_ids + sfx.token_ids,
                    exact_prefix=sfx.exact_prefix, history=history, born=born)
        return self._count(plan)

    def remember(self, engine: VLLMEngine, body: dict[str, Any], data: dict[str, Any],
                 turn: Plan | None = None, started_at: float = 0.0) -> None:
        """Remember each choice of a chat answer (with our token fields) for the next turn;
        `turn` is this request's plan, whose hash of the history is reused; `started_at`,
        when this request arrived (the conversation's birth if it is its first turn)."""
        prompt = data.get("prompt_token_ids")
        if not prompt or not engine.config.splice_turns:
            return
        h = turn.history if turn is not None and turn.history is not None else \
            self._chain(engine, body)[0]
        for choice in data.get("choices") or []:
            ids = choice.get("token_ids")
            if not ids:
                continue
            k, answer = h.copy(), message_key({"role": "assistant",
                                               **(choice.get("message") or {})})
            k.update(answer.encode())
            # the lists the ledger keeps too (not copies): the memory is paid once
            born = turn.born if turn is not None and turn.born is not None else started_at
            self._served[k.digest()] = Served(prompt, ids, born)
            self._answers[answer] = None
            while len(self._served) > self.size:
                self._served.popitem(last=False)
            while len(self._answers) > self.size:
                self._answers.popitem(last=False)

    def _count(self, plan: Plan) -> Plan:
        key = "spliced" if plan.spliced else (plan.reason or "first_turn")
        self.counts[key] = self.counts.get(key, 0) + 1
        return plan


def _load_tokenizer(engine: VLLMEngine) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(engine.model_path)
    if engine.config.chat_template:  # what vLLM was started with (--chat-template)
        with open(engine.config.chat_template) as f:
            tok.chat_template = f.read()
    return tok


# ---- the completions request and its answer as a chat completion -------------------------


def top_logprobs(chat: dict[str, Any]) -> int:
    """The alternatives per token a chat request asks for (0: none)."""
    top = chat.get("top_logprobs")
    return top if isinstance(top, int) and not isinstance(top, bool) and top > 0 else 0


def completions_body(chat: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
    """A chat request (already routed and planned) as a token-id `/v1/completions` request."""
    up = {k: v for k, v in chat.items() if k not in CHAT_ONLY}
    up["prompt"] = prompt_ids
    up["max_tokens"] = chat.get("max_completion_tokens", chat.get("max_tokens"))
    up["logprobs"] = top_logprobs(chat)
    up["return_token_ids"] = True
    return up


def chat_response(data: dict[str, Any], prompt_ids: list[int], tools: bool, top_logprobs: int
                  ) -> dict[str, Any]:
    """A `/v1/completions` answer as the chat completion vLLM's chat route would give (our
    token fields included); with `tools`, hermes calls in the text become `tool_calls`."""
    from art_core.inference.tool_calls import parse_hermes

    choices = []
    for i, c in enumerate(data.get("choices") or []):
        text = c.get("text") or ""
        msg: dict[str, Any] = {"role": "assistant", "content": text, "tool_calls": []}
        finish = c.get("finish_reason")
        if tools and (parsed := parse_hermes(text)) is not None:
            msg["content"], msg["tool_calls"] = parsed
            finish = "tool_calls"
        choices.append({"index": c.get("index", i), "message": msg,
                        "logprobs": _chat_logprobs(c.get("logprobs"), top_logprobs),
                        "finish_reason": finish,
                        "stop_reason": c.get("stop_reason"), "token_ids": c.get("token_ids")})
    rid = str(data.get("id") or "")
    return {"id": "chatcmpl-" + rid.removeprefix("cmpl-"), "object": "chat.completion",
            "created": data.get("created") or int(time.time()), "model": data.get("model"),
            "choices": choices, "usage": data.get("usage"), "prompt_token_ids": prompt_ids}


def _chat_logprobs(lp: dict[str, Any] | None, top_n: int) -> dict[str, Any] | None:
    """Completions logprobs ({tokens, token_logprobs, top_logprobs}) in the chat shape, with
    `top_n` alternatives per token as the chat request asked."""
    if not lp:
        return None
    tops = lp.get("top_logprobs") or []
    content = []
    for k, (token, logprob) in enumerate(zip(lp.get("tokens") or [],
                                             lp.get("token_logprobs") or [], strict=False)):
        top = tops[k] if top_n and k < len(tops) and isinstance(tops[k], dict) else {}
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                         for t, v in list(top.items())[:top_n]]})
    return {"content": content}
