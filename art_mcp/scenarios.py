"""Scenarios: the tasks an agent trains on. Load them (JSONL), or have a model write them.

`generate_scenarios(n, tools=..., generator=...)` asks a generator model for `n` diverse,
realistic tasks that the tools can accomplish, each with a difficulty from 1 (one obvious step)
to 5 (several steps, some reasoning). The same function serves AutoRL, which passes a
`description` of what the agent should do instead of (or besides) a tool list. Then:

1. Ask for the number still missing (plus a margin for rejects), as strict JSON
   (`{"scenarios": [{"task", "difficulty"}]}`); prose around a JSON object is tolerated. An
   attempt's ask is split into requests of `MIN_PER_REQUEST` (6) to `batch_size` tasks, up to
   `concurrency` (4) in flight: a local engine batches them (the embedded 135M model writes
   ~12 tokens/s for one request, several times that for four), an API answers them in
   parallel. Not fewer than 6 a request: within one answer the model sees what it already
   wrote and avoids repeats; concurrent requests cannot see each other.
2. Validate each item: a task of 3-600 characters, a difficulty that is an integer 1-5, and,
   with tools, a task that shares a term with them (a name, description, parameter or enum
   word): small generators write tasks unrelated to the tools ("translate languages" for a
   library catalogue). Rejects are counted; most rejected as unrelated is warned about.
3. Drop duplicates (same task after lower-casing and dropping punctuation and extra spaces),
   also against `existing` ones, and tell the generator what it already wrote.
4. Repeat until `n` are valid or `max_attempts` attempts were made. A progress bar (tqdm, on
   stderr) counts the valid scenarios of `n` as each request's answer arrives.
5. Stop early, after the first attempt, when at least one of its answers was JSON (the
   generator did write; prose or a refusal only is retried), under a quarter of `n` were
   valid, and at that yield `max_attempts` attempts would not reach `n` (valid x max_attempts
   < n): a generator that cannot write tasks for these tools (the 135M model on a server it
   does not know: 0 of 16, measured) fails in one attempt, not four. Not with `allow_fewer`,
   whose caller takes what comes.
6. Too few: `ScenarioError`, one line: valid of asked, the main rejections, the way out
   (`--scenarios FILE` written by hand, or a stronger `--generator MODEL`).

The generator is any of: a litellm model string ("openai/gpt-4.1-mini"; with `api_base` any
OpenAI-compatible endpoint, our gateway included), or an `art_core.Model` (its endpoint is
called with the `openai` client).

`split_scenarios` makes the train / held-out split: duplicates removed first, so no task is in
both.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
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
    """Read a JSONL file of scenarios (`task` required; `id` and `difficulty` optional). A
    ValueError names the file, the line and what is wrong, in one line."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            if not isinstance(data, dict):
                raise ValueError(f"expected a JSON object, got {type(data).__name__}")
            out.append(Scenario.model_validate({"id": f"{Path(path).stem}-{n}", **data}))
        except ValidationError as e:  # pydantic's text spans lines: one "field: problem" each
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                 for err in e.errors())
            raise ValueError(f"{path}:{n}: invalid scenario: {problems}") from e
        except ValueError as e:
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
        from ruler.calls import import_litellm  # no network at import, no banners on errors

        litellm = import_litellm()
        r = await litellm.acompletion(model=generator, messages=messages, api_base=api_base,
                                      api_key=api_key, temperature=temperature,
                                      response_format=response_format, timeout=timeout)
    else:
        # not closed after: the model's client is shared (one per event loop), also by the
        # other requests of this attempt still in flight
        client = generator.openai_client(timeout=timeout)
        r = await client.chat.completions.create(
            model=generator.name, messages=messages, temperature=temperature,
            response_format=response_format, max_tokens=max_tokens)
    return r.choices[0].message.content or ""


async def _ask(generator: Any, messages: list[dict[str, str]], k: int, api_base: str | None,
               api_key: str | None, temperature: float, timeout: float) -> str:
    return await ask_json(generator, messages, "scenarios", _schema(k),
                          max_tokens=max(256, 120 * k), api_base=api_base, api_key=api_key,
                          temperature=temperature, timeout=timeout)


MIN_PER_REQUEST = 6
"""Fewest tasks one request asks for (module docstring, 1)."""

WAY_OUT = ('write the tasks yourself (--scenarios FILE: JSONL, one {"task": "...", '
           '"difficulty": 1-5} a line) or use a stronger --generator MODEL '
           "(e.g. openai/gpt-4.1-mini)")
"""What the user can do when the generator cannot write the scenarios (`art mcp-train`'s
options: the message is read there)."""


