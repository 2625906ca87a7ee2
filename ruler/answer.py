"""The judge's answer: its JSON schema (sent as structured output) and our own validation.

Structured output is a request, not a guarantee: a server may ignore `response_format` and return
prose, or a small model may repeat an id or invent a score of 1.7. So every answer is parsed and
checked here, and a bad one is described in words that can be fed back to the judge.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator


class TrajectoryScore(BaseModel):
    """One judged trajectory. The explanation comes first so the judge reasons before scoring."""

    model_config = ConfigDict(extra="forbid")

    trajectory_id: str
    explanation: str
    score: float

    @field_validator("trajectory_id", mode="before")
    @classmethod
    def _id_as_text(cls, v: Any) -> Any:
        # Judges often write the id 3 instead of "3"; the meaning is the same.
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class JudgeAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scores: list[TrajectoryScore]


def json_schema_format() -> dict[str, Any]:
    """`response_format` asking for a `JudgeAnswer` (OpenAI structured outputs, also vLLM)."""
    return {
        "type": "json_schema",
        "json_schema": {
            "name": "ruler_scores",
            "schema": JudgeAnswer.model_json_schema(),
            "strict": True,
        },
    }


class InvalidAnswer(ValueError):
    """The judge's answer cannot be used; the message says why, for the judge to read."""


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)


def _extract_json(content: str) -> Any:
    """The JSON value in `content`: bare, inside a ``` code fence, or after a short preamble."""
    fenced = _FENCE.search(content)
    text = (fenced.group(1) if fenced else content).strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        start = text.find("{")
        if start > 0:  # "Here are the scores: {...}" is common from small models
            try:
                return json.JSONDecoder().raw_decode(text[start:])[0]
            except json.JSONDecodeError:
                pass
        raise InvalidAnswer(f"the answer is not a JSON object ({e.msg} at position {e.pos})") from e


def _schema_problems(e: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'answer'}: {err['msg']}" for err in e.errors()
    )


def parse_answer(content: str | None, ids: Sequence[str]) -> dict[str, TrajectoryScore]:
    """Validate the judge's reply against the ids asked for; return the score of each id.

    Raises `InvalidAnswer` listing every problem: not JSON, wrong shape, an id missing, repeated
    or unknown, a score that is not a finite number in [0, 1].
    """
    if content is None or not content.strip():
        raise InvalidAnswer("the answer is empty")
    try:
        answer = JudgeAnswer.model_validate(_extract_json(content))
    except ValidationError as e:
        raise InvalidAnswer(f"the JSON does not match the schema: {_schema_problems(e)}") from e

    problems = []
    expected = set(ids)
    got = [s.trajectory_id for s in answer.scores]
    if len(got) != len(ids):
        problems.append(f"expected {len(ids)} scores, got {len(got)}")
    repeated = sorted({i for i in got if got.count(i) > 1})
    if repeated:
        problems.append(f"ids given more than once: {repeated}")
    unknown = sorted(set(got) - expected)
    if unknown:
        problems.append(f"unknown ids: {unknown}")
    missing = [i for i in ids if i not in got]
    if missing:
        problems.append(f"missing ids: {missing}")
    for s in answer.scores:
        if not math.isfinite(s.score):
            problems.append(f"id {s.trajectory_id}: score {s.score} is not a finite number")
        elif not 0.0 <= s.score <= 1.0:
            problems.append(f"id {s.trajectory_id}: score {s.score} is outside [0, 1]")
    if problems:
        raise InvalidAnswer("; ".join(problems))
    return {s.trajectory_id: s for s in answer.scores}
