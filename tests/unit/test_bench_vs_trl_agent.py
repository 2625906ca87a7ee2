"""benchmarks/vs_trl_agent.py: its task and reward, its report format, and that both systems are
given the same prompts. Nothing is started (no vLLM, no TRL training) and no timing is asserted
(a benchmark's numbers belong to the machine, not to a test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from art_langgraph import demo
from art_langgraph.messages import to_openai_message
from tests.support.data import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vs_trl_agent.py"


def load_bench():
    return load_benchmark("vs_trl_agent")


@pytest.fixture(scope="module")
def bench():
    return load_bench()


# ---- the task's questions -----------------------------------------------------------------


def test_single_questions_are_the_demos(bench) -> None:
    tasks = bench.all_tasks("single")
    qs = demo.questions(demo.TRAIN_COUNTRIES)
    assert [(t.kind, t.countries, t.field) for t in tasks] == \
        [("field", (q.country,), q.field) for q in qs]
    assert [t.text for t in tasks] == [q.text for q in qs]  # "What is the <field> of <X>?"
    assert bench.LOOKUPS["single"] == 1


def test_multi_questions_name_two_training_countries(bench) -> None:
    tasks = bench.all_tasks("multi")
    assert len(tasks) == len(demo.TRAIN_COUNTRIES)
    assert {t.kind for t in tasks} == {"larger", "currencies"}
    for t in tasks:
        a, b = t.countries
        assert a != b and {a, b} <= set(demo.TRAIN_COUNTRIES)
        if t.kind == "larger":
            assert t.text == f"Which has the larger population, {a} or {b}?"
            assert bench.population(a) != bench.population(b)  # a tie has no right answer
        else:
            assert t.text == f"What are the currencies of {a} and {b}?"
    assert bench.LOOKUPS["multi"] == 2


@pytest.mark.parametrize("task", ["single", "multi"])
@pytest.mark.parametrize("groups", [1, 3])
def test_steps_walk_the_questions_in_order(bench, task: str, groups: int) -> None:
    tasks = bench.all_tasks(task)
    for step in range(len(tasks)):  # far enough to wrap around
        got = bench.step_tasks(task, step, groups)
        assert got == [tasks[(step * groups + g) % len(tasks)] for g in range(groups)]
        assert got == bench.step_tasks(task, step, groups)  # deterministic
    assert bench.step_tasks(task, 0, groups) != bench.step_tasks(task, 1, groups)


# ---- the reward, on hand-written episodes -------------------------------------------------


def ours_turns(task: Any, lookups: list[str], answer: str | None) -> list[dict[str, Any]]:
    """An episode as our graph leaves it (LangChain messages after the prompt), turned into the
    OpenAI dicts our reward reads, the way run_ours' reward does (arguments a JSON string)."""
    msgs: list[Any] = list(demo.prompt(task))
    for i, country in enumerate(lookups):
        call = {"id": f"call{i}", "name": "lookup_country", "args": {"country": country}}
        msgs += [AIMessage("", tool_calls=[call]),
                 ToolMessage(demo.lookup_country.func(country), tool_call_id=call["id"])]
    if answer is not None:
        msgs.append(AIMessage(answer))
    return [to_openai_message(m) for m in demo.this_question(msgs)]


def trl_turns(task: Any, lookups: list[str], answer: str | None) -> list[dict[str, Any]]:
    """The same episode as TRL's parsed completion (arguments a dict)."""
    out: list[dict[str, Any]] = []
    for country in lookups:
        out += [{"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function", "function": {
                     "name": "lookup_country", "arguments": {"country": country}}}]},
                {"role": "tool", "name": "lookup_country",
                 "content": demo.lookup_country.func(country)}]
    if answer is not None:
        out.append({"role": "assistant", "content": answer})
    return out


FORMATS = {"ours": ours_turns, "trl": trl_turns}


def single_task(bench, field: str) -> Any:
    return next(t for t in bench.all_tasks("single") if t.field == field)


def other_country(country: str) -> str:
    return next(c for c in demo.TRAIN_COUNTRIES if c != country)


