"""BFCL without an engine: the checker's verdicts and the tool conversion through the worker in
the side environment (.venv-bfcl), the split, the table, and that every BFCL tool of the three
forced-call categories is one the gateway can enforce (art_bfcl/)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from art_bfcl.checker import BFCL_VERSION, BfclWorker, Item, Verdict, unavailable_reason
from art_bfcl.tasks import (
    CATEGORIES,
    OPEN_CATEGORIES,
    Prompting,
    Split,
    make_split,
    summarize,
    table,
)

ROOT = Path(__file__).resolve().parents[2]
needs_worker = pytest.mark.skipif(unavailable_reason() is not None,
                                  reason=str(unavailable_reason()))


@pytest.fixture(scope="module")
def worker():
    with BfclWorker() as w:
        yield w


@pytest.fixture(scope="module")
def items(worker) -> dict[str, dict[str, Item]]:
    return {c: {i.id: i for i in worker.load(c)} for c in (*CATEGORIES, *OPEN_CATEGORIES)}


def call(name: str, **args) -> dict:
    return {"id": f"call_{name}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def test_setup_installs_the_version_the_code_is_written_against():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.findall(r'"bfcl-eval==([^"]+)"', setup) == [BFCL_VERSION]


@needs_worker
def test_worker_reports_its_version(worker):
    assert worker.version == BFCL_VERSION


@needs_worker
@pytest.mark.parametrize("category,item_id,calls,content,valid,error_type,matched", [
    # simple_python_0: calculate_triangle_area(base=10, height=5), unit optional ("units")
    ("simple_python", "simple_python_0", [call("calculate_triangle_area", base=10, height=5)],
     None, True, None, 1),
    ("simple_python", "simple_python_0",
     [call("calculate_triangle_area", base=10, height=5, unit="units")], None, True, None, 1),
    ("simple_python", "simple_python_0", [call("calculate_triangle_area", base=10, height=6)],
     None, False, "value_error:others", 0),
    ("simple_python", "simple_python_0", [call("calculate_triangle_area", base=10)], None,
     False, "simple_function_checker:missing_required", 0),
    ("simple_python", "simple_python_0", [call("calculate_triangle_area", base="10", height=5)],
     None, False, "type_error:simple", 0),
    ("simple_python", "simple_python_0", [], "The area is 25.", False,
     "ast_decoder:decoder_failed", 0),
    # a right call repeated: a wrong count, one expected call matched
    ("simple_python", "simple_python_0",
     [call("calculate_triangle_area", base=10, height=5)] * 2, None, False,
     "simple_function_checker:wrong_count", 1),
    # "." in a name became "_" in the tool (OpenAI forbids "."); the checker maps it back
    ("simple_python", "simple_python_1", [call("math_factorial", number=5)], None, True, None, 1),
    # multiple_0: triangle_properties.get(side1=5, side2=4, side3=3) among other functions
    ("multiple", "multiple_0", [call("triangle_properties_get", side1=5, side2=4, side3=3)],
     None, True, None, 1),
    ("multiple", "multiple_0", [call("circle_properties_get", radius=5.0)], None, False,
     "simple_function_checker:wrong_func_name", 0),
    # parallel_0: spotify.play twice, in any order
    ("parallel", "parallel_0", [call("spotify_play", artist="Maroon 5", duration=15),
                                call("spotify_play", artist="Taylor Swift", duration=20)],
     None, True, None, 2),
    ("parallel", "parallel_0", [call("spotify_play", artist="Taylor Swift", duration=20)],
     None, False, "parallel_function_checker_no_order:wrong_count", 1),
    # the count right, one call wrong or repeated: each expected call pairs with one call
    ("parallel", "parallel_0", [call("spotify_play", artist="Maroon 5", duration=15),
                                call("spotify_play", artist="Taylor Swift", duration=25)],
     None, False, "parallel_function_checker_no_order:cannot_find_match", 1),
    ("parallel", "parallel_0", [call("spotify_play", artist="Maroon 5", duration=15)] * 2,
     None, False, "parallel_function_checker_no_order:cannot_find_match", 1),
    # irrelevance_0: a BMI function offered for a question it cannot answer; BFCL's relevance
    # rule passes any answer that makes no call, and fails any call, however well formed
    ("irrelevance", "irrelevance_0", [], "I cannot do that with these tools.", True, None, 0),
    ("irrelevance", "irrelevance_0", [], None, True, None, 0),
    ("irrelevance", "irrelevance_0", [call("determine_body_mass_index", weight=70, height=1.75)],
     None, False, "irrelevance_error:decoder_success", 0),
])
def test_checker_verdicts(worker, items, category, item_id, calls, content, valid, error_type,
                          matched):
    item = items[category][item_id]
    verdict = worker.check(item, {"content": content, "tool_calls": calls})
    assert verdict.valid is valid
    assert verdict.error_type == error_type
    assert bool(verdict.error) is not valid
    # per-call credit: the ground truth's calls a call of the answer passes, one to one
    assert (verdict.matched, verdict.expected) == (matched, len(item.ground_truth))


@needs_worker
def test_bad_requests_are_clear_errors(worker, items):
    ghost = Item("simple_python_9999", "simple_python", [], [], [])
    with pytest.raises(ValueError, match="no item 'simple_python_9999'"):
        worker.check(ghost, {"content": "x"})
    with pytest.raises(ValueError, match="unknown category 'sql'"):
        worker.load("sql")
    # the worker keeps serving after an error
    assert worker.check(items["simple_python"]["simple_python_1"],
                        {"tool_calls": [call("math_factorial", number=5)]}).valid


@needs_worker
def test_tools_are_converted_as_bfcl_openai_handler_does(items):
    """simple_python_30: kinematics.final_velocity_from_distance(acceleration: integer,
    distance: integer, initial_velocity: float), parameters of type "dict"."""
    item = items["simple_python"]["simple_python_30"]
    assert len(item.tools) == 1 and item.tools[0]["type"] == "function"
    fn = item.tools[0]["function"]
    assert fn["name"] == "kinematics_final_velocity_from_distance"
    assert fn["description"].endswith("Note that the provided function is in Python 3 syntax.")
    params = fn["parameters"]
    assert params["type"] == "object"  # BFCL's "dict"
    props = params["properties"]
    assert props["acceleration"]["type"] == "integer"
    assert props["initial_velocity"]["type"] == "number"
    assert props["initial_velocity"]["format"] == "float"
    assert props["initial_velocity"]["description"].endswith("This is a float type value.")
    assert item.messages == [{"role": "user", "content": item.messages[0]["content"]}]
    types = {p.get("type") for c in items.values() for i in c.values()
             for t in i.tools for p in t["function"]["parameters"]["properties"].values()}
    assert types <= {"string", "integer", "number", "boolean", "array", "object"}


@needs_worker
def test_every_tool_compiles_to_the_gateways_strict_grammar(items):
    from art_core.inference.tool_calls import plan_tools

    for category in CATEGORIES:
        for item in items[category].values():
            plan = plan_tools({"tools": item.tools, "tool_choice": "required",
                               "parallel_tool_calls": True})
            assert plan is not None and plan.forced and len(plan.tools) == len(item.tools)


def fake_items(n: int, category: str) -> list[Item]:
    return [Item(f"{category}_{k}", category, [], [], []) for k in range(n)]


def test_split_is_deterministic_disjoint_and_saved(tmp_path):
    items = fake_items(40, "simple_python") + fake_items(20, "multiple")
    held = {"simple_python": 10, "multiple": 5}
    split = make_split(items, held, seed=3)
    assert split == make_split(list(reversed(items)), held, seed=3)  # order of data: no matter
    assert split != make_split(items, held, seed=4)
    for cat, n in held.items():
        assert len(split.held_out[cat]) == n
        assert not set(split.held_out[cat]) & set(split.train[cat])
        assert set(split.held_out[cat]) | set(split.train[cat]) == {
            i.id for i in items if i.category == cat}
    split.save(tmp_path / "split.json")
    assert Split.load(tmp_path / "split.json") == split
    assert split.bfcl_version == BFCL_VERSION


def test_split_caps_training_items_and_refuses_holding_out_everything(tmp_path):
    items = fake_items(10, "parallel")
    split = make_split(items, {"parallel": 3}, train={"parallel": 4})
    assert len(split.train["parallel"]) == 4
    assert split.train["parallel"] == make_split(items, {"parallel": 3}).train["parallel"][:4]
    with pytest.raises(ValueError, match="has 10 items"):
        make_split(items, {"parallel": 10})
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json: not a saved BFCL split"):
        Split.load(tmp_path / "bad.json")


def test_table_counts_per_category_with_wilson_intervals():
    outcomes = ([("simple_python", Verdict(True))] * 3
                + [("simple_python", Verdict(False, "value_error:others"))] * 7
                + [("multiple", Verdict(False, "simple_function_checker:wrong_func_name"))] * 2
                + [("parallel", Verdict(True))] * 4)
    rows = summarize(outcomes)
    assert [(r.category, r.items, r.passed) for r in rows] == [
        ("simple_python", 10, 3), ("multiple", 2, 0), ("parallel", 4, 4),
        ("simple_python+multiple", 12, 3), ("all", 16, 7)]
    assert rows[0].errors == {"value_error:others": 7}
    assert rows[3].errors == {"value_error:others": 7, "simple_function_checker:wrong_func_name": 2}
    text = table(rows)
    assert "30.0%" in text and "[11%, 60%]" in text and "value_error:others 7" in text
    assert [(r.category, r.items) for r in summarize(outcomes[:10])] == [("simple_python", 10)]
    two = table({"step 0": rows[:1], "step 12": rows[:1]}).splitlines()
    assert two[1].startswith("step 0 ") and two[2].startswith("step 12 ")


@pytest.mark.parametrize("mode,category,parallel,choice", [
    ("always", "simple_python", True, "required"), ("never", "parallel", False, "required"),
    ("category", "parallel", True, "required"), ("category", "multiple", False, "required"),
    # whether to call is what irrelevance tests: never forced
    ("always", "irrelevance", True, "auto"), ("category", "irrelevance", False, "auto")])
def test_prompting_is_the_items_own_prompt_and_tools(mode, category, parallel, choice):
    item = Item("x", category, [{"role": "user", "content": "q"}], [{"type": "function"}], [])
    req = Prompting(parallel=mode).request(item)
    assert req["messages"] == item.messages and req["tools"] == item.tools
    assert req["tool_choice"] == choice and req["parallel_tool_calls"] is parallel


def test_a_missing_side_environment_is_a_clear_error(monkeypatch, tmp_path):
    from art_bfcl.checker import BfclUnavailable

    monkeypatch.setenv("BFCL_PYTHON", str(tmp_path / "nope" / "python"))
    with pytest.raises(BfclUnavailable, match=r"does not exist: .*scripts/setup.sh --dev"):
        BfclWorker()


@needs_worker
def test_the_examples_split_is_saved_and_a_different_one_refused(worker, tmp_path):
    from tests.support.data import load_example

    example = load_example("bfcl_rl")
    split = example.the_split(worker, tmp_path, seed=0)
    saved = json.loads((tmp_path / "split.json").read_text())
    assert saved["held_out"] == split.held_out and saved["bfcl_version"] == BFCL_VERSION
    for cat, n in example.HELD_OUT.items():
        assert len(split.held_out[cat]) == n
        assert not set(split.held_out[cat]) & set(split.train[cat])
    assert example.the_split(worker, tmp_path, seed=0) == split  # the next run reads it back
    with pytest.raises(SystemExit, match="split.json was made with other settings"):
        example.the_split(worker, tmp_path, seed=1)


@pytest.mark.parametrize(("argv", "message"), [
    (["--parallel-weight", "0"], "--parallel-weight must be positive, got 0.0"),
    (["--parallel-weight", "-2"], "--parallel-weight must be positive, got -2.0"),
    (["--parallel-weight", "two"], "argument --parallel-weight: invalid float value: 'two'"),
    (["--irrelevance-weight", "0"], "--irrelevance-weight must be positive, got 0.0"),
])
def test_the_examples_bad_options_are_refused_by_name(argv, message, capsys):
    """`parallel`'s weight goes to `train_loop(stratum_weights=...)` (its share of each step is
    tested in tests/unit/test_sampling.py); a weight that is not positive is refused before any
    engine starts."""
    from tests.support.data import load_example

    example = load_example("bfcl_rl")
    with pytest.raises(SystemExit):
        example.main(argv)
    assert message in capsys.readouterr().err


@needs_worker
def test_the_benchmark_asks_only_held_out_items_of_a_split(worker):
    from tests.support.data import load_benchmark

    bench = load_benchmark("bfcl_eval")
    items = worker.load("multiple")
    split = make_split(items, {"multiple": 20}, seed=5)
    chosen = bench.select(worker, ["multiple"], limit=None, split=split)
    assert {i.id for i in chosen} == set(split.held_out["multiple"])
    assert [i.id for i in bench.select(worker, ["multiple"], limit=3)] == [
        "multiple_0", "multiple_1", "multiple_2"]
    with pytest.raises(SystemExit, match="holds out nothing of 'parallel'"):
        bench.select(worker, ["parallel"], split=split)


@pytest.mark.parametrize(("argv", "message"), [
    (["--train-entries", "0"], "--train-entries must be positive, got 0"),
    (["--eval-entries", "-1"], "--eval-entries must be positive, got -1"),
    (["--sft-epochs", "0"], "--sft-epochs must be positive, got 0"),
    (["--credit", "token"], "argument --credit: invalid choice: 'token'"),
])
def test_the_multi_turn_examples_bad_options_are_refused_by_name(argv, message, capsys):
    from tests.support.data import load_example

    example = load_example("bfcl_multiturn_rl")
    with pytest.raises(SystemExit):
        example.main(argv)
    assert message in capsys.readouterr().err
