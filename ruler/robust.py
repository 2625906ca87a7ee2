"""RULER modes for small and local judges: no free-form JSON, ratings read from token probabilities.

A 135M judge asked for a JSON list of scores writes invalid JSON, scores of 1.5 or the wrong number
of entries half the time, and ranks at chance when it does answer. Asked one short question at a
time and read through its token probabilities, the same model ranks answers better (see
`benchmarks/ruler_eval.py`) and can never give a malformed answer. Three such modes (see
`ruler.logprobs` for how a rating is read):

- `yesno`: one request per distinct trajectory, "Question: ... Answer: ... Is this answer
  correct? Reply Yes or No."; score = P(Yes) / (P(Yes) + P(No)).
- `digits`: one request per trajectory, a rating 0-9; score = expected digit / 9.
- `pairwise`: one request per ordered pair, "Which answer is better? Reply A or B."; both orders
  are asked, which cancels the judge's position bias; score = the soft round-robin win rate
  (the mean P(win) over the 2(n-1) comparisons a trajectory takes part in), in [0, 1].

Every request asks for one token with `logprobs=True, top_logprobs=20` (OpenAI's maximum; vLLM and
our gateway support it). A judge that returns no logprobs is an error (`RulerError` saying so),
never a silent neutral score. The prompts show the user's request (not the system prompt) and a
plain-text transcript of what each trajectory did (tool calls and results included).

Measured with SmolLM2-135M on `benchmarks/ruler_eval.py` (44 groups): worked examples before the
prompt (few-shot) made `yesno` much worse (mean Spearman 0.18 against 0.50 without), so the
prompts are zero-shot. In the same runs `digits` ranked at chance and, on 2 of 44 groups, put
no top-20 probability on any digit (an error); `pairwise` ranked at 0.27 with 5x the requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ruler.calls import CallStats, import_litellm
from ruler.logprobs import (
    NoLogprobs,
    NoRatingToken,
    a_preference,
    expected_digit,
    first_token_candidates,
    yes_probability,
)
from ruler.prompt import DEFAULT_RUBRIC, Message, common_prefix_length

logger = logging.getLogger(__name__)

LOGPROB_MODES = ("yesno", "digits", "pairwise")
TOP_LOGPROBS = 20  # OpenAI's maximum; enough that both labels are listed for any sane judge
CONCURRENT_REQUESTS = 8  # per group; a vLLM server batches them

QUESTIONS = {
    "yesno": "Is this answer correct? Reply Yes or No.",
    "digits": "Rate this answer from 0 (wrong or off-topic) to 9 (fully correct). Reply with one digit.",
    "pairwise": "Which answer is better? Reply A or B.",
}
# Sampling settings of every request: one token, its top candidates; the rest is what we read.
_FIXED = {"max_tokens": 1, "logprobs": True, "top_logprobs": TOP_LOGPROBS, "temperature": 0.0}
_DROPPED = ("max_completion_tokens", "response_format", "n", "stream")


def _text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a multi-part content list."""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict)).strip()
    return "" if content is None else str(content)


def _lines(messages: Sequence[Message]) -> list[str]:
    lines = []
    for m in messages:
        role, text = m.get("role"), _text(m.get("content"))
        if role == "assistant":
            if text:
                lines.append(f"Assistant: {text}")
            for call in m.get("tool_calls") or []:
                fn = call.get("function", {})
                lines.append(f"Assistant calls {fn.get('name')}({fn.get('arguments', '')})")
        elif role == "tool":
            lines.append(f"Tool result: {text}")
        elif role != "system":
            lines.append(f"{str(role).capitalize()}: {text}")
    return lines


def render_task(shared: Sequence[Message]) -> str:
    """The shared context as the question: the user's message alone, else a short transcript."""
    visible = [m for m in shared if m.get("role") != "system"]
    if len(visible) == 1 and visible[0].get("role") == "user":
        return _text(visible[0].get("content"))
    if not visible:  # all of the task is in the system prompt
        return " ".join(_text(m.get("content")) for m in shared) or "(none)"
    return "\n".join(_lines(visible))


def render_answer(messages: Sequence[Message]) -> str:
    """One trajectory after the shared context: a lone reply as itself, else a transcript."""
    if len(messages) == 1 and messages[0].get("role") == "assistant" and not messages[0].get(
        "tool_calls"
    ):
        return _text(messages[0].get("content"))
    return "\n".join(_lines(messages)) if messages else "(nothing)"


def _field(label: str, text: str) -> str:
    """`label: text`, or the label on its own line above a multi-line text (a transcript)."""
    return f"{label}:\n{text}" if "\n" in text else f"{label}: {text}"


def _criteria(rubric: str) -> str:
    # The listwise rubric talks about comparing trajectories: not shown to a one-answer prompt.
    return "" if rubric.strip() == DEFAULT_RUBRIC.strip() else f"Criteria: {rubric.strip()}\n"


def _text_of(mode: str, task: str, answer: str | tuple[str, str], criteria: str = "") -> str:
    head = f"{criteria}{_field('Question', task)}\n"
    if isinstance(answer, tuple):
        return (f"{head}\n{_field('Answer A', answer[0])}\n\n{_field('Answer B', answer[1])}\n\n"
                f"{QUESTIONS[mode]}")
    return f"{head}{_field('Answer', answer)}\n{QUESTIONS[mode]}"


@dataclass
class Plan:
    """The requests of one group in a logprob mode; `pairs[k]` = (A, B) indices of request k."""

    mode: str
    requests: list[list[Message]]
    pairs: list[tuple[int, int]]