# (case, field asked, countries looked up: "x" = the question's, "other" = another one,
#  answer template or None (no answer: the episode ends on its lookup), reward)
SINGLE = [
    ("correct", "currency", ["x"], "It is {value}.", 1.0),
    ("correct, capital", "capital", ["x"], "The capital is {value}.", 1.0),
    ("wrong", "currency", ["x"], "It is zzz.", 0.2),
    ("another field's value", "capital", ["x"], "It is {currency}.", 0.2),
    ("the whole record", "currency", ["x"], "{record}", 0.2),  # all the values: not an answer
    ("lookup, no answer", "currency", ["x"], None, 0.2),
    ("correct, no lookup", "currency", [], "It is {value}.", 0.8),
    ("correct, another country looked up", "currency", ["other"], "It is {value}.", 0.8),
    ("nothing", "currency", [], None, 0.0),
]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(("case", "field", "lookups", "answer", "reward"), SINGLE,
                         ids=[c[0] for c in SINGLE])
def test_single_reward(bench, fmt: str, case: str, field: str, lookups: list[str],
                       answer: str | None, reward: float) -> None:
    task = single_task(bench, field)
    (country,) = task.countries
    record = demo.WORLD[country]
    names = {"x": country, "other": other_country(country)}
    text = None if answer is None else answer.format(
        value=record[field], currency=record["currency"],
        record=demo.lookup_country.func(country))
    looked_up, got_answer, calls = bench.episode(FORMATS[fmt](task, [names[c] for c in lookups],
                                                              text))
    assert looked_up == [names[c] for c in lookups]
    assert got_answer == (text or "")
    assert calls == len(lookups) + (text is not None)
    assert bench.score(task, looked_up, got_answer) == pytest.approx(reward)


def larger_task(bench) -> Any:
    return next(t for t in bench.all_tasks("multi") if t.kind == "larger")


def currencies_task(bench) -> Any:
    return next(t for t in bench.all_tasks("multi") if t.kind == "currencies"
                and len({demo.WORLD[c]["currency"] for c in t.countries}) == 2)


# (case, question kind, countries looked up: "a"/"b" the question's first/second, answer template
#  or None, reward). Templates: {win}/{lose} the more/less populous country, {pop} the winner's
#  population, {lose_pop} the other's; {cur_a}/{cur_b} the currencies.
MULTI = [
    ("larger: correct", "larger", ["a", "b"], "{win} has the larger population, {pop}.", 1.0),
    ("larger: correct, the other one named after", "larger", ["a", "b"],
     "{win} ({pop}) is larger than {lose} ({lose_pop}).", 1.0),
    ("larger: the smaller one", "larger", ["a", "b"],
     "{lose} has the larger population, {lose_pop}.", 0.2),
    ("larger: the smaller one named first", "larger", ["a", "b"],
     "{lose} is smaller than {win}, {pop}.", 0.2),  # the first country named is the pick
    ("larger: no population", "larger", ["a", "b"], "{win} has the larger population.", 0.2),
    ("larger: lookups, no answer", "larger", ["a", "b"], None, 0.2),
    ("larger: one lookup, no answer", "larger", ["a"], None, 0.1),
    ("larger: correct, no lookup", "larger", [], "{win}: {pop}.", 0.8),
    ("larger: correct, one lookup", "larger", ["b"], "{win}: {pop}.", 0.9),
    ("currencies: correct", "currencies", ["a", "b"],
     "The currencies are {cur_a} and {cur_b}.", 1.0),
    ("currencies: one of them", "currencies", ["a", "b"], "The currency is {cur_a}.", 0.2),
    ("currencies: lookups, no answer", "currencies", ["a", "b"], None, 0.2),
    ("currencies: correct, one lookup", "currencies", ["a"], "{cur_b} and {cur_a}.", 0.9),
    ("currencies: nothing", "currencies", [], None, 0.0),
]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(("case", "kind", "lookups", "answer", "reward"), MULTI,
                         ids=[c[0] for c in MULTI])