def request_sizes(k: int, batch_size: int, concurrency: int) -> list[int]:
    """Tasks asked by each request of one attempt, `k` in all: at least `MIN_PER_REQUEST` and
    at most `batch_size` each, as many requests as `concurrency` allows within those bounds."""
    requests = max(math.ceil(k / batch_size), min(concurrency, max(1, k // MIN_PER_REQUEST)))
    return [k // requests + (i < k % requests) for i in range(requests)]


def too_few_message(valid: int, n: int, attempts: int, max_attempts: int, stopped_early: bool,
                    rejected: Counter[str]) -> str:
    """The one line of a `ScenarioError`: valid of asked, the main rejections, the way out."""
    top = rejected.most_common(3)
    reasons = ", ".join(f"{why}: {count}" for why, count in top) or "none"
    if len(rejected) > len(top):
        reasons += f", other: {sum(rejected.values()) - sum(c for _, c in top)}"
    early = (f" (stopped early: at that rate {max_attempts} attempts would not reach {n})"
             if stopped_early else "")
    unrelated = ("; the generator does not seem to understand these tools"
                 if rejected[UNRELATED] > valid else "")
    return (f"the generator gave {valid} valid distinct scenarios of {n} in {attempts} "
            f"attempt{'s' * (attempts != 1)}{early}; rejected: {reasons}{unrelated}; {WAY_OUT}")


async def generate_scenarios(
    n: int, *, tools: Sequence[dict[str, Any]] | None = None, description: str | None = None,
    generator: Any, api_base: str | None = None, api_key: str | None = None,
    existing: Sequence[Scenario] = (), max_attempts: int = 4, batch_size: int = 20,
    concurrency: int = 4, temperature: float = 1.0, timeout: float = 300.0,
    allow_fewer: bool = False, difficulties: Sequence[int] | None = None, id_prefix: str = "gen",
    out: str | Path | None = None, show_progress: bool = True,
) -> list[Scenario]:
    """`n` valid, distinct scenarios from a generator model (see the module docstring).

    `tools` are OpenAI function tools (e.g. `await session.openai_tools()`); `description` says
    what the agent is for (AutoRL). At least one is needed. `existing` scenarios count as
    already written (no duplicates of them are returned). `batch_size`: most tasks one request
    asks for; `concurrency`: most requests in flight at once. `out`: JSONL file to save to.
    `show_progress`: the progress bar on stderr."""
    from tqdm.auto import tqdm  # here, not at module level: keeps `import art_mcp` lean

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if min(concurrency, batch_size) < 1:
        raise ValueError(f"concurrency and batch_size must be >= 1: {concurrency}, {batch_size}")
    if not tools and not description:
        raise ValueError("give tools, a description, or both: the generator needs to know "
                         "what the agent can do")
    # a task that neither the tools nor the description are about is rejected
    terms = tool_terms(tools) | _stems(description or "") if tools else set()
    seen = {normalize(s.task) for s in existing}
    written = [s.task for s in existing]
    accepted: list[dict[str, Any]] = []
    rejected: Counter[str] = Counter()
    slots = asyncio.Semaphore(concurrency)

    async def answer(k: int, prompt: str) -> tuple[list[Any], str]:
        """(items, "") or ([], why the answer is unusable); a failed request raises."""
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
        async with slots:
            try:
                content = await _ask(generator, messages, k, api_base, api_key, temperature,
                                     timeout)
                return parse_items(content), ""
            except ValueError as e:
                return [], f"unusable answer ({' '.join(str(e).split())})"

    def take(items: list[Any]) -> None:
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

    # mininterval=0: a few updates in all (one per answer), each worth showing
    bar = tqdm(total=n, desc="scenarios", unit="scenario", disable=not show_progress,
               mininterval=0)
    attempts, wrote, stopped_early = 0, False, False
    try:
        for attempt in range(1, max_attempts + 1):
            missing = n - len(accepted)
            if missing <= 0:
                break
            attempts = attempt
            k = missing + max(1, missing // 4)  # a margin for rejects
            # every request of the attempt is told the same "already written": they run at once
            pending = [asyncio.ensure_future(answer(size, _prompt(size, tools, description,
                                                                  written, difficulties)))
                       for size in request_sizes(k, batch_size, concurrency)]
            try:
                for next_answer in asyncio.as_completed(pending):
                    items, problem = await next_answer
                    if problem:
                        rejected[problem] += 1
                    wrote = wrote or not problem
                    take(items)
                    bar.update(len(accepted) - bar.n)
                    bar.set_postfix(attempt=f"{attempt}/{max_attempts}",
                                    rejected=sum(rejected.values()))
            finally:  # a failed request (unreachable generator) ends the others
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            log.info("scenario generation attempt %d: %d/%d valid", attempt, len(accepted), n)
            if (attempt == 1 and wrote and not allow_fewer and len(accepted) < n / 4
                    and len(accepted) * max_attempts < n):
                stopped_early = True  # module docstring, 5
                break
    finally:
        bar.close()
    if len(accepted) < n and not allow_fewer:
        raise ScenarioError(too_few_message(len(accepted), n, attempts, max_attempts,
                                            stopped_early, rejected))
    if rejected[UNRELATED] > len(accepted):
        log.warning("most tasks the generator wrote (%d of %d) share no term with the tools "
                    "and were rejected: the generator may not understand the tools; try a "
                    "stronger --generator or write scenarios", rejected[UNRELATED],
                    rejected[UNRELATED] + len(accepted))
    scenarios = [Scenario(id=f"{id_prefix}-{i + 1:04d}", **item) for i, item in enumerate(accepted)]
    if out is not None:
        save_scenarios(scenarios, out)
    return scenarios
