"""RULER against a real HTTP server that answers from a script, called through real litellm.

The scripted server (`ruler.testing.ScriptedJudge`) speaks the OpenAI chat.completion format and
records the request bodies, so these tests exercise our prompt, parsing, retry, fallback and
cache logic end to end without a model. litellm's own retries are off (`num_retries=0`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ruler
from art_core.trajectory import Trajectory, TrajectoryGroup
from ruler.answer import InvalidAnswer, parse_answer
from ruler.prompt import common_prefix_length
from ruler.testing import Reply, ScriptedJudge

ROOT = Path(__file__).resolve().parents[2]

SYSTEM = {"role": "system", "content": "You are a helpful assistant. SHARED-SYSTEM-MARKER"}
TASK = {"role": "user", "content": "What is the capital of France? SHARED-TASK-MARKER"}
REPLIES = ["Paris.", "It is Lyon.", "I like turtles."]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def chat(reply: str) -> list[dict[str, Any]]:
    return [SYSTEM, TASK, {"role": "assistant", "content": reply}]


def make_group(replies: list[str] = REPLIES, reward: float = 0.25) -> TrajectoryGroup:
    return TrajectoryGroup(
        trajectories=[
            Trajectory(messages=chat(r), tools=TOOLS, reward=reward, metrics={"turns": 1})
            for r in replies
        ]
    )


def answer(*scores: Any, ids: list[Any] | None = None) -> str:
    ids = ids if ids is not None else [str(n) for n in range(1, len(scores) + 1)]
    return json.dumps(
        {
            "scores": [
                {"trajectory_id": i, "explanation": f"reason {i}", "score": s}
                for i, s in zip(ids, scores, strict=True)
            ]
        }
    )


GOOD = answer(0.9, 0.3, 0.0)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default cache lives under $ART_HOME: keep every test's cache in its own tmp dir."""
    monkeypatch.setenv("ART_HOME", str(tmp_path / "art_home"))


@pytest.fixture
def server():
    with ScriptedJudge() as s:
        yield s


def judge_args(server: ScriptedJudge, **overrides: Any) -> dict[str, Any]:
    args = {
        "judge": "openai/judge",
        "api_base": server.api_base,
        "api_key": "x",
        "num_retries": 0,
        "cache": False,
        "timeout": 10,
        "mode": "listwise",  # the JSON prompt; a loopback judge would get the local default
    }
    return {**args, **overrides}


# --- answer validation, no server --------------------------------------------------------------


@pytest.mark.parametrize(
    "content, scores",
    [
        (answer(0.9, 0.3, 0.0), [0.9, 0.3, 0.0]),
        ("```json\n" + answer(1, 0.5, 0) + "\n```", [1.0, 0.5, 0.0]),
        ("Here are my scores:\n" + answer(0.2, 0.1, 0.7), [0.2, 0.1, 0.7]),
        (answer(0.2, 0.1, 0.7, ids=[3, 1, 2]), [0.1, 0.7, 0.2]),  # integer ids, any order
    ],
)
def test_parse_answer_accepts(content: str, scores: list[float]) -> None:
    parsed = parse_answer(content, ["1", "2", "3"])
    assert [parsed[i].score for i in ("1", "2", "3")] == scores


@pytest.mark.parametrize(
    "content, problem",
    [
        (answer(0.9, 0.3), "expected 3 scores, got 2"),
        (answer(0.9, 0.3, 0.1, ids=["1", "1", "2"]), "ids given more than once: ['1']"),
        (answer(0.9, 0.3, 0.1, ids=["1", "2", "7"]), "unknown ids: ['7']"),
        (answer(1.7, 0.3, 0.1), "score 1.7 is outside [0, 1]"),
        (answer(0.5, -0.1, 0.1), "score -0.1 is outside [0, 1]"),
        (answer(0.5, float("nan"), 0.1), "score nan is not a finite number"),
        ("The first one is best.", "not a JSON object"),
        ("", "the answer is empty"),
        ('{"scores": [{"trajectory_id": "1", "score": 0.5}]}', "explanation: Field required"),
        ('{"ranking": [1, 2, 3]}', "scores: Field required"),
    ],
)
def test_parse_answer_rejects(content: str, problem: str) -> None:
    with pytest.raises(InvalidAnswer) as info:
        parse_answer(content, ["1", "2", "3"])
    assert problem in str(info.value)