def test_multi_reward(bench, fmt: str, case: str, kind: str, lookups: list[str],
                      answer: str | None, reward: float) -> None:
    task = larger_task(bench) if kind == "larger" else currencies_task(bench)
    a, b = task.countries
    win, lose = sorted(task.countries, key=bench.population, reverse=True)
    names = {"a": a, "b": b}
    text = None if answer is None else answer.format(
        win=win, lose=lose, pop=demo.WORLD[win]["population"],
        lose_pop=demo.WORLD[lose]["population"],
        cur_a=demo.WORLD[a]["currency"], cur_b=demo.WORLD[b]["currency"])
    looked_up, got_answer, calls = bench.episode(FORMATS[fmt](task, [names[c] for c in lookups],
                                                              text))
    assert looked_up == [names[c] for c in lookups]
    assert calls == len(lookups) + (text is not None)
    assert bench.score(task, looked_up, got_answer) == pytest.approx(reward)


def test_an_episode_cut_off_on_a_call_has_no_answer(bench) -> None:
    """TRL stops at max_tool_calling_iterations, our graph after lookups + 1 turns: the last
    turn may be a call; that is not an answer, even with text beside the call."""
    task = single_task(bench, "currency")
    value = demo.WORLD[task.countries[0]]["currency"]
    turns = trl_turns(task, [task.countries[0]], None)
    turns[0]["content"] = f"It is {value}."
    looked_up, answer, calls = bench.episode(turns)
    assert (looked_up, answer, calls) == ([task.countries[0]], "", 1)
    assert bench.score(task, looked_up, answer) == pytest.approx(0.2)


def test_the_tool_is_the_demos(bench) -> None:
    country = demo.TRAIN_COUNTRIES[0]
    assert bench.lookup_country(country) == demo.lookup_country.func(country)
    assert bench.lookup_country(" nowhere ") == demo.lookup_country.func(" nowhere ")


# ---- the report ---------------------------------------------------------------------------


def result(system: str, step_s: list[float], calls: float = 2.0, reward: float = 0.5,
           error: str | None = None) -> dict:
    return {"system": system, "model": "smollm2", "max_tokens": 64, "peak_rss_gib": 1.5,
            "setup_s": 1.0, "error": error,
            "steps": [{"step_s": s, "gen_s": s / 2, "train_s": s / 2, "sampled_tokens": 512,
                       "trained_tokens": 512, "calls": calls + i / 2, "reward": reward,
                       "tokens": 2048.0, "forwarded": 1024.0, "swap_s": 0.25}
                      for i, s in enumerate(step_s)]}


def test_report_cells_are_median_min_max(bench) -> None:
    lines = bench.format_report([result("trl", [8.0, 9.0, 10.0], calls=1.0, reward=0.2),
                                 result("ours", [4.0, 4.5, 6.0], calls=3.0, reward=0.9)])
    assert "step s" in lines[0] and "calls/ep" in lines[0] and "reward" in lines[0]
    assert "peak RSS GiB" in lines[0]
    trl = next(ln for ln in lines if ln.startswith("trl "))
    ours = next(ln for ln in lines if ln.startswith("ours "))
    assert "9.00 (8.00-10.00)" in trl  # median (min-max) of TRL's step time
    assert "4.50 (4.00-5.00)" in trl  # rollout s: half of it
    assert "1.50 (1.00-2.00)" in trl  # calls/ep over the steps: 1.0, 1.5, 2.0
    assert "0.20 (0.20-0.20)" in trl  # reward
    assert "4.50 (4.00-6.00)" in ours
    assert "3.50 (3.00-4.00)" in ours
    assert "0.90 (0.90-0.90)" in ours
    assert ours.endswith("1.50")  # peak RSS GiB
    assert "trl/ours: step time x2.00 (model calls per episode: trl 1.50, ours 3.50)" in lines
    assert lines[-1] == "ratio: 2.00"  # 9.0 / 4.5


