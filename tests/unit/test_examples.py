"""The examples in examples/ without an engine: their command lines and the rules of their
worlds (tests/engine/test_examples.py runs each in its smallest setting)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.data import EXAMPLES
from tests.support.data import load_example as load


@pytest.mark.parametrize("name", ["game_2048", "email_agent", "ruler_rewards", "calculator_env"])
def test_example_cli_documents_its_settings(name):
    out = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--help"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "--cpu-smoke" in out


def test_2048_game_rules():
    game = load("game_2048").Game(0)
    game.board = [[2, 2, 4, 0], [0, 0, 0, 0], [0, 0, 0, 0], [2, 0, 0, 2]]
    assert game.move("left") and game.board[0][:2] == [4, 4] and game.board[3][0] == 4
    assert game.score == 8
    game.board = [[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]]
    assert game.stuck() and not game.move("left")


def test_email_inbox_answers_each_question_from_one_email():
    inbox = load("email_agent").Inbox(0)
    for q in inbox.questions:
        assert q.answer in inbox.read(q.email_id)
        hits = [h["id"] for h in json.loads(inbox.search(q.text))]
        assert q.email_id in hits
    assert inbox.search('") * NEAR(') == "[]"  # FTS5 syntax in keywords is only words


def test_the_lookup_tool_answers_from_the_table():
    module = load("langgraph_agent")
    assert "capital Velmor" in module.lookup_country.invoke({"country": "Zarnia"})
    assert "No country named" in module.lookup_country.invoke({"country": "Atlantis"})


@pytest.mark.parametrize("expression,result", [
    ("23 - 60 + 8", "-29"), ("4-1", "3"), (" 98 + 93 - 77 = ", "114"), ("-5 + 2", "-3"),
])
def test_the_calculator_adds_and_subtracts(expression, result):
    env = load("calculator_env").CalculatorEnv([])
    assert env.calculate(expression) == result


@pytest.mark.parametrize("expression", ["1.2.3", "8 - 8 - 1 = 3 x", "2 * 3", "", "import os"])
def test_the_calculator_refuses_what_is_not_a_sum(expression):
    with pytest.raises(ValueError, match="not an expression"):
        load("calculator_env").CalculatorEnv([]).calculate(expression)


def test_no_calculator_question_is_answered_by_one_of_its_own_numbers():
    import re

    questions = load("calculator_env").Questions(64, seed=0)
    assert len(questions) == 64
    for entry in questions:
        numbers = re.findall(r"\d+", entry["question"].split(":")[-1])
        assert len(numbers) >= 2 and entry["answer"] not in numbers


def test_the_calculator_environment_is_scored_by_reasoning_gym():
    module = load("calculator_env")
    questions = module.Questions(8, seed=3)
    from art_core.env.tools import tool_schemas

    env = module.CalculatorEnv(questions)
    assert [s["function"]["name"] for s in tool_schemas(env)] == ["answer", "calculate"]
    for i, entry in enumerate(questions):
        question = env.reset(index=i, prompt=module.PROMPT)
        assert question.strip() in entry["question"] and env.get_reward() == 0.0  # no answer yet
        env.answer(int(env.calculate(question)))
        assert env.get_reward() == 1.0
        env.answer(int(entry["answer"]) + 1)
        assert env.get_reward() == 0.0