def test_unreadable_cache_entry_is_a_miss(tmp_path: Path) -> None:
    from ruler import cache

    cache.write(tmp_path, "ab" * 32, {"ids": ["1"]})
    assert cache.read(tmp_path, "ab" * 32) == {"ids": ["1"]}
    (tmp_path / "ab" / f"{'ab' * 32}.json").write_text("{not json")
    assert cache.read(tmp_path, "ab" * 32) is None
    assert cache.read(tmp_path, "cd" * 32) is None
    assert not list(tmp_path.rglob("*.tmp"))


def test_common_prefix_length() -> None:
    assert common_prefix_length([chat("a"), chat("b")]) == 2
    assert common_prefix_length([chat("a"), chat("a")[:2]]) == 2
    assert common_prefix_length([chat("a"), [TASK]]) == 0
    assert common_prefix_length([]) == 0


# --- through litellm, against the scripted server ----------------------------------------------

# (name, script, max_retries, expected scores or the RulerError text, requests made)
STALL_S = 60.0  # a judge that stalls answers long after the client gave up
STALL_TIMEOUT_S = 3.0  # the client's timeout where the judge stalls

CASES = [
    ("well-formed", [GOOD], 3, [0.9, 0.3, 0.0], 1),
    ("code fence", ["```json\n" + GOOD + "\n```"], 3, [0.9, 0.3, 0.0], 1),
    ("wrong count, then good", [answer(0.9, 0.3), GOOD], 3, [0.9, 0.3, 0.0], 2),
    (
        "duplicate ids, then good",
        [answer(0.9, 0.3, 0.1, ids=["1", "1", "2"]), GOOD],
        3,
        [0.9, 0.3, 0.0],
        2,
    ),
    ("score 1.7, then good", [answer(1.7, 0.3, 0.0), GOOD], 3, [0.9, 0.3, 0.0], 2),
    (
        "NaN, then good",
        ['{"scores": [{"trajectory_id": "1", "explanation": "x", "score": NaN}]}', GOOD],
        3,
        [0.9, 0.3, 0.0],
        2,
    ),
    ("prose, then good", ["Trajectory 1 is the best.", GOOD], 3, [0.9, 0.3, 0.0], 2),
    (
        "400 on json_schema: JSON mode",
        [Reply(status=400, error="json_schema unsupported"), GOOD],
        3,
        [0.9, 0.3, 0.0],
        2,
    ),
    ("400 on every format", [Reply(status=400)] * 3, 3, "rejected the request (HTTP 400)", 3),
    ("422 on json_schema: JSON mode", [Reply(status=422), GOOD], 3, [0.9, 0.3, 0.0], 2),
    ("prose every time", ["No."] * 4, 3, "no valid answer in 4 attempts", 4),
    ("1.7 every time", [answer(1.7, 0.3, 0.0)] * 2, 1, "score 1.7 is outside [0, 1]", 2),
    ("timeout, then good", [Reply(GOOD, delay=STALL_S), GOOD], 3, [0.9, 0.3, 0.0], 2),
    ("timeout every time", [Reply(GOOD, delay=STALL_S)] * 2, 1, "timed out", 2),
]


