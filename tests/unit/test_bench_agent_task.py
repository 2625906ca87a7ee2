"""benchmarks/agent_task.py, the agent race's task: its questions, its reward on hand-written
episodes in both systems' formats (ours: LangChain messages turned into OpenAI dicts; TRL's:
parsed completions), and its tool. Nothing is started."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, ToolMessage

from art_langgraph import demo
from art_langgraph.messages import to_openai_message
from tests.support.data import load_benchmark


@pytest.fixture(scope="module")
def agent_task():
    return load_benchmark("agent_task")


# ---- the task's questions -----------------------------------------------------------------


def test_single_questions_are_the_demos(agent_task) -> None:
    tasks = agent_task.all_tasks("single")
    qs = demo.questions(demo.TRAIN_COUNTRIES)
    assert [(t.kind, t.countries, t.field) for t in tasks] == \
        [("field", (q.country,), q.field) for q in qs]
    assert [t.text for t in tasks] == [q.text for q in qs]  # "What is the <field> of <X>?"
    assert agent_task.LOOKUPS["single"] == 1


def test_multi_questions_name_two_training_countries(agent_task) -> None:
    tasks = agent_task.all_tasks("multi")
    assert len(tasks) == len(demo.TRAIN_COUNTRIES)
    assert {t.kind for t in tasks} == {"larger", "currencies"}
    for t in tasks:
        a, b = t.countries
        assert a != b and {a, b} <= set(demo.TRAIN_COUNTRIES)
        if t.kind == "larger":
            assert t.text == f"Which has the larger population, {a} or {b}?"
            assert agent_task.population(a) != agent_task.population(b)  # a tie has no right answer
        else:
            assert t.text == f"What are the currencies of {a} and {b}?"
    assert agent_task.LOOKUPS["multi"] == 2


@pytest.mark.parametrize("task", ["single", "multi"])
@pytest.mark.parametrize("groups", [1, 3])
def test_steps_walk_the_questions_in_order(agent_task, task: str, groups: int) -> None:
    tasks = agent_task.all_tasks(task)
    for step in range(len(tasks)):  # far enough to wrap around
        got = agent_task.step_tasks(task, step, groups)
        assert got == [tasks[(step * groups + g) % len(tasks)] for g in range(groups)]
        assert got == agent_task.step_tasks(task, step, groups)  # deterministic
    assert agent_task.step_tasks(task, 0, groups) != agent_task.step_tasks(task, 1, groups)


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


def single_task(agent_task, field: str) -> Any:
    return next(t for t in agent_task.all_tasks("single") if t.field == field)


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
def test_single_reward(agent_task, fmt: str, case: str, field: str, lookups: list[str],
                       answer: str | None, reward: float) -> None:
    task = single_task(agent_task, field)
    (country,) = task.countries
    record = demo.WORLD[country]
    names = {"x": country, "other": other_country(country)}
    text = None if answer is None else answer.format(
        value=record[field], currency=record["currency"],
        record=demo.lookup_country.func(country))
    looked_up, got_answer, calls = agent_task.episode(FORMATS[fmt](task, [names[c] for c in lookups],
                                                              text))
    assert looked_up == [names[c] for c in lookups]
    assert got_answer == (text or "")
    assert calls == len(lookups) + (text is not None)
    assert agent_task.score(task, looked_up, got_answer) == pytest.approx(reward)


def larger_task(agent_task) -> Any:
    return next(t for t in agent_task.all_tasks("multi") if t.kind == "larger")


def currencies_task(agent_task) -> Any:
    return next(t for t in agent_task.all_tasks("multi") if t.kind == "currencies"
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
def test_multi_reward(agent_task, fmt: str, case: str, kind: str, lookups: list[str],
                      answer: str | None, reward: float) -> None:
    task = larger_task(agent_task) if kind == "larger" else currencies_task(agent_task)
    a, b = task.countries
    win, lose = sorted(task.countries, key=agent_task.population, reverse=True)
    names = {"a": a, "b": b}
    text = None if answer is None else answer.format(
        win=win, lose=lose, pop=demo.WORLD[win]["population"],
        lose_pop=demo.WORLD[lose]["population"],
        cur_a=demo.WORLD[a]["currency"], cur_b=demo.WORLD[b]["currency"])
    looked_up, got_answer, calls = agent_task.episode(FORMATS[fmt](task, [names[c] for c in lookups],
                                                              text))
    assert looked_up == [names[c] for c in lookups]
    assert calls == len(lookups) + (text is not None)
    assert agent_task.score(task, looked_up, got_answer) == pytest.approx(reward)


def test_an_episode_cut_off_on_a_call_has_no_answer(agent_task) -> None:
    """TRL stops at max_tool_calling_iterations, our graph after lookups + 1 turns: the last
    turn may be a call; that is not an answer, even with text beside the call."""
    task = single_task(agent_task, "currency")
    value = demo.WORLD[task.countries[0]]["currency"]
    turns = trl_turns(task, [task.countries[0]], None)
    turns[0]["content"] = f"It is {value}."
    looked_up, answer, calls = agent_task.episode(turns)
    assert (looked_up, answer, calls) == ([task.countries[0]], "", 1)
    assert agent_task.score(task, looked_up, answer) == pytest.approx(0.2)


def test_the_tool_is_the_demos(agent_task) -> None:
    country = demo.TRAIN_COUNTRIES[0]
    assert agent_task.lookup_country(country) == demo.lookup_country.func(country)
    assert agent_task.lookup_country(" nowhere ") == demo.lookup_country.func(" nowhere ")
