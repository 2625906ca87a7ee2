"""Scenario generation against a scripted OpenAI-compatible server (exact requests and
results), through both generator forms (litellm string and art_core.Model); loading and the
train/held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_core import Model
from art_mcp import Scenario, ScenarioError, generate_scenarios, load_scenarios, split_scenarios
from art_mcp.scenarios import normalize, parse_items
from ruler.testing import ScriptedJudge

TOOLS = [{"type": "function", "function": {
    "name": "add_stock", "description": "Add units of an item.",
    "parameters": {"type": "object", "properties": {"item": {"type": "string"},
                                                   "quantity": {"type": "integer"}}}}}]


def answer(*items: object) -> str:
    return json.dumps({"scenarios": list(items)})


def item(task: str, difficulty: object = 2) -> dict:
    return {"task": task, "difficulty": difficulty}


@pytest.mark.parametrize("form", ["litellm", "model"])
async def test_validates_dedupes_and_retries_until_enough(form: str, tmp_path: Path) -> None:
    script = [
        "I cannot do that.",                                       # no JSON: retried
        answer(item("Add 5 pens to the stock."), item("Add 5 pens to the stock!"),  # dup
               item("Add", 1), item("Add ten folders please", 9),  # too short, bad difficulty
               item("Record 3 staplers in the stock.", "4")),   # "4" is accepted as 4
        "Sure:\n```json\n" + answer(item("add 5 PENS to the stock"),  # dup of an earlier one
                                    item("We got 7 new markers; add them.", 1)) + "\n```",
    ]
    with ScriptedJudge(script) as llm:
        if form == "litellm":
            gen = dict(generator="openai/gen", api_base=llm.api_base, api_key="x")
        else:
            gen = dict(generator=Model(name="gen", base_url=llm.api_base))
        out = tmp_path / "s.jsonl"
        scenarios = await generate_scenarios(3, tools=TOOLS, out=out, **gen)
        requests = llm.requests
    assert [(s.id, s.task, s.difficulty) for s in scenarios] == [
        ("gen-0001", "Add 5 pens to the stock.", 2),
        ("gen-0002", "Record 3 staplers in the stock.", 4),
        ("gen-0003", "We got 7 new markers; add them.", 1)]
    assert len(requests) == 3
    first, last = requests[0], requests[-1]
    assert first["response_format"]["json_schema"]["strict"] is True
    assert "add_stock" in first["messages"][1]["content"]
    assert "Write 4 diverse" in first["messages"][1]["content"]  # 3 missing + a margin of 1
    # the retry asks only for what is missing and lists what was written
    assert "Write 2 diverse" in last["messages"][1]["content"]
    assert "- Add 5 pens to the stock." in last["messages"][1]["content"]
    assert load_scenarios(out) == scenarios


async def test_too_few_after_all_attempts_says_why() -> None:
    with ScriptedJudge([answer(item("Add 5 pens to the stock."))] * 2 + ["nope"]) as llm:
        gen = Model(name="gen", base_url=llm.api_base)
        with pytest.raises(ScenarioError, match=r"1 valid distinct scenarios of 2 in 3 attempts"
                           r".*duplicate: 1.*unusable answer"):
            await generate_scenarios(2, tools=TOOLS, generator=gen, max_attempts=3)
        llm.push(answer(item("Add 5 pens to the stock.")))
        few = await generate_scenarios(2, description="A stock room clerk.", generator=gen,
                                       max_attempts=1, allow_fewer=True)
        assert "What the agent is for:\nA stock room clerk." in llm.requests[-1]["messages"][1]["content"]
    assert [s.task for s in few] == ["Add 5 pens to the stock."]


async def test_existing_scenarios_are_not_repeated() -> None:
    existing = [Scenario(id="e1", task="Add 5 pens to the stock.")]
    script = [answer(item("Add 5 pens to the stock."), item("Add 2 glue sticks to the stock.", 2))]
    with ScriptedJudge(script) as llm:
        got = await generate_scenarios(1, tools=TOOLS, generator=Model(name="g", base_url=llm.api_base),
                                       existing=existing)
        assert "- Add 5 pens to the stock." in llm.requests[0]["messages"][1]["content"]
    assert [s.task for s in got] == ["Add 2 glue sticks to the stock."]


LIBRARY = [{"type": "function", "function": {
    "name": "search_catalogue", "description": "Find books by title or author.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "checkOutBook", "description": "Lend a copy.",
                                      "parameters": {"type": "object", "properties": {
                                          "isbn": {"type": "string"}}}}}]


async def test_tasks_no_tool_is_about_are_rejected_counted_and_warned(caplog) -> None:
    """What the embedded generator wrote for a library catalogue (8 of 8 unrelated)."""
    unrelated = ["Help law enforcement agencies.", "Translate different languages fluently.",
                 "Plan a trip to the mountains."]
    related = ["Find the books by Ursula Le Guin.", "Check out a copy of Dune for me."]
    with ScriptedJudge([answer(*[item(t) for t in unrelated + related])]) as llm:
        gen = Model(name="g", base_url=llm.api_base)
        with caplog.at_level("WARNING", logger="art_mcp.scenarios"):
            got = await generate_scenarios(2, tools=LIBRARY, generator=gen, max_attempts=1)
    assert [s.task for s in got] == related
    assert "3 of 5" in caplog.text and "share no term with the tools" in caplog.text
    with ScriptedJudge([answer(*[item(t) for t in unrelated])]) as llm, \
            pytest.raises(ScenarioError, match="shares no term with the tools: 3"):
        await generate_scenarios(1, tools=LIBRARY, max_attempts=1,
                                 generator=Model(name="g", base_url=llm.api_base))


@pytest.mark.parametrize(("content", "n"), [
    ('{"scenarios": [{"task": "a b c", "difficulty": 1}]}', 1),
    ('[{"task": "a b c", "difficulty": 1}, {"task": "d e f", "difficulty": 2}]', 2),
    ('Here you go: {"scenarios": []} hope it helps', 0),
])
def test_parse_items(content: str, n: int) -> None:
    assert len(parse_items(content)) == n


@pytest.mark.parametrize("content", ["", "no json", '{"tasks": 1}', "{broken"])
def test_parse_items_rejects(content: str) -> None:
    with pytest.raises(ValueError):
        parse_items(content)


@pytest.mark.parametrize(("line", "message"), [
    ('{"task": "Find the books by Calvino."', ":2: invalid scenario: Expecting ',' delimiter"),
    ('["Find the books by Calvino."]', ":2: invalid scenario: expected a JSON object, got list"),
    ('{"difficulty": 9}', ":2: invalid scenario: task: Field required; difficulty: Input should "
                          "be less than or equal to 5"),
])
def test_a_bad_scenario_line_is_named_in_one_line(line: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "s.jsonl"
    path.write_text('{"task": "Add 5 pens to the stock."}\n' + line + "\n")
    with pytest.raises(ValueError) as e:
        load_scenarios(path)
    assert str(e.value).startswith(f"{path}{message}") and "\n" not in str(e.value)


@pytest.mark.parametrize(("held_out", "sizes"), [(0.25, (6, 2)), (3, (5, 3)), (0.01, (7, 1)),
                                                  (100, (1, 7))])
def test_split_never_overlaps_and_is_reproducible(held_out: float, sizes: tuple) -> None:
    tasks = [f"Task number {i}." for i in range(8)] + ["TASK number 3"]  # a duplicate
    pool = [Scenario(id=str(i), task=t) for i, t in enumerate(tasks)]
    train, held = split_scenarios(pool, held_out, seed=1)
    assert (len(train), len(held)) == sizes
    assert not {normalize(s.task) for s in train} & {normalize(s.task) for s in held}
    assert split_scenarios(pool, held_out, seed=1) == (train, held)


def test_the_example_scenarios_load_with_their_expected_outcome() -> None:
    path = Path(__file__).resolve().parents[2] / "examples/data/inventory_scenarios.jsonl"
    scenarios = load_scenarios(path)
    assert len(scenarios) >= 40 and len({normalize(s.task) for s in scenarios}) == len(scenarios)
    assert all(s.model_dump()["expected"] for s in scenarios)
    assert {s.difficulty for s in scenarios} == {1, 2, 3, 4, 5}