@pytest.mark.parametrize(
    "name, script, max_retries, expected, n_requests", CASES, ids=[c[0] for c in CASES]
)
async def test_score_scripted(
    server: ScriptedJudge,
    name: str,
    script: list[Reply | str],
    max_retries: int,
    expected: list[float] | str,
    n_requests: int,
) -> None:
    server.push(*script)
    replies = [Reply(r) if isinstance(r, str) else r for r in script]
    # where the judge stalls, the stall is far past the timeout and the timeout far past any
    # answer on a busy machine (0.5 s once timed out the good reply too, beside a CI run)
    timeout = STALL_TIMEOUT_S if any(r.delay for r in replies) else 10
    args = judge_args(server, max_retries=max_retries, timeout=timeout)
    lists = [chat(r) for r in REPLIES]
    if isinstance(expected, str):
        with pytest.raises(ruler.RulerError, match="openai/judge") as info:
            await ruler.score(lists, **args)
        assert expected in str(info.value)
    else:
        result = await ruler.score(lists, **args)
        assert result.scores == expected
        assert result.explanations == ["reason 1", "reason 2", "reason 3"]
        answered = sum(r.status == 200 and r.delay == 0 for r in replies)
        assert (
            result.metrics["ruler_retries"] == sum(r.status not in (400, 422) for r in replies) - 1
        )
        assert result.metrics["ruler_judge_calls"] == n_requests
        assert result.metrics["ruler_prompt_tokens"] == 100 * answered
    assert len(server.requests) == n_requests


async def test_invalid_answer_is_fed_back(server: ScriptedJudge) -> None:
    server.push(answer(0.9, 0.3), GOOD)
    await ruler.score([chat(r) for r in REPLIES], **judge_args(server))
    first, second = server.requests
    assert second["messages"][:2] == first["messages"]
    assert second["messages"][2] == {"role": "assistant", "content": answer(0.9, 0.3)}
    assert "expected 3 scores, got 2" in second["messages"][3]["content"]


async def test_response_format_fallback_order(server: ScriptedJudge) -> None:
    server.push(Reply(status=400), Reply(status=400), GOOD)
    result = await ruler.score([chat(r) for r in REPLIES], **judge_args(server))
    formats = [r.get("response_format") for r in server.requests]
    assert formats[0]["type"] == "json_schema"
    assert formats[0]["json_schema"]["schema"]["required"] == ["scores"]
    assert formats[1:] == [{"type": "json_object"}, None]
    assert result.metrics["ruler_format_fallbacks"] == 2
    assert result.metrics["ruler_retries"] == 0


async def test_prompt_sends_shared_prefix_once_and_dedupes(server: ScriptedJudge) -> None:
    server.push(answer(0.8, 0.1))
    lists = [chat("Paris."), chat("Lyon."), chat("Paris.")]
    result = await ruler.score(lists, tools=TOOLS, **judge_args(server))
    [request] = server.requests
    prompt = request["messages"][1]["content"]
    assert prompt.count("SHARED-SYSTEM-MARKER") == 1
    assert prompt.count("SHARED-TASK-MARKER") == 1
    assert prompt.index("SHARED-TASK-MARKER") < prompt.index('<trajectory id="1">')
    assert prompt.count("<trajectory id=") == 2  # the duplicate is not sent
    assert prompt.count("Paris.") == 1 and prompt.count("Lyon.") == 1
    assert "search_web" in prompt
    assert "significantly higher" in request["messages"][0]["content"]  # the default rubric
    assert result.scores == [0.8, 0.1, 0.8]
    assert result.metrics["ruler_unique_trajectories"] == 2


async def test_custom_rubric_is_sent(server: ScriptedJudge) -> None:
    server.push(answer(0.8, 0.1))
    await ruler.score(
        [chat("a"), chat("b")], rubric="Shorter is better. CUSTOM-RUBRIC", **judge_args(server)
    )
    system = server.requests[0]["messages"][0]["content"]
    assert "CUSTOM-RUBRIC" in system and "significantly higher" not in system


@pytest.mark.parametrize(
    "lists", [[chat("same")] * 3, [chat("alone")], []], ids=["all identical", "one", "empty"]
)
async def test_nothing_to_compare_calls_no_judge(
    server: ScriptedJudge, lists: list, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="ruler"):
        result = await ruler.score(lists, **judge_args(server))
    assert server.requests == []
    assert result.scores == [ruler.NEUTRAL_SCORE] * len(lists)
    assert result.metrics["ruler_judge_calls"] == 0
    if lists:
        assert "relative grounding is lost" in caplog.text


