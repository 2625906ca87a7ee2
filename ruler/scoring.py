"""Score a group of trajectories with an LLM judge (see the package docstring for the algorithm)."""

from __future__ import annotations

import ipaddress
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import ruler.cache as disk_cache
import ruler.robust as robust
from art_core.trajectory import TrajectoryGroup
from ruler.answer import InvalidAnswer, TrajectoryScore, json_schema_format, parse_answer
from ruler.calls import CallStats, import_litellm
from ruler.prompt import DEFAULT_RUBRIC, Message, build_judge_messages, dedupe

logger = logging.getLogger(__name__)

NEUTRAL_SCORE = 0.5
"""Given to every trajectory when there is nothing to compare (fewer than two distinct ones)."""

# litellm arguments that change how a request travels, not what the judge answers: they are
# left out of the cache key so that, say, a new timeout does not throw the cache away.
_NOT_IN_CACHE_KEY = frozenset(
    {"api_key", "timeout", "num_retries", "max_retries", "metadata", "extra_headers", "client"}
)

FEEDBACK = (
    "Your answer could not be used: {problem}.\n"
    "Answer again with only the JSON object: exactly one entry for each of the ids {ids}, each "
    "with an explanation and a score from 0 to 1."
)


MODES = ("auto", "listwise", *robust.LOGPROB_MODES)
LOCAL_DEFAULT_MODE = "yesno"
"""`mode="auto"` for a local or small judge: the mode that ranked best with the embedded SmolLM2
on `benchmarks/ruler_eval.py --local` (44 groups, mean Spearman: yesno 0.44 and 0.50 in two runs,
pairwise 0.27, digits about 0 with groups failing; listwise JSON failed 4 of 8 groups and ranked at
chance in the issue's earlier run). Hosted judges get `"listwise"`."""


class RulerError(RuntimeError):
    """The judge gave no usable answer: invalid every time, timed out, or refused the request."""


def is_local_judge(judge: str, litellm_kwargs: dict[str, Any]) -> bool:
    """True when the judge runs on this machine (a loopback api_base) or is the embedded SmolLM2."""
    base = litellm_kwargs.get("api_base") or litellm_kwargs.get("base_url")
    host = urlparse(str(base)).hostname if base else None
    if host:
        if host == "localhost":
            return True
        try:
            if ipaddress.ip_address(host).is_loopback:
                return True
        except ValueError:
            pass
    return "smollm" in judge.lower()


