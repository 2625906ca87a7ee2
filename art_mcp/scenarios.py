"""Scenarios: the tasks an agent trains on. Load them (JSONL), or have a model write them.

`generate_scenarios(n, tools=..., generator=...)` asks a generator model for `n` diverse,
realistic tasks that the tools can accomplish, each with a difficulty from 1 (one obvious step)
to 5 (several steps, some reasoning). The same function serves AutoRL, which passes a
`description` of what the agent should do instead of (or besides) a tool list. Then:

1. Ask for the number still missing (plus a margin for rejects), as strict JSON
   (`{"scenarios": [{"task", "difficulty"}]}`); prose around a JSON object is tolerated.
2. Validate each item: a task of 3-600 characters, a difficulty that is an integer 1-5, and,
   with tools, a task that shares a term with them (a name, description, parameter or enum
   word): small generators write tasks unrelated to the tools ("translate languages" for a
   library catalogue). Rejects are counted; most rejected as unrelated is warned about.
3. Drop duplicates (same task after lower-casing and dropping punctuation and extra spaces),
   also against `existing` ones, and tell the generator what it already wrote.
4. Repeat until `n` are valid or `max_attempts` requests were made; then `ScenarioError` says
   what was rejected and why (unless `allow_fewer`).

The generator is any of: a litellm model string ("openai/gpt-4.1-mini"; with `api_base` any
OpenAI-compatible endpoint, our gateway included), or an `art_core.Model` (its endpoint is
called with the `openai` client).

`split_scenarios` makes the train / held-out split: duplicates removed first, so no task is in
both.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)


class Scenario(BaseModel):
    """One task. Extra keys (e.g. the expected outcome a reward checks) are kept as given."""

    model_config = ConfigDict(extra="allow")

    id: str
    task: str = Field(min_length=3, max_length=600)
    difficulty: int = Field(3, ge=1, le=5)


class ScenarioError(RuntimeError):
    """The generator did not produce enough valid, distinct scenarios."""


def normalize(task: str) -> str:
    """The key two tasks are duplicates by: lower case, no punctuation, single spaces."""
    return " ".join(re.sub(r"[^\w\s]", " ", task.lower()).split())


def load_scenarios(path: str | Path) -> list[Scenario]:
    """Read a JSONL file of scenarios (`task` required; `id` and `difficulty` optional)."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            data.setdefault("id", f"{Path(path).stem}-{n}")
            out.append(Scenario.model_validate(data))
        except (ValueError, ValidationError) as e:
            raise ValueError(f"{path}:{n}: invalid scenario: {e}") from e
    return out