def plan(mode: str, message_lists: Sequence[Sequence[Message]], rubric: str) -> Plan:
    """The judge requests for distinct trajectories `message_lists` in `mode`."""
    shared = common_prefix_length(message_lists)
    task = render_task(message_lists[0][:shared])
    answers = [render_answer(m[shared:]) for m in message_lists]
    criteria = _criteria(rubric)
    if mode == "pairwise":
        pairs = [(i, j) for i in range(len(answers)) for j in range(len(answers)) if i != j]
        texts = [_text_of(mode, task, (answers[i], answers[j]), criteria) for i, j in pairs]
    else:
        pairs = []
        texts = [_text_of(mode, task, a, criteria) for a in answers]
    return Plan(mode, [[{"role": "user", "content": t}] for t in texts], pairs)


class JudgeFailed(ValueError):
    """A request gave no rating; `RulerError` is raised by the caller with this message."""


async def _candidates(
    judge: str, mode: str, messages: list[Message], max_retries: int, request: dict[str, Any],
    stats: CallStats,
) -> list[tuple[str, float]]:
    """The top candidates for the judge's one token.

    Timeouts, dropped connections and 5xx answers are retried (at most `max_retries` times);
    a rejected request or a response without logprobs is fatal at once: asking again would not
    change it.
    """
    litellm = import_litellm()
    import openai  # litellm's exceptions subclass openai's

    problems: list[str] = []
    while True:
        started = time.perf_counter()
        try:
            response = await litellm.acompletion(model=judge, messages=messages, **request)
        except (litellm.Timeout, litellm.APIConnectionError, litellm.ServiceUnavailableError,
                litellm.InternalServerError) as e:
            # transient: a busy local server drops connections or times out; ask again
            problems.append(f"{type(e).__name__}: {e}")
            if len(problems) > max_retries:
                raise JudgeFailed(
                    f"gave no answer in {len(problems)} attempts: {'; '.join(problems)}"
                ) from e
            stats.retries += 1
            continue
        except (litellm.BadRequestError, litellm.UnprocessableEntityError) as e:
            raise JudgeFailed(
                f"rejected the request (HTTP {getattr(e, 'status_code', 400)}): {e}; mode "
                f"'{mode}' asks for logprobs with top_logprobs={TOP_LOGPROBS}, a judge that does "
                "not support them needs mode='listwise'"
            ) from e
        except openai.APIError as e:
            raise JudgeFailed(f"failed: {type(e).__name__}: {e}") from e
        finally:
            stats.calls += 1
            stats.latency_s += time.perf_counter() - started
        stats.add_usage(litellm, response)
        try:
            return first_token_candidates(response)
        except NoLogprobs as e:
            raise JudgeFailed(
                f"returned no logprobs ({e}): mode '{mode}' reads ratings from token "
                "probabilities and needs an OpenAI-compatible endpoint that returns "
                "logprobs/top_logprobs (vLLM, our gateway, OpenAI); use mode='listwise' for "
                "this judge"
            ) from e


async def judge_plan(
    p: Plan, judge: str, n: int, max_retries: int, litellm_kwargs: dict[str, Any]
) -> tuple[list[float], list[str], CallStats, float]:
    """Scores and explanations of the `n` trajectories, the call stats and the mean rating mass.

    Raises `JudgeFailed` with a message for `RulerError` when any request gives no rating.
    """
    request = {k: v for k, v in litellm_kwargs.items() if k not in _DROPPED} | _FIXED
    stats = CallStats()
    slots = asyncio.Semaphore(CONCURRENT_REQUESTS)

    async def one(messages: list[Message]) -> list[tuple[str, float]]:
        async with slots:
            return await _candidates(judge, p.mode, messages, max_retries, request, stats)

    outcomes = await asyncio.gather(*(one(m) for m in p.requests), return_exceptions=True)
    for outcome in outcomes:  # the first failure in request order, so errors are reproducible
        if isinstance(outcome, BaseException):
            raise outcome
    read = {"yesno": yes_probability, "digits": expected_digit, "pairwise": a_preference}[p.mode]
    try:
        ratings = [read(candidates) for candidates in outcomes]  # type: ignore[arg-type]
    except NoRatingToken as e:
        raise JudgeFailed(f"gave no rating in mode '{p.mode}': {e}") from e
    mass = sum(m for _, m in ratings) / len(ratings)

    if p.mode == "yesno":
        scores = [r for r, _ in ratings]
        notes = [f"P(Yes) = {s:.3f}" for s in scores]
    elif p.mode == "digits":
        scores = [r / 9 for r, _ in ratings]
        notes = [f"expected rating {r:.2f} of 9" for r, _ in ratings]
    else:
        wins = [0.0] * n
        for (a, b), (p_a, _) in zip(p.pairs, ratings, strict=True):
            wins[a] += p_a
            wins[b] += 1.0 - p_a
        games = 2 * (n - 1)
        scores = [w / games for w in wins]
        notes = [f"won {w:.2f} of {games} pairwise comparisons (both orders)" for w in wins]
    logger.debug("ruler %s: scores %s, rating mass %.3f", p.mode, scores, mass)
    return scores, [f"{p.mode}: {note}" for note in notes], stats, mass


def plan_key(p: Plan) -> dict[str, Any]:
    """What identifies the judgement of a plan (for the disk cache)."""
    return {"mode": p.mode, "requests": json.loads(json.dumps(p.requests)), **_FIXED}
