"""What the chat template puts after an assistant turn: the token-in half of a spliced prompt.

A continued conversation's next prompt is built from token ids (art_core/inference/splice.py):

    earlier prompt ids + earlier sampled ids + suffix ids

and this module derives the suffix from the model's own chat template, for any family, by
rendering with and without the new messages and taking the difference:

    A = render(messages up to and including the earlier assistant turn)
    B = render(all messages, add_generation_prompt=True)

If B starts with A (the template renders history the same whatever follows it), the new part
is B[len(A):]. Templates that rewrite history when more follows (Qwen3 drops the empty
`<think></think>` wrapper and stripped reasoning of earlier turns) fail that test; for them the
new part starts after the turn in B that ends where A ends: the n-th end-of-turn marker, with n
the number of markers in A. The model's own tokens stand in for the history either way, so the
rewrite never reaches the model. The end-of-turn marker ("<|im_end|>\\n", "<end_of_turn>\\n",
...) is what the template writes after an assistant message's content (found with a sentinel
message). The earlier completion usually ends with part of it (the EOS token it sampled); only
the rest is added:

    suffix = (end-of-turn marker - what the completion already ends with) + B[after A]

`check_template` runs a synthetic three-turn tool conversation through this at `register()`
and says what breaks, once, when it cannot work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

SENTINEL = "\u2063ART\u2063SENTINEL\u2063"


class Tokenizer(Protocol):
    """The part of a transformers tokenizer this module uses."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class TemplateSplitError(ValueError):
    """The template cannot be split at an assistant turn; `reason` names how (a metric key)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Suffix:
    """The token ids to append after an earlier completion, and how they were found."""

    token_ids: list[int]
    exact_prefix: bool  # B started with A (False: realigned at the end-of-turn marker)


def render(tok: Tokenizer, messages: list[dict[str, Any]], *, tools: Any = None,
           add_generation_prompt: bool, template_kwargs: dict[str, Any] | None = None) -> str:
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    return tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=add_generation_prompt, **kwargs)


def end_of_turn(tok: Tokenizer, before: list[dict[str, Any]], *, tools: Any = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """What the template writes after an assistant message's content, when it is the last
    message (e.g. "<|im_end|>\\n")."""
    text = render(tok, [*before, {"role": "assistant", "content": SENTINEL}], tools=tools,
                  add_generation_prompt=False, template_kwargs=template_kwargs)
    at = text.rfind(SENTINEL)
    if at < 0:
        raise TemplateSplitError("template_drops_content",
                                 "the chat template does not render an assistant message's "
                                 "content")
    eot = text[at + len(SENTINEL):]
    if not eot:
        raise TemplateSplitError("template_no_end_of_turn",
                                 "the chat template writes nothing after an assistant turn, so "
                                 "turns cannot be told apart")
    return eot


def new_part(tok: Tokenizer, messages: list[dict[str, Any]], upto: int, *, tools: Any = None,
             template_kwargs: dict[str, Any] | None = None) -> tuple[str, str, bool]:
    """(end-of-turn marker, rendering of messages[upto + 1:] plus the generation prompt,
    whether the template extended the earlier rendering exactly). `messages[upto]` is the
    earlier assistant turn."""
    head = messages[: upto + 1]
    eot = end_of_turn(tok, messages[:upto], tools=tools, template_kwargs=template_kwargs)
    a = render(tok, head, tools=tools, add_generation_prompt=False,
               template_kwargs=template_kwargs)
    b = render(tok, messages, tools=tools, add_generation_prompt=True,
               template_kwargs=template_kwargs)
    if b.startswith(a) and a.endswith(eot):
        return eot, b[len(a):], True
    if not a.endswith(eot):
        raise TemplateSplitError("template_not_prefix",
                                 f"the rendering of an assistant turn does not end with the "
                                 f"template's end-of-turn marker {eot!r}")
    n, pos = a.count(eot), 0
    for _ in range(n):
        pos = b.find(eot, pos)
        if pos < 0:
            raise TemplateSplitError("template_not_prefix",
                                     "the template renders fewer turns when more messages "
                                     "follow")
        pos += len(eot)
    return eot, b[pos:], False


def suffix_ids(tok: Tokenizer, messages: list[dict[str, Any]], upto: int,
               completion_ids: Sequence[int], *, tools: Any = None,
               template_kwargs: dict[str, Any] | None = None) -> Suffix:
    """The ids that follow `completion_ids` (the sampled ids of `messages[upto]`) in the next
    prompt: the end of that turn the completion did not sample, the new messages, the
    generation prompt."""
    eot, new, exact = new_part(tok, messages, upto, tools=tools,
                               template_kwargs=template_kwargs)
    eot_ids = tok.encode(eot, add_special_tokens=False)
    overlap = 0  # the completion's last tokens that already are the marker's first ones
    for k in range(min(len(eot_ids), len(completion_ids)), 0, -1):
        if list(completion_ids[-k:]) == eot_ids[:k]:
            overlap = k
            break
    rest = eot_ids[overlap:]
    ids = rest + tok.encode(new, add_special_tokens=False) if overlap else \
        tok.encode(eot + new, add_special_tokens=False)
    return Suffix(ids, exact)


TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                   "required": ["q"]}}}]
TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "What is a pen?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "lookup", "arguments": '{"q": "pen"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a writing tool"},
    {"role": "assistant", "content": "A writing tool."},
    {"role": "user", "content": "Thanks!"},
]
PLAIN_CONVERSATION: list[dict[str, Any]] = [  # for templates without tool roles (Gemma 3)
    {"role": "user", "content": "What is a pen?"},
    {"role": "assistant", "content": "A writing tool."},
    {"role": "user", "content": "For what?"},
    {"role": "assistant", "content": "For writing."},
    {"role": "user", "content": "Thanks!"},
]


def check_template(tok: Tokenizer, template_kwargs: dict[str, Any] | None = None
                   ) -> list[str]:
    """Problems of the template for spliced turns (empty: it works). Renders a synthetic
    three-turn tool conversation (plain turns if the template has no tool roles) and checks
    that splicing at each assistant turn gives the tokens a full render gives, up to history
    the template rewrites."""
    try:
        render(tok, TOOL_CONVERSATION, tools=TOOLS, add_generation_prompt=True,
               template_kwargs=template_kwargs)
        cases = (TOOL_CONVERSATION, TOOLS, ((2, 4), (4, 6)))
    except Exception:  # noqa: BLE001 - no tool roles: tool requests fail in vLLM anyway
        cases = (PLAIN_CONVERSATION, None, ((1, 3), (3, 5)))
    messages, tools, splits = cases
    problems: list[str] = []
    for upto, end in splits:
        try:
            sfx = suffix_ids(tok, messages[:end], upto, [], tools=tools,
                             template_kwargs=template_kwargs)
            full = tok.encode(render(tok, messages[:end], tools=tools,
                                     add_generation_prompt=True,
                                     template_kwargs=template_kwargs), add_special_tokens=False)
        except TemplateSplitError as e:
            problems.append(f"turn {upto}: {e}")
            continue
        except Exception as e:  # noqa: BLE001 - a template may raise anything (e.g. on roles)
            problems.append(f"turn {upto}: the template cannot render it ({e})")
            continue
        if not _ends_with(full, sfx.token_ids):
            problems.append(f"turn {upto}: the new messages tokenize differently on their own "
                            "than inside the whole conversation")
    return problems


def _ends_with(ids: list[int], tail: list[int]) -> bool:
    return len(tail) <= len(ids) and ids[len(ids) - len(tail):] == tail
