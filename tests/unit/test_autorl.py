"""AutoRL against a scripted OpenAI-compatible server (policy, generator and judge are three
model names on one `ScriptedJudge`) and a scripted backend (the `Backend` protocol: it counts
steps and keeps the groups it is given; no engine, no training). Checked: scenarios written
from the description (validated, de-duplicated, split without overlap, saved and reloaded), the
derived rubric is exactly what the judge receives, a resumed run reuses the saved scenarios and
prompts, and Python functions are offered as tools and executed."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from art_core import Model, TrainableModel, TrajectoryGroup
from art_core.model import Endpoint, TrainResult
from art_core.storage import ModelDir
from art_mcp.autorl import TOOLS_HINT, Prompts, autorl, derive_prompts, template_prompts
from art_mcp.cli import autorl_main
from art_mcp.functions import FunctionSession, function_tool
from art_mcp.scenarios import load_scenarios, normalize
from ruler.prompt import SYSTEM_PROMPT
from ruler.testing import Reply, ScriptedJudge
from tests.support.data import load_example

TASK = ("Triage a customer support email into billing, bug or feature request, "
        "and draft a short reply.")
RUBRIC = "- The category is right.\n- The reply is polite and answers the email."
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "autorl.py"
SYSTEM = "You triage support emails. Say the category first, then draft a reply."


class ScriptedBackend:
    """A `Backend` that serves the scripted endpoint and only counts training steps (kept in
    the run directory, so a second instance resumes)."""

    def __init__(self, root: Path, base_url: str) -> None:
        self.root, self.base_url = root, base_url
        self.trained: list[list[TrajectoryGroup]] = []

    def _step_file(self, model: TrainableModel) -> Path:
        return ModelDir(self.root, model.project, model.name).path / "step"

    async def register(self, model: TrainableModel) -> Endpoint:
        self._step_file(model).parent.mkdir(parents=True, exist_ok=True)
        return Endpoint(base_url=self.base_url, api_key="x")

    async def get_step(self, model: TrainableModel) -> int:
        f = self._step_file(model)
        return int(f.read_text()) if f.exists() else 0

    async def train(self, model: TrainableModel, groups: list[TrajectoryGroup],
                    config: Any = None, **kwargs: Any) -> TrainResult:
        self.trained.append(groups)
        step = await self.get_step(model) + 1
        self._step_file(model).write_text(str(step))
        rewards = [t.reward for g in groups for t in g]
        return TrainResult(step=step, metrics={"reward_mean": sum(rewards) / len(rewards),
                                               "loss": 0.0, "seconds": 0.0})

    async def delete_checkpoints(self, model: TrainableModel, metric: str = "") -> list[int]:
        return []

    async def close(self) -> None:
        pass


def scenarios_answer(*tasks: str, difficulty: object = 2) -> str:
    return json.dumps({"scenarios": [{"task": t, "difficulty": difficulty} for t in tasks]})


EMAILS = [f"Email {i}: my invoice {i} charged me twice for plan {chr(65 + i)}." for i in range(6)]


class World:
    """Answers by model name: "gen" (scenarios, prompts), "judge" (listwise scores), else the
    policy (numbered answers, or scripted tool calls)."""

    def __init__(self, scenario_answers: list[str], prompts: str | None = None,
                 policy: Any = None, judge_mode: str = "listwise") -> None:
        self.scenario_answers = list(scenario_answers)
        self.judge_mode = judge_mode
        self.prompts = prompts or json.dumps({"system_prompt": SYSTEM, "rubric": RUBRIC})
        self.policy = policy
        self.n = 0

    def __call__(self, body: dict[str, Any]) -> Reply | str:
        if body["model"] == "gen":
            if body["response_format"]["json_schema"]["name"] == "autorl_prompts":
                return self.prompts
            if not self.scenario_answers:
                return Reply(status=500, error="the generator was asked again")
            return self.scenario_answers.pop(0)
        if body["model"] == "judge" and self.judge_mode == "yesno":
            return Reply(top_logprobs={"Yes": -0.5, "No": -1.0})
        if body["model"] == "judge":
            ids = re.findall(r'<trajectory id="(\d+)">', body["messages"][-1]["content"])
            return json.dumps({"scores": [
                {"trajectory_id": i, "explanation": f"judged {i}", "score": int(i) / len(ids)}
                for i in ids]})
        self.n += 1
        if self.policy is not None:
            return self.policy(body)
        return f"Billing. Dear customer, we refund you (answer {self.n})."

    def requests(self, server: ScriptedJudge, model: str) -> list[dict[str, Any]]:
        return [r for r in server.requests if r["model"] == model]


async def run(server: ScriptedJudge, tmp_path: Path, **kw: Any) -> Any:
    backend = ScriptedBackend(tmp_path, server.api_base)
    defaults = dict(model=TrainableModel(name="agent", project="autorl"), backend=backend,
                    generator=Model(name="gen", base_url=server.api_base), judge="openai/judge",
                    judge_kwargs={"api_base": server.api_base, "api_key": "x",
                                  "mode": "listwise", "cache": False},
                    n_scenarios=6, held_out=2, steps=1, groups_per_step=2, rollouts_per_group=2,
                    eval_rollouts=2, print_fn=lambda s: None)
    result = await autorl(TASK, **{**defaults, **kw})
    return result, backend


async def test_scenarios_from_the_description_validated_deduped_split_and_saved(tmp_path):
    world = World([
        scenarios_answer(EMAILS[0], EMAILS[0].upper(), "Hi", EMAILS[1], EMAILS[2]),  # dup, short
        "Sure! " + scenarios_answer(EMAILS[3], difficulty=9) + " done",  # bad difficulty
        scenarios_answer(EMAILS[3], EMAILS[4], EMAILS[5], EMAILS[1]),  # EMAILS[1] again: dup
    ])
    with ScriptedJudge(world) as server:
        result, _ = await run(server, tmp_path)
        gen = world.requests(server, "gen")
    asked = [r for r in gen if r["response_format"]["json_schema"]["name"] == "scenarios"]
    assert len(asked) == 3
    assert f"What the agent is for:\n{TASK}" in asked[0]["messages"][1]["content"]
    assert f"- {EMAILS[0]}" in asked[1]["messages"][1]["content"]  # told what it already wrote
    run_dir = result.run_dir / "autorl"
    train = load_scenarios(run_dir / "scenarios.train.jsonl")
    held = load_scenarios(run_dir / "scenarios.heldout.jsonl")
    assert (len(train), len(held)) == (4, 2) == (result.train_scenarios, result.held_out_scenarios)
    assert sorted(s.task for s in train + held) == sorted(EMAILS)
    assert not {normalize(s.task) for s in train} & {normalize(s.task) for s in held}
    generated = load_scenarios(run_dir / "scenarios.generated.jsonl")
    assert [s.task for s in generated] == [EMAILS[i] for i in (0, 1, 2, 3, 4, 5)]
    assert json.loads((run_dir / "task.json").read_text())["description"] == TASK


@pytest.mark.parametrize("mode", ["listwise", "yesno"])
async def test_the_derived_rubric_is_exactly_what_the_judge_receives(tmp_path, mode):
    world = World([scenarios_answer(*EMAILS)], judge_mode=mode)
    with ScriptedJudge(world) as server:
        result, backend = await run(server, tmp_path, judge_kwargs={
            "api_base": server.api_base, "api_key": "x", "mode": mode, "cache": False})
        judged = world.requests(server, "judge")
        policy = world.requests(server, "agent")
    assert result.prompts == Prompts(system_prompt=SYSTEM, rubric=RUBRIC, source="generator")
    saved = json.loads((result.run_dir / "autorl" / "prompts.json").read_text())
    assert (saved["system_prompt"], saved["rubric"]) == (SYSTEM, RUBRIC)
    assert judged
    for r in judged:
        if mode == "listwise":
            assert r["messages"][0]["content"] == SYSTEM_PROMPT.format(rubric=RUBRIC)
        else:
            assert f"Criteria: {RUBRIC}\n" in r["messages"][-1]["content"]
    assert policy and all(r["messages"][0] == {"role": "system", "content": SYSTEM}
                          for r in policy)
    # every trained trajectory was scored by the judge, not left at the default reward
    trained = [t for g in backend.trained[0] for t in g]
    assert len(trained) == 4 and all("ruler_score" in t.metrics for t in trained)


async def test_a_resumed_run_reuses_the_saved_scenarios_and_prompts(tmp_path):
    world = World([scenarios_answer(*EMAILS)])
    with ScriptedJudge(world) as server:
        first, _ = await run(server, tmp_path)
        asked_first = len(world.requests(server, "gen"))
        run_dir = first.run_dir / "autorl"
        files = {p.name: p.read_text() for p in run_dir.glob("scenarios.*.jsonl")}
        second, _ = await run(server, tmp_path)  # the generator has nothing left: 500 if asked
        assert len(world.requests(server, "gen")) == asked_first == 2
        lines: list[str] = []
        third, _ = await run(server, tmp_path, rubric="- Only the category matters.",
                             print_fn=lines.append)
        assert "- Only the category matters." in world.requests(
            server, "judge")[-1]["messages"][0]["content"]
    assert {p.name: p.read_text() for p in run_dir.glob("scenarios.*.jsonl")} == files
    assert (first.before.step, first.after.step) == (0, 1)
    assert (second.before.step, second.after.step) == (1, 2)
    assert second.before == first.after  # step 1's evaluation is read back, not run again
    assert second.prompts == first.prompts
    assert third.prompts.rubric == "- Only the category matters." and third.prompts.source == "given"
    assert third.prompts.system_prompt == SYSTEM
    saved = json.loads((run_dir / "prompts.json").read_text())
    assert saved["rubric"] == "- Only the category matters."
    assert any("Only the category matters" in line for line in lines)
    assert "RULER score (mean)" in second.table and "judged side by side" in second.table
    assert "judged " in second.table and "example autorl-" in second.table
    with pytest.raises(ValueError, match="another task description"):
        await autorl("Write haiku about the sea, five of them.", path=tmp_path,
                     model=TrainableModel(name="agent", project="autorl"),
                     backend=ScriptedBackend(tmp_path, "http://127.0.0.1:1/v1"))


ORDERS = {"A-1": "shipped", "B-2": "lost"}
CALLS: list[str] = []


def lookup_order(order_id: str) -> str:
    """Look up the status of an order.

    Args:
        order_id: The order number, like "A-1".
    """
    CALLS.append(order_id)
    if order_id not in ORDERS:
        raise KeyError(f"no order {order_id}")
    return ORDERS[order_id]


async def test_tools_given_as_functions_are_offered_and_executed(tmp_path):
    CALLS.clear()
    tasks = [f"Customer {i} asks where order {'A-1' if i % 2 else 'Z-9'} is, {i} days late."
             for i in range(6)]

    def agent(body: dict[str, Any]) -> Reply:
        done = any(m["role"] == "tool" for m in body["messages"])
        if done:
            return Reply(tool_calls=[("complete_task", {"summary": "It has shipped."})])
        order = re.search(r"order (\S+) is", body["messages"][1]["content"]).group(1)
        return Reply(tool_calls=[("lookup_order", {"order_id": order})])

    world = World([scenarios_answer(*tasks)], policy=agent)
    with ScriptedJudge(world) as server:
        result, backend = await run(server, tmp_path, tools=[lookup_order])
        policy = world.requests(server, "agent")
        gen = world.requests(server, "gen")
    offered = {t["function"]["name"]: t for t in policy[0]["tools"]}
    assert set(offered) == {"lookup_order", "complete_task"}
    schema = offered["lookup_order"]["function"]
    assert schema["strict"] is True and schema["description"] == "Look up the status of an order."
    assert schema["parameters"]["properties"]["order_id"] == {
        "type": "string", "description": 'The order number, like "A-1".'}
    assert policy[0]["tool_choice"] == "required"
    assert TOOLS_HINT in policy[0]["messages"][0]["content"]  # the agent is told how to finish
    assert "lookup_order" in gen[0]["messages"][1]["content"]  # the generator saw the tools
    assert len(CALLS) == len([r for r in policy if not any(m["role"] == "tool"
                                                          for m in r["messages"])])
    traj = backend.trained[0][0].trajectories[0]
    results = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert results[0] in ("shipped", "Error: KeyError: 'no order Z-9'")
    assert results[-1] == "Task complete." and traj.metrics["completed"]
    assert traj.metrics["tool_calls"] == 1
    assert "tool errors / rollout" in result.table


@pytest.mark.parametrize(("answers", "source"), [
    ([json.dumps({"system_prompt": SYSTEM, "rubric": RUBRIC})], "generator"),
    (["no json at all", json.dumps({"system_prompt": "short", "rubric": RUBRIC}),
      json.dumps({"rubric": RUBRIC})], "template"),
    # valid JSON that a small generator looped in, or that is about something else
    ([json.dumps({"system_prompt": SYSTEM, "rubric": "- it's a payment gate, " * 12}),
      json.dumps({"system_prompt": "Write poems about the sea and the moon at night.",
                  "rubric": RUBRIC}),
      json.dumps({"system_prompt": SYSTEM, "rubric": "the the the the " * 10})], "template"),
])
async def test_derive_prompts_validates_and_falls_back_to_the_template(answers, source):
    with ScriptedJudge(answers) as server:
        prompts, problems = await derive_prompts(TASK, Model(name="gen", base_url=server.api_base))
        sent = server.requests[0]
    assert prompts.source == source and len(problems) == (3 if source == "template" else 0)
    assert TASK in sent["messages"][1]["content"]
    assert sent["response_format"]["json_schema"]["name"] == "autorl_prompts"
    if source == "template":
        assert prompts == template_prompts(TASK)
        assert TASK in prompts.system_prompt and TASK in prompts.rubric


def test_template_prompts_with_tools_say_how_to_finish():
    assert TOOLS_HINT in template_prompts(TASK, tools=True).system_prompt
    assert TOOLS_HINT not in template_prompts(TASK).system_prompt


def sphinx(amount: float, note: str = "", *rest: Any, **extra: Any) -> dict:
    """Refund an amount.

    :param amount: How much, in euros.
    :param note: Why.
    """
    return {"refunded": amount}


def bare(x, count: int | None = None):
    return x


@pytest.mark.parametrize(("fn", "description", "properties", "required"), [
    (lookup_order, "Look up the status of an order.",
     {"order_id": {"type": "string", "description": 'The order number, like "A-1".'}},
     ["order_id"]),
    (sphinx, "Refund an amount.",
     {"amount": {"type": "number", "description": "How much, in euros."},
      "note": {"type": "string", "default": "", "description": "Why."}}, ["amount"]),
    (bare, "", {"x": {"type": "string"},
                "count": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}},
     ["x"]),
])
def test_function_tool_schema(fn, description, properties, required):
    tool = function_tool(fn)["function"]
    assert (tool["name"], tool["description"]) == (fn.__name__, description)
    assert tool["parameters"]["properties"] == properties
    assert tool["parameters"].get("required", []) == required
    assert tool["parameters"]["type"] == "object"


async def test_function_session_reports_failures_as_results():
    def long() -> str:
        """A long result."""
        return "x" * 300

    async def slow() -> None:
        """Never answers in time."""
        import asyncio

        await asyncio.sleep(60)

    # 1 s: the tools that answer must not time out on a busy machine; `slow` does
    session = FunctionSession([lookup_order, sphinx, long, slow], timeout_s=1.0,
                              max_result_chars=200)
    ok = await session.call_tool("sphinx", {"amount": 2.5})
    assert (ok.content, ok.structured, ok.is_error) == ('{"refunded": 2.5}', {"refunded": 2.5},
                                                        False)
    cases = {"lookup_order": ({"order": "A-1"}, "invalid arguments for lookup_order"),
             "nope": ({}, "no tool named 'nope'")}
    for name, (arguments, message) in cases.items():
        event = await session.call_tool(name, arguments)
        assert event.is_error and message in event.content
    cut = await session.call_tool("long")
    assert cut.content == "x" * 200 + "\n[... 100 more characters cut]" and not cut.is_error
    hung = await session.call_tool("slow")
    assert hung.is_error and "slow took more than 1 s" in hung.content
    raised = await session.call_tool("lookup_order", {"order_id": "Q"})
    assert raised.is_error and raised.content.startswith("Error: KeyError")
    with pytest.raises(ValueError, match="two tools"):
        FunctionSession([lookup_order, lookup_order])


@pytest.mark.parametrize(("argv", "message"), [
    ([], "description"),
    ([TASK, "--rollouts-per-group", "1"], "--rollouts-per-group must be at least 2"),
    ([TASK, "--tools", "no_colon"], "expected FILE.py:FUNCTION"),
    ([TASK, "--rubric", "@/nonexistent/rubric.txt"], "No such file"),
    ([TASK, "--judge-mode", "shout"], "invalid choice"),
    ([TASK, "--tools", f"{EXAMPLE}:nope"], "has no 'nope'"),
    ([TASK, "--oversample", "0"], "--oversample must be at least 1"),
])
def test_cli_bad_arguments_fail_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        autorl_main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err




@pytest.mark.parametrize("tools", [False, True])
async def test_the_example_in_its_smallest_setting_on_a_scripted_server(tmp_path, tools):
    example = load_example("autorl")
    cfg = example.CPU_SMOKE

    def policy(body: dict[str, Any]) -> Reply | str:
        if not tools:
            return "Billing. Dear customer, sorry for the double charge."
        if any(m["role"] == "tool" for m in body["messages"]):
            return Reply(tool_calls=[("complete_task", {"summary": "Billing: refund sent."})])
        return Reply(tool_calls=[("lookup_account", {"email": "li@example.com"})])

    world = World([scenarios_answer(*EMAILS)], policy=policy)
    with ScriptedJudge(world) as server:
        backend = ScriptedBackend(tmp_path, server.api_base)
        result = await example.run(
            cfg, path=str(tmp_path), tools=tools, backend=backend,
            generator=Model(name="gen", base_url=server.api_base), judge="openai/judge",
            judge_kwargs={"api_base": server.api_base, "api_key": "x", "mode": "listwise",
                          "cache": False}, print_fn=lambda s: None)
        policy_requests = world.requests(server, "triage-agent")
    assert (result.before.step, result.after.step) == (0, cfg.steps)
    assert len(backend.trained) == cfg.steps
    assert (result.train_scenarios, result.held_out_scenarios) == (4, 2)
    assert policy_requests[0]["max_tokens"] == cfg.max_tokens
    if tools:
        traj = backend.trained[0][0].trajectories[0]
        assert [m["content"] for m in traj.messages if m["role"] == "tool"][0] == \
            example.ACCOUNTS["li@example.com"]
    assert "held-out: 2 scenarios x 2 rollouts" in result.table


def test_tools_load_from_a_file_that_defines_dataclasses():
    from art_mcp.cli import load_function

    lookup = load_function(f"{EXAMPLE}:lookup_account")  # the example has a @dataclass
    assert lookup("ana@example.com").startswith("plan Pro")
    assert load_function(f"{EXAMPLE}:lookup_account") is lookup  # loaded once


def test_the_example_documents_its_settings():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert "--cpu-smoke" in out and "art autorl" in out