async def test_cache(server: ScriptedJudge, tmp_path: Path) -> None:
    server.push(GOOD, GOOD, GOOD)
    lists = [chat(r) for r in REPLIES]
    args = judge_args(server, cache=True, cache_dir=tmp_path / "cache")
    first = await ruler.score(lists, **args)
    second = await ruler.score(lists, **{**args, "timeout": 7})  # transport args: same entry
    assert len(server.requests) == 1
    assert second.scores == first.scores and second.explanations == first.explanations
    assert (first.metrics["ruler_cache_hit"], second.metrics["ruler_cache_hit"]) == (0, 1)
    assert second.metrics["ruler_judge_calls"] == 0
    assert [p.suffix for p in (tmp_path / "cache").rglob("*") if p.is_file()] == [".json"]

    await ruler.score(lists, **{**args, "cache": False})
    assert len(server.requests) == 2
    await ruler.score(lists, **{**args, "rubric": "another rubric"})  # another request: a miss
    assert len(server.requests) == 3


async def test_cache_defaults_to_art_home(server: ScriptedJudge, tmp_path: Path) -> None:
    server.push(GOOD)
    args = judge_args(server, cache=True)
    await ruler.score([chat(r) for r in REPLIES], **args)
    await ruler.score([chat(r) for r in REPLIES], **args)
    assert len(server.requests) == 1
    assert list((tmp_path / "art_home" / "ruler").rglob("*.json"))


async def test_score_group(server: ScriptedJudge) -> None:
    server.push(GOOD)
    group = make_group()
    before = group.model_dump()
    scored = await ruler.score_group(group, **judge_args(server))
    assert group.model_dump() == before  # the input is not changed
    assert scored is not None and scored is not group
    assert scored.rewards == [0.9, 0.3, 0.0]
    for t, expected in zip(scored.trajectories, [0.9, 0.3, 0.0], strict=True):
        assert t.metrics["ruler_score"] == expected
        assert t.metrics["independent_reward"] == 0.25
        assert t.metrics["turns"] == 1
        assert t.metrics["ruler_judge_calls"] == 1
        assert all(
            isinstance(v, int | float) and not isinstance(v, bool)
            for k, v in t.metrics.items()
            if k.startswith("ruler_")
        )
        assert "ruler_cost_usd" not in t.metrics  # litellm knows no price for a local server
        assert t.logs[-1].startswith("RULER openai/judge [listwise]: score")
    assert scored.trajectories[1].logs[-1].endswith("reason 2")

    server.push(answer(0.1, 0.2, 0.3))  # scoring again keeps the original reward
    again = await ruler.score_group(scored, **judge_args(server))
    assert again is not None
    assert [t.metrics["independent_reward"] for t in again] == [0.25] * 3


async def test_cost_metric_for_a_priced_model(server: ScriptedJudge) -> None:
    # litellm has a price for gpt-4o-mini in its local cost map; the server answers as that model.
    server.push(GOOD)
    result = await ruler.score(
        [chat(r) for r in REPLIES], **judge_args(server, judge="openai/gpt-4o-mini")
    )
    assert result.metrics["ruler_cost_usd"] > 0


@pytest.mark.parametrize("swallow", [True, False])
async def test_score_group_failure(
    server: ScriptedJudge, swallow: bool, caplog: pytest.LogCaptureFixture
) -> None:
    server.push(*["prose"] * 2)
    args = judge_args(server, max_retries=1, swallow_exceptions=swallow)
    if swallow:
        with caplog.at_level(logging.WARNING, logger="ruler"):
            assert await ruler.score_group(make_group(), **args) is None
        assert "dropping a group of 3 trajectories" in caplog.text
    else:
        with pytest.raises(ruler.RulerError, match="no valid answer in 2 attempts"):
            await ruler.score_group(make_group(), **args)


