"""The agent demo's parts that need no engine: the world, the split, the reward."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from art_langgraph.demo import (
    HELD_OUT_COUNTRIES,
    TRAIN_COUNTRIES,
    WORLD,
    Question,
    lookup_country,
    make_world,
    prompt,
    score,
)

Q = Question(TRAIN_COUNTRIES[0], "capital")
ROW = WORLD[Q.country]


def test_world_is_deterministic_and_split_never_overlaps():
    assert make_world() == WORLD and len(WORLD) == 24
    assert not set(TRAIN_COUNTRIES) & set(HELD_OUT_COUNTRIES)
    assert set(TRAIN_COUNTRIES) | set(HELD_OUT_COUNTRIES) == set(WORLD)
    for row in WORLD.values():  # an answer names one value only
        assert len({v.lower() for v in row.values()}) == 3


def test_lookup_tool_returns_the_record():
    text = lookup_country.invoke({"country": Q.country})
    assert all(v in text for v in ROW.values())
    assert "No country" in lookup_country.invoke({"country": "Atlantis"})


def episode(call_arg: str | None, answer: str) -> list:
    msgs = [HumanMessage(Q.text)]
    if call_arg is not None:
        msgs += [AIMessage("", tool_calls=[{"id": "c", "name": "lookup_country",
                                            "args": {"country": call_arg}}]),
                 ToolMessage("...", tool_call_id="c")]
    return [*msgs, AIMessage(answer)]


@pytest.mark.parametrize(("call_arg", "answer", "reward", "success"), [
    (Q.country, f"The capital of {Q.country} is {ROW['capital']}.", 1.0, 1.0),
    (Q.country, f"The capital is {ROW['capital'].upper()}", 1.0, 1.0),     # case-insensitive
    ("Atlantis", f"The capital is {ROW['capital']}.", 0.8, 1.0),           # right without lookup
    (Q.country, "I do not know.", 0.2, 0.0),                               # looked up, no answer
    (Q.country, f"{Q.country}: " + "; ".join(ROW.values()), 0.2, 0.0),     # echoing the record
    (Q.country, f"It is {ROW['capital']}, paid in {ROW['currency']}.", 0.2, 0.0),  # extra value
    (Q.country, f"The currency is {ROW['currency']}.", 0.2, 0.0),          # the wrong field
    (None, "No idea.", 0.0, 0.0),
], ids=["right", "case", "no-lookup", "looked-up-only", "echo", "extra-value", "wrong-field",
        "nothing"])
def test_reward_checks_the_answer_not_the_form(call_arg, answer, reward, success):
    parts = score(episode(call_arg, answer), Q)
    assert parts["reward"] == pytest.approx(reward) and parts["success"] == success


def test_an_episode_that_ends_on_a_tool_call_has_no_answer():
    msgs = episode(Q.country, "")[:-1] + [AIMessage("", tool_calls=[
        {"id": "d", "name": "lookup_country", "args": {"country": ROW["capital"]}}])]
    assert score(msgs, Q)["success"] == 0.0


def test_a_question_without_turns_scores_nothing():
    """The graph's messages end at the question (no model turn after it): no answer, no calls."""
    nothing = {"reward": 0.0, "success": 0.0, "looked_up": 0.0, "tool_calls": 0.0}
    assert score(prompt(Q), Q) == nothing  # the worked examples' lookups and answers don't count


def test_the_worked_examples_before_the_question_do_not_count():
    """The examples' tool calls and answers are context: only the turns after the question score."""
    examples = prompt(Q)[:-1]
    assert [type(m).__name__ for m in examples[:3]] == ["SystemMessage", "HumanMessage", "AIMessage"]
    right = episode(Q.country, f"The capital of {Q.country} is {ROW['capital']}.")
    assert score(examples + right, Q) == score(right, Q)
    assert score(examples + episode(None, "No idea."), Q)["tool_calls"] == 0.0


def test_the_printed_episode_starts_at_the_question():
    from art_langgraph.demo import show_episode

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "example question"},
            {"role": "assistant", "content": "example answer"},
            {"role": "user", "content": Q.text}, {"role": "assistant", "content": "Velmor."}]
    text = show_episode("step 0", {"messages": msgs, "reward": 1.0})
    assert Q.text in text and "example" not in text and "Velmor." in text
