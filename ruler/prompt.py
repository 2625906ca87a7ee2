"""What RULER shows the judge: shared context once, then each distinct trajectory under its id.

Trajectories of one group usually start with the same messages (system prompt, task). Those are
the longest common prefix; sending them once keeps the prompt short and makes the differences
between trajectories easy to see. Identical trajectories are sent once (see `dedupe`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]

DEFAULT_RUBRIC = """\
- A trajectory that achieves its goal should always score significantly higher than one that \
does not.
- A trajectory that achieves its goal more efficiently (for example, with fewer unnecessary \
steps or tool calls) should score higher than one that achieves it less efficiently.
- If no trajectory fully achieves the goal, score the ones that make more progress toward it \
higher.
- Keep score differences proportional to differences in quality: trajectories of similar \
quality get similar scores, and a much better trajectory gets a much higher score."""

SYSTEM_PROMPT = """\
You are a careful judge. You compare several attempts (trajectories) by an AI agent at the same \
task. Every trajectory starts from the same shared context and has the same goal; infer the goal \
from that context. Give each trajectory a score from 0 to 1. The scores are relative: compare the \
trajectories with each other, and follow the rubric.

Rubric:
{rubric}

Answer with only a JSON object of this form, with one entry for each trajectory id, each id \
exactly once, the explanation first (one or two sentences), then the score:
{{"scores": [{{"trajectory_id": "1", "explanation": "...", "score": 0.5}}, ...]}}"""


def common_prefix_length(message_lists: Sequence[Sequence[Message]]) -> int:
    """Number of leading messages that every list has, equal in every field."""
    if not message_lists:
        return 0
    n = 0
    for column in zip(*message_lists, strict=False):
        if any(m != column[0] for m in column[1:]):
            break
        n += 1
    return n


def dedupe(
    message_lists: Sequence[Sequence[Message]],
) -> tuple[list[Sequence[Message]], list[int]]:
    """Distinct message lists (first occurrence order), and for each input its distinct index.

    Identical trajectories would get the same judgement anyway; asking twice costs tokens and
    lets the judge give two copies different scores.
    """
    unique: list[Sequence[Message]] = []
    index_of: dict[str, int] = {}
    mapping = []
    for messages in message_lists:
        key = json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str)
        if key not in index_of:
            index_of[key] = len(unique)
            unique.append(messages)
        mapping.append(index_of[key])
    return unique, mapping


def _render(messages: Sequence[Message]) -> str:
    """One compact JSON object per line: the exact messages, readable and cheap in tokens."""
    if not messages:
        return "(no messages)"
    return "\n".join(json.dumps(m, ensure_ascii=False, default=str) for m in messages)


def build_judge_messages(
    message_lists: Sequence[Sequence[Message]],
    ids: Sequence[str],
    rubric: str,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[Message]:
    """The judge's chat: the instructions and rubric as system prompt, the data as user message.

    `message_lists` should already be distinct (see `dedupe`); `ids[i]` names `message_lists[i]`.
    """
    shared = common_prefix_length(message_lists)
    parts = [
        "Shared context (the same for every trajectory):",
        "<context>",
        _render(message_lists[0][:shared] if message_lists else []),
        "</context>",
    ]
    if tools:
        parts += ["", "Tools the agent could call:", "<tools>", _render(tools), "</tools>"]
    parts += ["", "Trajectories (what each one did after the shared context):"]
    for trajectory_id, messages in zip(ids, message_lists, strict=True):
        parts += [f'<trajectory id="{trajectory_id}">', _render(messages[shared:]), "</trajectory>"]
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric.strip())},
        {"role": "user", "content": "\n".join(parts)},
    ]