async def test_hook_with_gather(server: ScriptedJudge) -> None:
    gather = pytest.importorskip("art_core.gather", reason="art_core.gather not written yet")

    async def rollout(reply: str) -> Trajectory:
        return Trajectory(messages=chat(reply), reward=1.0)

    # Group 0 is judged; group 1 gets prose twice and is dropped.
    def respond(body: dict[str, Any]) -> str:
        return GOOD if "Paris." in body["messages"][1]["content"] else "prose"

    with ScriptedJudge(respond) as judge:
        after_each = ruler.hook(
            "openai/judge",
            api_base=judge.api_base,
            api_key="x",
            num_retries=0,
            cache=False,
            max_retries=1,
            swallow_exceptions=True,
            mode="listwise",
        )
        groups = await gather.gather_trajectory_groups(
            [[rollout(r) for r in REPLIES], [rollout(r) for r in ("x", "y")]],
            after_each=after_each,
            show_progress=False,
        )
    assert len(groups) == 1
    assert groups[0].rewards == [0.9, 0.3, 0.0]
    assert len(judge.requests) == 3


def test_import_ruler_does_not_import_litellm() -> None:
    code = "import sys, ruler; ruler.score; assert 'litellm' not in sys.modules, 'imported litellm'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _load_eval_script() -> Any:
    spec = importlib.util.spec_from_file_location("ruler_eval", ROOT / "benchmarks/ruler_eval.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "xs, ys, rho, tau",
    [
        ([1, 2, 3, 4], [10, 20, 30, 40], 1.0, 1.0),
        ([1, 2, 3, 4], [4, 3, 2, 1], -1.0, -1.0),
        ([1, 2, 3], [1, 1, 1], 0.0, 0.0),  # a judge that ties everything carries no signal
        ([3, 2, 1, 0], [0.9, 0.9, 0.2, 0.0], 0.9486833, 0.9128709),  # 4.5/sqrt(22.5), 5/sqrt(30)
    ],
)
def test_eval_rank_correlations(xs: list[float], ys: list[float], rho: float, tau: float) -> None:
    module = _load_eval_script()
    assert module.spearman(xs, ys) == pytest.approx(rho)
    assert module.kendall(xs, ys) == pytest.approx(tau)


async def test_eval_with_oracle_judge() -> None:
    module = _load_eval_script()
    groups = module.build_groups()
    assert len(groups) >= 40 and all(4 <= len(g["lists"]) <= 8 for g in groups)
    assert {g["kind"] for g in groups} == {"qa", "chat", "tool"}
    with ScriptedJudge(module.make_oracle()) as judge:
        results = await module.evaluate(
            "openai/oracle", ["yesno", "listwise"], api_base=judge.api_base, api_key="x",
            num_retries=0, cache=False,
        )
    for r in results.values():
        assert r["failed"] == 0
        assert r["spearman"] == pytest.approx(1.0) and r["kendall"] == pytest.approx(1.0)
        assert r["ci"] == pytest.approx((1.0, 1.0))
    # one request per distinct answer, then one per group
    assert len(judge.requests) == sum(len(g["lists"]) for g in groups) + len(groups)


def test_bootstrap_interval() -> None:
    module = _load_eval_script()
    lo, hi = module.bootstrap_ci([0.0, 1.0] * 20)
    assert 0.3 < lo < 0.5 < hi < 0.7
    assert module.bootstrap_ci([0.6] * 5) == pytest.approx((0.6, 0.6))


def test_eval_script_cli_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    # In-process (a subprocess would pay litellm's import again); sync, so main's asyncio.run
    # gets its own event loop. Every mode, with the oracle judge, must rank perfectly.
    assert _load_eval_script().main(["--dry-run", "--no-cache"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    for mode in ("listwise", "yesno", "digits", "pairwise"):
        assert rows[mode][1:6] == ["44", "0", "1.000", "[", "1.000,"], rows[mode]