def resolve_mode(mode: str, judge: str, litellm_kwargs: dict[str, Any]) -> str:
    """The judging mode to use: `mode` itself, or for "auto" the default for this judge."""
    if mode not in MODES:
        raise ValueError(f"unknown RULER mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode != "auto":
        return mode
    return LOCAL_DEFAULT_MODE if is_local_judge(judge, litellm_kwargs) else "listwise"


@dataclass
class RulerResult:
    """Scores and explanations in the order of the input, and numeric metrics of the call."""

    scores: list[float]
    explanations: list[str]
    metrics: dict[str, float | int] = field(default_factory=dict)
    mode: str = "listwise"


async def _ask_judge(
    judge: str,
    messages: list[Message],
    ids: list[str],
    max_retries: int,
    litellm_kwargs: dict[str, Any],
) -> tuple[dict[str, TrajectoryScore], CallStats]:
    """Send the judge prompt until a valid answer comes back, at most `1 + max_retries` times.

    An invalid answer is shown to the judge with what was wrong; a timeout is simply retried.
    A 400/422 on the response format steps down json_schema -> json_object -> none, without using up
    a retry, because many OpenAI-compatible servers support only some of them.
    """
    litellm = import_litellm()
    import openai  # litellm's exceptions subclass openai's

    formats: list[dict[str, Any] | None] = [json_schema_format(), {"type": "json_object"}, None]
    conversation = messages
    stats = CallStats()
    problems: list[str] = []
    while True:
        request = dict(litellm_kwargs)
        if formats[0] is not None:
            request["response_format"] = formats[0]
        response = None
        started = time.perf_counter()
        try:
            response = await litellm.acompletion(model=judge, messages=conversation, **request)
        except litellm.ContextWindowExceededError as e:
            raise RulerError(
                f"judge {judge}: the prompt does not fit its context window: {e}"
            ) from e
        except (litellm.BadRequestError, litellm.UnprocessableEntityError) as e:
            # 400 (or 422 from some servers): most often the response_format is not supported
            if len(formats) == 1:
                status = getattr(e, "status_code", 400)
                raise RulerError(f"judge {judge} rejected the request (HTTP {status}): {e}") from e
            rejected = formats.pop(0)
            stats.format_fallbacks += 1
            logger.warning(
                "ruler: judge %s rejected response_format %s (%s); retrying with %s",
                judge,
                _format_name(rejected),
                e,
                _format_name(formats[0]),
            )
            continue
        except litellm.Timeout as e:
            problem = f"the request timed out ({e})"
        except openai.APIError as e:
            raise RulerError(f"judge {judge} failed: {type(e).__name__}: {e}") from e
        finally:
            stats.calls += 1
            stats.latency_s += time.perf_counter() - started

        if response is not None:
            stats.add_usage(litellm, response)
            content = response.choices[0].message.content if response.choices else None
            try:
                return parse_answer(content, ids), stats
            except InvalidAnswer as e:
                problem = f"invalid answer: {e}"
                # Show only the latest bad answer: a growing chat would crowd a small context.
                conversation = [
                    *messages,
                    {"role": "assistant", "content": content or ""},
                    {"role": "user", "content": FEEDBACK.format(problem=e, ids=ids)},
                ]

        problems.append(problem)
        if len(problems) > max_retries:
            tries = "; ".join(f"attempt {n}: {p}" for n, p in enumerate(problems, 1))
            raise RulerError(
                f"judge {judge} gave no valid answer in {len(problems)} attempts: {tries}"
            )
        stats.retries += 1
        logger.info(
            "ruler: judge %s, retry %d/%d after: %s", judge, stats.retries, max_retries, problem
        )


def _format_name(response_format: dict[str, Any] | None) -> str:
    return response_format["type"] if response_format else "no response_format"


async def score(
    message_lists: Sequence[Sequence[Message]],
    judge: str,
    rubric: str = DEFAULT_RUBRIC,
    *,
    tools: Sequence[dict[str, Any]] | None = None,
    mode: str = "auto",
    max_retries: int = 3,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    **litellm_kwargs: Any,
) -> RulerResult:
    """Score conversations relative to each other with an LLM judge; scores are in [0, 1].

    `message_lists` are OpenAI-format chats that pursue the same goal; `tools` are the OpenAI
    function schemas the agent was offered. `judge` is any litellm model string, for example
    `"openai/gpt-4o-mini"` or `"openai/<served name>"` with `api_base=` pointing at an
    OpenAI-compatible server; other keyword arguments (api_base, api_key, temperature, timeout,
    num_retries...) go to `litellm.acompletion` unchanged. `max_retries` bounds our own retries
    of invalid answers and timeouts (litellm's own retry count is `num_retries`).

    `mode` is how the judge is asked (see `ruler.robust`): "listwise" (one JSON answer scoring the
    whole group: best with strong hosted judges), "yesno", "digits" or "pairwise" (ratings read
    from token probabilities: no answer can be malformed, better with small judges; they need an
    endpoint that returns logprobs). "auto" picks `LOCAL_DEFAULT_MODE` for a local judge (a
    loopback `api_base`, or SmolLM2) and "listwise" otherwise.

    Identical conversations are judged once and get equal scores. With fewer than two distinct
    ones there is nothing to compare: no judge is called and every score is `NEUTRAL_SCORE`.
    Answers are cached on disk (`cache_dir`, default `$ART_HOME/ruler`) unless `cache=False`.
    Raises `RulerError` when the judge gives no valid answer.
    """
    mode = resolve_mode(mode, judge, litellm_kwargs)
    lists = [list(m) for m in message_lists]
    unique, index = dedupe(lists)
    if len(unique) < 2:
        note = "not judged: the group is empty"
        if lists:
            why = (
                "only one trajectory"
                if len(lists) == 1
                else f"all {len(lists)} trajectories are identical"
            )
            logger.warning(
                "ruler: %s: nothing to compare, so the judge is not called and every score is %s "
                "(relative grounding is lost)",
                why,
                NEUTRAL_SCORE,
            )
            note = f"not judged: {why}, nothing to compare; neutral score {NEUTRAL_SCORE}"
        metrics = {**CallStats().metrics(), "ruler_unique_trajectories": len(unique)}
        return RulerResult([NEUTRAL_SCORE] * len(lists), [note] * len(lists), metrics, mode)

    ids = [str(n) for n in range(1, len(unique) + 1)]
    kwargs_key = {k: v for k, v in litellm_kwargs.items() if k not in _NOT_IN_CACHE_KEY}
    if mode == "listwise":
        messages = build_judge_messages(unique, ids, rubric, tools)
        request: dict[str, Any] = {"messages": messages, "rubric": rubric,
                                   "response_format": json_schema_format()}
    else:
        plan = robust.plan(mode, unique, rubric)
        request = robust.plan_key(plan)
        for k in ("max_tokens", "max_completion_tokens", "temperature"):  # fixed by the mode
            kwargs_key.pop(k, None)
    directory = Path(cache_dir).expanduser() if cache_dir else disk_cache.default_cache_dir()
    key = disk_cache.request_key({"judge": judge, **request, "litellm_kwargs": kwargs_key})
    entry = disk_cache.read(directory, key) if cache else None
    cache_hit = _usable_entry(entry, ids)
    if cache_hit:
        stats = CallStats(cost_usd=0.0)
    else:
        extra: dict[str, float] = {}
        if mode == "listwise":
            answer, stats = await _ask_judge(judge, messages, ids, max_retries, litellm_kwargs)
            scores = [answer[i].score for i in ids]
            explanations = [answer[i].explanation for i in ids]
        else:
            try:
                scores, explanations, stats, mass = await robust.judge_plan(
                    plan, judge, len(unique), max_retries, litellm_kwargs
                )
            except robust.JudgeFailed as e:
                raise RulerError(f"judge {judge} {e}") from e
            extra["ruler_rating_mass"] = mass
        entry = {"judge": judge, "ids": ids, "scores": scores, "explanations": explanations,
                 "metrics": extra}
        if cache:
            try:
                disk_cache.write(directory, key, entry)
            except OSError as e:  # a full or read-only disk must not lose a paid-for judgement
                logger.warning("ruler: could not write the cache entry in %s: %s", directory, e)

    metrics = {
        **stats.metrics(cache_hit),
        "ruler_unique_trajectories": len(unique),
        **entry.get("metrics", {}),
    }
    return RulerResult(
        [entry["scores"][j] for j in index],
        [entry["explanations"][j] for j in index],
        metrics,
        mode,
    )


def _usable_entry(entry: dict[str, Any] | None, ids: list[str]) -> bool:
    """A cache entry answers this request when it covers exactly these ids."""
    return (
        entry is not None
        and entry.get("ids") == ids
        and len(entry.get("scores", ())) == len(ids)
        and len(entry.get("explanations", ())) == len(ids)
    )


def _group_tools(group: TrajectoryGroup) -> list[dict[str, Any]] | None:
    """Every distinct tool schema offered in the group (usually all trajectories share one list)."""
    seen: dict[str, dict[str, Any]] = {}
    for t in group.trajectories:
        for tool in t.tools or []:
            seen.setdefault(json.dumps(tool, sort_keys=True, default=str), tool)
    return list(seen.values()) or None


async def score_group(
    group: TrajectoryGroup,
    judge: str,
    rubric: str = DEFAULT_RUBRIC,
    *,
    swallow_exceptions: bool = False,
    mode: str = "auto",
    max_retries: int = 3,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    **litellm_kwargs: Any,
) -> TrajectoryGroup | None:
    """A copy of `group` with each trajectory's reward set to the judge's score in [0, 1].

    Each trajectory keeps its previous reward in `metrics["independent_reward"]`, gets the score
    in `metrics["ruler_score"]` plus the `ruler_*` call metrics, and the judge's explanation in
    `logs`. The input group is not changed. Only the main conversation (`messages`) is judged.

    Arguments are those of `score`. With `swallow_exceptions=True` a failure is logged as a
    warning and `None` is returned, which tells `gather_trajectory_groups` to drop the group.
    """
    resolve_mode(mode, judge, litellm_kwargs)  # a wrong mode is a bug: never swallowed
    try:
        result = await score(
            [t.messages for t in group.trajectories],
            judge,
            rubric,
            tools=_group_tools(group),
            mode=mode,
            max_retries=max_retries,
            cache=cache,
            cache_dir=cache_dir,
            **litellm_kwargs,
        )
    except Exception as e:
        if not swallow_exceptions:
            raise
        logger.warning("ruler: dropping a group of %d trajectories: %s", len(group), e)
        return None

    scored = group.model_copy(deep=True)
    for t, value, explanation in zip(
        scored.trajectories, result.scores, result.explanations, strict=True
    ):
        if "ruler_score" not in t.metrics:  # scoring twice must not lose the original reward
            t.metrics["independent_reward"] = t.reward
        t.metrics["ruler_score"] = value
        t.metrics.update(result.metrics)
        t.reward = value
        t.logs.append(f"RULER {judge} [{result.mode}]: score {value:.3f}: {explanation}")
    return scored


def hook(
    judge: str, rubric: str = DEFAULT_RUBRIC, **kwargs: Any
) -> Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]]:
    """An `after_each` hook for `gather_trajectory_groups` that scores each group as it completes.

        groups = await gather_trajectory_groups(..., after_each=ruler.hook("openai/o4-mini",
                                                                           swallow_exceptions=True))

    `kwargs` are those of `score_group` (swallow_exceptions, cache, api_base, timeout...).
    """

    async def after_each(group: TrajectoryGroup) -> TrajectoryGroup | None:
        return await score_group(group, judge, rubric, **kwargs)

    return after_each


__all__ = [
    "LOCAL_DEFAULT_MODE",
    "MODES",
    "NEUTRAL_SCORE",
    "RulerError",
    "RulerResult",
    "hook",
    "is_local_judge",
    "resolve_mode",
    "score",
    "score_group",
]
