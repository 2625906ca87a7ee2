"""RULER's logprob modes (yesno, digits, pairwise) against the scripted server, through litellm.

The server answers each one-token request with top logprobs chosen per prompt, so every score is
known exactly. Also: a judge with no logprobs fails loudly, `mode="auto"` picks the documented
default, and the score_group contract (rewards in [0, 1], metrics, cache, swallow) holds.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest

import ruler
from art_core.trajectory import Trajectory, TrajectoryGroup
from ruler.scoring import resolve_mode
from ruler.testing import Reply, ScriptedJudge

SYSTEM = {"role": "system", "content": "Answer the question."}
TASK = {"role": "user", "content": "What is the capital of France?"}
ANSWERS = ["Paris.", "It is Lyon.", "I like turtles."]  # best to worst
STRENGTH = {a: 2 - k for k, a in enumerate(ANSWERS)}
LISTS = [[SYSTEM, TASK, {"role": "assistant", "content": a}] for a in ANSWERS]

# Per answer: the candidates of the judge's one token (token -> probability).
YESNO = {
    "Paris.": {"Yes": 0.6, "No": 0.2, "The": 0.2},  # 0.6 / 0.8
    "It is Lyon.": {"Yes": 0.1, " yes": 0.05, "No": 0.3, " NO": 0.15},  # 0.15 / 0.6
    "I like turtles.": {"No": 0.5, "The": 0.01},  # Yes unlisted: at most 0.01 -> 0.01 / 0.51
}
DIGITS = {
    "Paris.": {"9": 0.5, "8": 0.3, "x": 0.2},  # (4.5 + 2.4) / 0.8 = 8.625 of 9
    "It is Lyon.": {"2": 1.0},
    "I like turtles.": {"0": 0.5, " 1": 0.5},
}
EXPECTED = {
    "yesno": [0.75, 0.25, 0.01 / 0.51],
    "digits": [8.625 / 9, 2 / 9, 0.5 / 9],
    # P(A) = 0.9 when A is better, 0.5 when worse (the judge favours position A by 0.2). Per
    # pair the better one wins 0.9 + 0.5 = 1.4 of 2 comparisons, the worse 0.6; 4 comparisons each.
    "pairwise": [2.8 / 4, 2.0 / 4, 1.2 / 4],
}
MASS = {"yesno": (0.8 + 0.6 + 0.5) / 3, "digits": (0.8 + 1 + 1) / 3, "pairwise": 1.0}


def _log(probs: dict[str, float]) -> dict[str, float]:
    return {t: math.log(p) for t, p in probs.items()}


def judge_responder(body: dict[str, Any]) -> Reply:
    """An idealized judge for all three modes, keyed on the answer(s) in the prompt."""
    text = body["messages"][-1]["content"]
    if "Reply A or B." in text:
        a = next(x for x in ANSWERS if f"Answer A: {x}\n" in text)
        b = next(x for x in ANSWERS if f"Answer B: {x}\n" in text)
        p_a = 0.9 if STRENGTH[a] > STRENGTH[b] else 0.5
        return Reply(top_logprobs=_log({"A": p_a, "B": 1 - p_a}))
    answer = next(x for x in ANSWERS if f"Answer: {x}\n" in text)
    table = DIGITS if "one digit" in text else YESNO
    return Reply(top_logprobs=_log(table[answer]))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_HOME", str(tmp_path / "art_home"))


def judge_args(server: ScriptedJudge, **overrides: Any) -> dict[str, Any]:
    args = {"judge": "openai/judge", "api_base": server.api_base, "api_key": "x",
            "num_retries": 0, "cache": False, "timeout": 10}
    return {**args, **overrides}


N_REQUESTS = {"yesno": 3, "digits": 3, "pairwise": 6}


@pytest.mark.parametrize("mode", ["yesno", "digits", "pairwise"])
async def test_logprob_mode_exact_scores(mode: str) -> None:
    with ScriptedJudge(judge_responder) as server:
        result = await ruler.score(LISTS, mode=mode, max_tokens=400, **judge_args(server))
    assert result.mode == mode
    assert result.scores == pytest.approx(EXPECTED[mode], abs=1e-12)
    assert all(e.startswith(f"{mode}: ") for e in result.explanations)
    assert result.metrics["ruler_judge_calls"] == N_REQUESTS[mode] == len(server.requests)
    assert result.metrics["ruler_rating_mass"] == pytest.approx(MASS[mode])
    for request in server.requests:  # one token and its top candidates; the user's max_tokens
        assert request["max_tokens"] == 1 and request["logprobs"] is True  # is overridden
        assert request["top_logprobs"] == 20 and request["temperature"] == 0.0
        assert "response_format" not in request
        assert [m["role"] for m in request["messages"]] == ["user"]


async def test_yesno_prompt_wording() -> None:
    with ScriptedJudge(judge_responder) as server:
        await ruler.score(LISTS, mode="yesno", **judge_args(server))
    prompts = sorted(r["messages"][-1]["content"] for r in server.requests)
    assert prompts[0] == (
        "Question: What is the capital of France?\nAnswer: I like turtles.\n"
        "Is this answer correct? Reply Yes or No."
    )


async def test_tool_trajectory_is_rendered_as_a_transcript() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    base = [SYSTEM, {"role": "user", "content": "Weather in Oslo?"}]
    lists = [
        [*base, {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", "tool_call_id": "c1", "content": "-3 C, snow"},
         {"role": "assistant", "content": "Paris."}],
        [*base, {"role": "assistant", "content": "I like turtles."}],
    ]
    with ScriptedJudge(lambda body: Reply(top_logprobs={"Yes": 0.0})) as server:
        await ruler.score(lists, mode="yesno", **judge_args(server))
    prompts = [r["messages"][-1]["content"] for r in server.requests]
    assert (
        "Question: Weather in Oslo?\nAnswer:\n"
        'Assistant calls get_weather({"city": "Oslo"})\nTool result: -3 C, snow\n'
        "Assistant: Paris.\nIs this answer correct? Reply Yes or No."
    ) in prompts


# (name, reply to every request, the RulerError text)
FAILURES = [
    ("no logprobs", Reply("Yes"), "returned no logprobs (the response has no logprobs)"),
    ("no top_logprobs", Reply("Yes", top_logprobs={}), "logprobs but no top_logprobs"),
    ("HTTP 400", Reply(status=400, error="logprobs unsupported"), "rejected the request (HTTP 400)"),
]


@pytest.mark.parametrize("mode", ["yesno", "digits", "pairwise"])
@pytest.mark.parametrize("name, reply, problem", FAILURES, ids=[f[0] for f in FAILURES])
async def test_judge_without_logprobs_is_an_error(
    mode: str, name: str, reply: Reply, problem: str
) -> None:
    with ScriptedJudge(lambda body: reply) as server, pytest.raises(ruler.RulerError) as info:
        await ruler.score(LISTS, mode=mode, **judge_args(server))
    assert problem in str(info.value) and "openai/judge" in str(info.value)
    assert "mode='listwise'" in str(info.value)
    assert len(server.requests) == N_REQUESTS[mode]  # asked, never retried, never neutral


@pytest.mark.parametrize(
    "mode, candidates, problem",
    [
        ("yesno", {"The": 0.6, "I": 0.3}, "none of the rating tokens (Yes/No)"),
        ("digits", {"Yes": 0.9}, "none of the rating tokens (0-9)"),
        ("pairwise", {"Both": 0.9}, "none of the rating tokens (A/B)"),
    ],
)
async def test_no_rating_token_is_an_error(
    mode: str, candidates: dict[str, float], problem: str
) -> None:
    judge = ScriptedJudge(lambda body: Reply(top_logprobs=_log(candidates)))
    with judge as server, pytest.raises(ruler.RulerError, match="gave no rating") as info:
        await ruler.score(LISTS, mode=mode, **judge_args(server))
    assert problem in str(info.value)


@pytest.mark.parametrize(
    "first, timeout",
    [
        (Reply(top_logprobs=_log(YESNO["Paris."]), delay=2.0), 0.5),
        (Reply(status=500, error="engine busy"), 10),
        (Reply(status=503, error="unavailable"), 10),
    ],
    ids=["timeout", "HTTP 500", "HTTP 503"],
)
async def test_transient_failure_is_retried(first: Reply, timeout: float) -> None:
    replies = iter([first, *[Reply(top_logprobs=_log(YESNO["Paris."]))] * 3])
    with ScriptedJudge(lambda body: next(replies)) as server:
        result = await ruler.score(LISTS, mode="yesno", **judge_args(server, timeout=timeout))
    assert result.scores == pytest.approx([0.75] * 3)
    assert result.metrics["ruler_retries"] == 1 and result.metrics["ruler_judge_calls"] == 4


async def test_transient_failure_every_time_is_an_error() -> None:
    with ScriptedJudge(lambda body: Reply(status=500)) as server, pytest.raises(
        ruler.RulerError, match="gave no answer in 3 attempts"
    ):
        await ruler.score(LISTS, mode="digits", max_retries=2, **judge_args(server))
    assert len(server.requests) == 3 * 3


async def test_duplicates_judged_once_and_cache(tmp_path: Path) -> None:
    lists = [LISTS[0], LISTS[2], LISTS[0]]
    args = dict(mode="yesno", cache=True, cache_dir=tmp_path / "cache")
    with ScriptedJudge(judge_responder) as server:
        first = await ruler.score(lists, **judge_args(server, **args))
        again = await ruler.score(lists, **judge_args(server, **args, temperature=0.7))
        await ruler.score(lists, **judge_args(server, **{**args, "mode": "digits"}))
    assert first.scores == pytest.approx([0.75, 0.01 / 0.51, 0.75])
    assert len(server.requests) == 2 + 2  # yesno once (2 distinct), then digits
    assert again.scores == first.scores and again.metrics["ruler_cache_hit"] == 1
    assert again.metrics["ruler_rating_mass"] == first.metrics["ruler_rating_mass"]


@pytest.mark.parametrize(
    "mode, judge, api_base, expected",
    [
        ("auto", "openai/gpt-4o-mini", None, "listwise"),
        ("auto", "openai/judge", "https://api.example.com/v1", "listwise"),
        ("auto", "openai/judge", "http://127.0.0.1:8000/v1", ruler.LOCAL_DEFAULT_MODE),
        ("auto", "openai/judge", "http://localhost:8000/v1", ruler.LOCAL_DEFAULT_MODE),
        ("auto", "openai/judge", "http://[::1]:8000/v1", ruler.LOCAL_DEFAULT_MODE),
        ("auto", "hosted_vllm/HuggingFaceTB/SmolLM2-135M-Instruct", "http://10.1.2.3/v1",
         ruler.LOCAL_DEFAULT_MODE),
        ("listwise", "openai/judge", "http://127.0.0.1:8000/v1", "listwise"),
        ("pairwise", "openai/gpt-4o-mini", None, "pairwise"),
    ],
)
def test_auto_mode(mode: str, judge: str, api_base: str | None, expected: str) -> None:
    assert resolve_mode(mode, judge, {"api_base": api_base} if api_base else {}) == expected


async def test_unknown_mode_is_an_error_even_when_swallowing() -> None:
    group = TrajectoryGroup(trajectories=[Trajectory(messages=m) for m in LISTS])
    with pytest.raises(ValueError, match="unknown RULER mode 'yes-no'"):
        await ruler.score_group(group, "openai/judge", mode="yes-no", swallow_exceptions=True)


async def test_score_group_auto_on_a_local_judge(caplog: pytest.LogCaptureFixture) -> None:
    group = TrajectoryGroup(trajectories=[Trajectory(messages=m, reward=0.5) for m in LISTS])
    with ScriptedJudge(judge_responder) as server:
        scored = await ruler.score_group(group, **judge_args(server))  # loopback: yesno
    assert scored is not None
    assert scored.rewards == pytest.approx(EXPECTED["yesno"])
    for t in scored:
        assert 0.0 <= t.reward <= 1.0 and t.metrics["independent_reward"] == 0.5
        assert t.logs[-1].startswith("RULER openai/judge [yesno]: score ")
        ruler_metrics = [v for k, v in t.metrics.items() if k.startswith("ruler")]
        assert all(isinstance(v, int | float) for v in ruler_metrics)
    # no logprobs: the group is dropped with a warning that says why
    no_logprobs = ScriptedJudge(lambda body: Reply("Yes"))
    with no_logprobs as server, caplog.at_level(logging.WARNING, logger="ruler"):
        assert await ruler.score_group(group, swallow_exceptions=True, **judge_args(server)) is None
    assert "returned no logprobs" in caplog.text
