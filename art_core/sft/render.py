"""A conversation as token ids and a loss mask: which tokens are the assistant turns to train.

There are no sampled token ids to train on in SFT data (or in a history the RL trainer is asked to
re-tokenize), so the conversation is rendered through the tokenizer's chat template. A turn's
tokens are what rendering the conversation up to and including it adds to rendering the
conversation before it with the generation prompt: exactly what the model would have to sample.
All turns train as one sequence, which needs every such prompt to extend the tokens rendered
before it; a template that rewrites earlier turns (e.g. drops the reasoning of past turns) cannot
be trained turn by turn.

Nothing here imports transformers: the caller passes the tokenizer.
"""

from __future__ import annotations

from typing import Any, Literal

from art_core.sft.data import SFTDataError


def assistant_mask_tokens(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    assistant_turns: Literal["all", "last"] = "all",
    *,
    skip_mismatched: bool = False,
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and a 0/1 mask, 1 exactly on the tokens of the assistant
    turns to train: `"all"` every assistant message whose weight is not 0, `"last"` only the
    final assistant message. The sequence ends with the last trained turn.

    A trained turn whose prompt does not extend the tokens before it raises SFTDataError naming
    the message, or with `skip_mismatched` is left untrained (the RL trainer's fallback). Both
    lists are empty when no turn is trained."""
    if assistant_turns not in ("all", "last"):
        raise ValueError(f"assistant_turns is {assistant_turns!r}; expected 'all' or 'last'")
    trained = [i for i, m in enumerate(messages)
               if m["role"] == "assistant" and m.get("weight", 1) != 0]
    if assistant_turns == "last":
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        trained = [last] if last in trained else []
    tokens: list[int] = []
    mask: list[int] = []
    for i in trained:
        prompt = _render(tokenizer, messages[:i], tools, generation_prompt=True)
        full = _render(tokenizer, messages[: i + 1], tools, generation_prompt=False)
        if full[: len(prompt)] != prompt or prompt[: len(tokens)] != tokens:
            if skip_mismatched:
                continue
            raise SFTDataError(
                f"messages[{i}] (assistant) does not render as an extension of the tokens "
                "before it: the chat template rewrites earlier turns (e.g. drops past reasoning) "
                "or renders the turn unlike its generation prompt, so the turns cannot be "
                "trained as one sequence")
        # the untrained messages between turns (and the generation prompt) are context
        mask += [0] * (len(prompt) - len(tokens)) + [1] * (len(full) - len(prompt))
        tokens = full
    return tokens, mask


def _render(tokenizer: Any, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None, generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True,
        return_dict=True)
    return list(out["input_ids"])