def test_rates_are_per_step_rollout_and_forwarded_training(bench) -> None:
    m = bench.summarize(result("ours", [4.0, 8.0, 10.0]))
    # rollout: 512 sampled tokens over gen_s = 2, 4, 5 s; training: 1024 forwarded tokens over
    # train_s - swap_s = 1.75, 3.75, 4.75 s
    assert m["rollout_tps"] == pytest.approx((128.0, 102.4, 256.0))
    assert m["train_tps"] == pytest.approx((1024 / 3.75, 1024 / 4.75, 1024 / 1.75))
    assert m["forwarded"] == (1024.0, 1024.0, 1024.0)


def test_report_has_a_line_per_system_against_trl(bench) -> None:
    lines = bench.format_report([  # out of order: the trl/ lines follow SYSTEMS
        result("ours-merged", [5.0]), result("ours", [4.0]), result("trl", [8.0]),
        result("ours-lora", [16.0]),
    ])
    pairs = [ln for ln in lines if ln.startswith("trl/")]
    assert [ln.split(":")[0] for ln in pairs] == ["trl/ours", "trl/ours-lora", "trl/ours-merged"]
    assert pairs[0].startswith("trl/ours: step time x2.00")
    assert pairs[1].startswith("trl/ours-lora: step time x0.50")
    assert pairs[2].startswith("trl/ours-merged: step time x1.60")
    assert lines[-1] == "ratio: 2.00"  # always ours, the default, against trl


@pytest.mark.parametrize(("results", "failed", "pairs"), [
    pytest.param([result("trl", [2.0]), result("ours", [], error="EngineError: no vllm")],
                 ("ours", "EngineError: no vllm"), [], id="ours failed"),
    pytest.param([result("trl", [2.0]), result("ours", [])],
                 ("ours", "no steps counted"), [], id="ours counted no step"),
    pytest.param([result("trl", [2.0]), result("ours-lora", [1.0])], None,
                 ["trl/ours-lora"], id="ours missing"),
    pytest.param([result("trl", [], error="ImportError: no trl"), result("ours", [1.0])],
                 ("trl", "ImportError: no trl"), [], id="trl failed"),
    pytest.param([result("ours", [1.0]), result("ours-lora", [1.0])], None, [],
                 id="trl missing"),
    pytest.param([], None, [], id="nothing ran"),
])
def test_ratio_is_na_without_both_trl_and_ours(bench, results: list[dict],
                                               failed: tuple[str, str] | None,
                                               pairs: list[str]) -> None:
    lines = bench.format_report(results)
    if failed:
        system, why = failed
        assert f"{system:<12} failed: {why}" in lines
    assert [ln.split(":")[0] for ln in lines if ln.startswith("trl/")] == pairs
    assert lines[-1] == "ratio: n/a"


# ---- the same prompts for both systems ----------------------------------------------------


@pytest.mark.parametrize("task", ["single", "multi"])
@pytest.mark.parametrize("groups", [1, 2])
def test_both_systems_get_the_same_prompts_per_step(bench, task: str, groups: int) -> None:
    """run_trl puts every step's questions into one unshuffled dataset, `groups` prompts per
    optimizer step; run_ours asks step_tasks step by step: both read the same sequence, and
    each prompt is the demo's, the question last."""
    steps = 4
    dataset = [t for s in range(steps) for t in bench.step_tasks(task, s, groups)]  # run_trl's
    for step in range(steps):
        ours = bench.step_tasks(task, step, groups)  # run_ours'
        assert dataset[step * groups:(step + 1) * groups] == ours
        for t in ours:
            msgs = demo.prompt(t)
            trl_row = [to_openai_message(m) for m in msgs]  # TRL's row, OpenAI format
            assert [m["content"] for m in trl_row] == [m.content or None for m in msgs]
            assert isinstance(msgs[0], SystemMessage) and msgs[0].content == demo.SYSTEM
            assert isinstance(msgs[-1], HumanMessage) and msgs[-1].content == t.text
            assert trl_row[-1] == {"role": "user", "content": t.text}
            assert demo.this_question(msgs) == []  # no turn of its own yet
            assert sum(m["role"] == "assistant" for m in trl_row) == 2 * len(demo.EXAMPLES)