def save_scenarios(scenarios: Iterable[Scenario], path: str | Path) -> Path:
    """Write scenarios as JSONL (atomically: temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(s.model_dump_json() + "\n" for s in scenarios), encoding="utf-8")
    tmp.replace(path)
    return path


def dedupe(scenarios: Iterable[Scenario]) -> list[Scenario]:
    """The first scenario of each distinct task, in order."""
    seen: set[str] = set()
    out = []
    for s in scenarios:
        key = normalize(s.task)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def split_scenarios(scenarios: Sequence[Scenario], held_out: int | float = 0.25, *,
                    seed: int = 0) -> tuple[list[Scenario], list[Scenario]]:
    """(train, held_out): duplicates dropped, shuffled with `seed`, then cut. `held_out` is a
    count (int) or a fraction (0 < float < 1); both parts keep at least one scenario."""
    unique = dedupe(scenarios)
    if len(unique) < 2:
        raise ValueError(f"need at least 2 distinct scenarios to split, got {len(unique)}")
    k = round(held_out * len(unique)) if isinstance(held_out, float) else int(held_out)
    k = min(max(k, 1), len(unique) - 1)
    order = list(unique)
    random.Random(seed).shuffle(order)
    return order[k:], order[:k]


SYSTEM = (
    "You write tasks for training an AI agent. Each task is one request a real user could "
    "send, concrete and self-contained (names, numbers, what to do), solvable with what the "
    "agent has. Rate each task's difficulty from 1 (one obvious step) to 5 (several steps and "
    "some reasoning). Answer with JSON only."
)


def _prompt(k: int, tools: Sequence[dict[str, Any]] | None, description: str | None,
            seen: Sequence[str], difficulties: Sequence[int] | None) -> str:
    parts = []
    if description:
        parts.append(f"What the agent is for:\n{description}")
    if tools:
        listed = [{"name": t["function"]["name"],
                   "description": t["function"].get("description", ""),
                   "parameters": t["function"].get("parameters", {})}
                  for t in (tools or [])]
        parts.append("The agent's tools:\n" + "\n".join(json.dumps(t) for t in listed))
    levels = ", ".join(map(str, difficulties or range(1, 6)))
    parts.append(f"Write {k} diverse, realistic tasks that these tools can accomplish, with "
                 f"difficulties from {{{levels}}}, mixed. Answer as "
                 '{"scenarios": [{"task": "...", "difficulty": 1}, ...]}.')
    if seen:
        parts.append("Already written (do not repeat or rephrase these):\n"
                     + "\n".join(f"- {t}" for t in seen[-50:]))
    return "\n\n".join(parts)


def _schema(k: int) -> dict[str, Any]:
    item = {"type": "object", "additionalProperties": False, "required": ["task", "difficulty"],
            "properties": {"task": {"type": "string", "maxLength": 600},
                           "difficulty": {"type": "integer", "minimum": 1, "maximum": 5}}}
    return {"type": "object", "additionalProperties": False, "required": ["scenarios"],
            "properties": {"scenarios": {"type": "array", "items": item, "maxItems": k}}}


def parse_items(content: str | None) -> list[Any]:
    """The list of items in a generator's answer: `{"scenarios": [...]}`, a bare list, or
    either inside prose or a code fence. Raises ValueError when there is none."""
    text = (content or "").strip()
    candidates = [text]
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    if fenced:
        candidates.append(fenced.group(1))
    for open_, close in (("{", "}"), ("[", "]")):
        i, j = text.find(open_), text.rfind(close)
        if 0 <= i < j:
            candidates.append(text[i:j + 1])
    for c in candidates:
        try:
            data = json.loads(c)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("scenarios"), list):
            return data["scenarios"]
        if isinstance(data, list):
            return data
    raise ValueError("no JSON list of scenarios in the answer")


_STOP = frozenset((  # noqa: SIM905 - a word list reads better as text
    "a an and any are as at be by can do does for from get give has have how in into is it its "
    "me my new of on or our please some that the their them then this to up use was we what "
    "when which who will with you your all also one two three more most each other than"
).split(" "))
UNRELATED = "shares no term with the tools"


def _stems(text: str) -> set[str]:
    """Crude word stems of `text` for overlap checks: lowercase, stop words dropped, plural 's'
    dropped, cut to 5 letters ("shelves"/"shelf", "items"/"item" meet)."""
    words = re.findall(r"[a-z]+", re.sub(r"([a-z])([A-Z])", r"\1 \2", text).lower())
    return {w.removesuffix("s")[:5] if len(w) > 3 else w for w in words
            if len(w) >= 3 and w not in _STOP}


def tool_terms(tools: Sequence[dict[str, Any]]) -> set[str]:
    """Stems of what the tools are about: names, descriptions, parameter names and enums."""
    terms: set[str] = set()

    def walk(schema: Any) -> None:
        if isinstance(schema, dict):
            for k, v in (schema.get("properties") or {}).items():
                terms.update(_stems(str(k)))
                walk(v)
            for v in schema.get("enum") or []:
                terms.update(_stems(str(v)))
            for key in ("items", "anyOf", "oneOf", "allOf"):
                walk(schema.get(key))
        elif isinstance(schema, list):
            for s in schema:
                walk(s)

    for t in tools:
        fn = t.get("function") or {}
        terms.update(_stems(fn.get("name", "").replace("_", " ")))
        terms.update(_stems(fn.get("description") or ""))
        walk(fn.get("parameters"))
    return terms


def _validate(item: Any) -> tuple[dict[str, Any] | None, str]:
    """(clean item, "") or (None, why it was rejected)."""
    if not isinstance(item, dict):
        return None, "not an object"
    task, difficulty = item.get("task"), item.get("difficulty")
    if not isinstance(task, str) or not 3 <= len(task.strip()) <= 600:
        return None, "task missing or not 3-600 characters"
    if len(task.split()) < 3:
        return None, "task under 3 words"
    if isinstance(difficulty, str) and difficulty.strip().isdigit():
        difficulty = int(difficulty)
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 1 <= difficulty <= 5:
        return None, "difficulty not an integer 1-5"
    return {"task": " ".join(task.split()), "difficulty": difficulty}, ""


async def ask_json(generator: Any, messages: list[dict[str, str]], name: str,
                   schema: dict[str, Any], *, max_tokens: int, api_base: str | None = None,
                   api_key: str | None = None, temperature: float = 1.0,
                   timeout: float = 300.0) -> str:
    """The text of one answer of `generator` (a litellm model string or an `art_core.Model`),
    asked for strict JSON of `schema`. The caller parses and validates it."""
    response_format = {"type": "json_schema", "json_schema": {
        "name": name, "strict": True, "schema": schema}}
    if isinstance(generator, str):
        import os

        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
        import litellm

        r = await litellm.acompletion(model=generator, messages=messages, api_base=api_base,
                                      api_key=api_key, temperature=temperature,
                                      response_format=response_format, timeout=timeout)
    else:
        client = generator.openai_client(timeout=timeout)
        try:
            r = await client.chat.completions.create(
                model=generator.name, messages=messages, temperature=temperature,
                response_format=response_format, max_tokens=max_tokens)
        finally:
            await client.close()
    return r.choices[0].message.content or ""


async def _ask(generator: Any, messages: list[dict[str, str]], k: int, api_base: str | None,
               api_key: str | None, temperature: float, timeout: float) -> str:
    return await ask_json(generator, messages, "scenarios", _schema(k),
                          max_tokens=max(256, 120 * k), api_base=api_base, api_key=api_key,
                          temperature=temperature, timeout=timeout)


async def generate_scenarios(
    n: int, *, tools: Sequence[dict[str, Any]] | None = None, description: str | None = None,
    generator: Any, api_base: str | None = None, api_key: str | None = None,
    existing: Sequence[Scenario] = (), max_attempts: int = 4, batch_size: int = 20,
    temperature: float = 1.0, timeout: float = 300.0, allow_fewer: bool = False,
    difficulties: Sequence[int] | None = None, id_prefix: str = "gen",
    out: str | Path | None = None,
) -> list[Scenario]:
    """`n` valid, distinct scenarios from a generator model (see the module docstring).

    `tools` are OpenAI function tools (e.g. `await session.openai_tools()`); `description` says
    what the agent is for (AutoRL). At least one is needed. `existing` scenarios count as
    already written (no duplicates of them are returned). `out`: JSONL file to save to."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not tools and not description:
        raise ValueError("give tools, a description, or both: the generator needs to know "
                         "what the agent can do")
    # a task that neither the tools nor the description are about is rejected
    terms = tool_terms(tools) | _stems(description or "") if tools else set()
    seen = {normalize(s.task) for s in existing}
    written = [s.task for s in existing]
    accepted: list[dict[str, Any]] = []
    rejected: Counter[str] = Counter()
    for attempt in range(1, max_attempts + 1):
        missing = n - len(accepted)
        if missing <= 0:
            break
        k = min(batch_size, missing + max(1, missing // 4))  # a margin for rejects
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": _prompt(k, tools, description, written,
                                                        difficulties)}]
        try:
            content = await _ask(generator, messages, k, api_base, api_key, temperature, timeout)
            items = parse_items(content)
        except ValueError as e:
            rejected[f"unusable answer ({e})"] += 1
            continue
        for item in items:
            clean, why = _validate(item)
            if clean is None:
                rejected[why] += 1
            elif difficulties and clean["difficulty"] not in difficulties:
                rejected["difficulty not asked for"] += 1
            elif terms and not _stems(clean["task"]) & terms:
                rejected[UNRELATED] += 1
            elif normalize(clean["task"]) in seen:
                rejected["duplicate"] += 1
            elif len(accepted) < n:
                seen.add(normalize(clean["task"]))
                written.append(clean["task"])
                accepted.append(clean)
        log.info("scenario generation attempt %d: %d/%d valid", attempt, len(accepted), n)
    if rejected[UNRELATED] > len(accepted):
        log.warning("most tasks the generator wrote (%d of %d) share no term with the tools "
                    "and were rejected: the generator may not understand the tools; try a "
                    "stronger --generator or write scenarios", rejected[UNRELATED],
                    rejected[UNRELATED] + len(accepted))
    if len(accepted) < n and not allow_fewer:
        reasons = ", ".join(f"{why}: {c}" for why, c in rejected.most_common()) or "none"
        raise ScenarioError(f"the generator gave {len(accepted)} valid distinct scenarios of {n} "
                            f"in {max_attempts} attempts; rejected: {reasons}")
    scenarios = [Scenario(id=f"{id_prefix}-{i + 1:04d}", **item) for i, item in enumerate(accepted)]
    if out is not None:
        save_scenarios(scenarios, out)
    return scenarios
