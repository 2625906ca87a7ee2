"""RecordingSession and the MCP agent loop against real MCP servers (subprocesses over stdio,
and once over streamable HTTP on 127.0.0.1). The model here is a scripted OpenAI-compatible
server (`ruler.testing.ScriptedJudge`) answering JSON actions, so each step is exact; the same
loop against the real engine is in test_mcp_engine.py."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from art_core import GatherError, Model, Trajectory, gather_trajectory_groups, recording
from art_mcp import (
    AgentConfig,
    RecordingSession,
    ServerGone,
    ServerSpec,
    WorkedExample,
    agent_messages,
    connect,
    run_agent,
)
from ruler.testing import ScriptedJudge

ROOT = Path(__file__).resolve().parents[2]
INVENTORY = ServerSpec(command=[sys.executable, str(ROOT / "examples/mcp_server_inventory.py")])

TEST_SERVER = '''
import asyncio, os
from mcp.server.mcpserver import MCPServer
s = MCPServer("test", log_level="WARNING")

@s.tool()
async def echo(text: str) -> str:
    """Echo the text."""
    return text

@s.tool()
async def hang() -> str:
    """Never answers."""
    await asyncio.sleep(3600)
    return "never"

@s.tool()
async def crash() -> str:
    """The server process dies."""
    os._exit(3)

@s.tool()
async def big(n: int) -> str:
    """n characters."""
    return "x" * n

s.run("stdio")
'''


@pytest.fixture(scope="module")
def test_server(tmp_path_factory: pytest.TempPathFactory) -> ServerSpec:
    path = tmp_path_factory.mktemp("srv") / "server.py"
    path.write_text(TEST_SERVER)
    return ServerSpec(command=[sys.executable, str(path)])


def call(name: str, args: dict, call_id: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": name, "arguments": json.dumps(args)}}]}


async def test_stdio_records_tools_calls_results_and_errors_in_order(tmp_path: Path) -> None:
    traj = Trajectory(messages=[{"role": "user", "content": "restock"}])
    async with connect(INVENTORY, workdir=tmp_path) as session:
        with recording(traj):
            await session.list_tools()
            steps = [("look_up", {"item": "pen"}, "c1"), ("add_stock", {"item": "pen", "quantity": 5}, "c2"),
                     ("look_up", {"item": "unicorn"}, "c3"), ("remove_stock", {"item": "tape", "quantity": 1}, "c4")]
            for name, args, cid in steps:
                traj.messages.append(call(name, args, cid))
                await session.call_tool(name, args)  # matched by name + arguments, no id given
        outside = await session.call_tool("look_up", {"item": "pen"})  # no recording: nothing
    assert [t["function"]["name"] for t in traj.tools] == [
        "list_items", "look_up", "add_stock", "remove_stock", "move_item"]
    assert traj.tools[2]["function"]["parameters"]["required"] == ["item", "quantity"]
    tool_msgs = [m for m in traj.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ["c1", "c2", "c3", "c4"]
    assert tool_msgs[0]["content"] == "pen: 40 on shelf A1"
    assert tool_msgs[1]["content"] == "pen: 40 -> 45"
    assert "Input should be 'pen'" in tool_msgs[2]["content"]  # the schema's enum, enforced
    assert "only 0 tape in stock" in tool_msgs[3]["content"]
    assert traj.metrics["tool_calls"] == 4 and traj.metrics["tool_errors"] == 2
    assert len(traj.messages) == 9 and outside.content[0].text == "pen: 45 on shelf A1"
    Trajectory.model_validate(traj.model_dump())  # every tool message answers a call


async def test_streamable_http_records_like_stdio(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*INVENTORY.command, "--http", "--port", str(port),
                             "--db", str(tmp_path / "inv.db")], stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/mcp"
        for _ in range(100):  # wait for the port
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        traj = Trajectory(messages=[{"role": "user", "content": "move"}])
        async with connect(ServerSpec(url=url)) as session:
            with recording(traj):
                await session.list_tools()
                traj.messages.append(call("move_item", {"item": "glue", "shelf": "a9"}, "h1"))
                await session.call_tool("move_item", {"item": "glue", "shelf": "a9"},
                                        tool_call_id="h1")
        assert len(traj.tools) == 5
        assert traj.messages[-1] == {"role": "tool", "tool_call_id": "h1",
                                     "content": "glue: shelf D2 -> A9"}
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(("tool", "args", "expect"), [
    ("hang", {}, "timed out"),
    ("big", {"n": 5000}, "[... cut: 4900 more characters not shown]"),
    ("crash", {}, "connection closed"),
])
async def test_hang_cut_and_crash_are_recorded(test_server: ServerSpec, tool: str, args: dict,
                                               expect: str) -> None:
    traj = Trajectory(messages=[call(tool, args, "x1")])
    async with connect(test_server, timeout_s=1.0, max_result_chars=100) as session:
        with recording(traj):
            try:
                await session.call_tool(tool, args)
            except Exception as e:
                raised = e
            else:
                raised = None
        if tool == "crash":  # the session knows the server is gone: later calls fail at once
            assert session.closed
            with pytest.raises(ServerGone):
                await session.call_tool("echo", {"text": "hi"})
    assert expect in traj.messages[-1]["content"]
    assert (raised is None) == (tool == "big")
    assert traj.metrics["tool_errors"] == (0 if tool == "big" else 1)


def actions(*acts: dict) -> list[str]:
    return [json.dumps(a) for a in acts]


async def test_agent_loop_runs_calls_until_complete_task(tmp_path: Path) -> None:
    script = actions({"name": "look_up", "arguments": {"item": "stapler"}},
                     {"name": "remove_stock", "arguments": {"item": "stapler", "quantity": 9}},
                     {"name": "remove_stock", "arguments": {"item": "stapler", "quantity": 2}},
                     {"name": "complete_task", "arguments": {"summary": "sold 2 staplers"}})
    with ScriptedJudge(script) as llm:
        model = Model(name="scripted", base_url=llm.api_base)
        async with connect(INVENTORY, workdir=tmp_path) as session:
            traj = await run_agent(model, session, "We sold 2 staplers.",
                                   config=AgentConfig(action_format="json"))
        request = llm.requests[0]
    assert request["response_format"]["json_schema"]["strict"] is True
    names = [o["properties"]["name"]["enum"][0]
             for o in request["response_format"]["json_schema"]["schema"]["anyOf"]]
    assert names[-1] == "complete_task" and len(names) == 6
    roles = [m["role"] for m in traj.messages]
    assert roles == ["system", "user"] + ["assistant", "tool"] * 4
    assert "only 5 stapler in stock" in traj.messages[5]["content"]
    assert traj.messages[7]["content"] == "stapler: 5 -> 3"
    assert traj.messages[-1]["content"] == "Task complete."
    expected = {"turns": 4, "tool_calls": 3, "tool_errors": 1, "completed": True,
                "ran_out_of_turns": False}
    assert {k: traj.metrics[k] for k in expected} == expected
    assert traj.metrics["untrainable_turns"] == 4  # a scripted server sends no token ids
    assert traj.metadata["summary"] == "sold 2 staplers"
    assert len(traj.tools) == 6


async def test_worked_examples_come_before_the_task_as_earlier_turns(tmp_path: Path) -> None:
    example = WorkedExample.parse({
        "task": "Move the glue to shelf E2.", "summary": "Moved it.",
        "calls": [{"name": "move_item", "arguments": {"item": "glue", "shelf": "E2"},
                   "result": "glue: shelf D2 -> E2"}]})
    script = actions({"name": "complete_task", "arguments": {"summary": "nothing to do"}})
    with ScriptedJudge(script) as llm:
        async with connect(INVENTORY, workdir=tmp_path) as session:
            traj = await run_agent(Model(name="m", base_url=llm.api_base), session, "Add a pen.",
                                   config=AgentConfig(action_format="json", examples=[example]))
        sent = llm.requests[0]["messages"]
    roles = [m["role"] for m in sent]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "user"]
    assert sent[1]["content"] == "Move the glue to shelf E2." and sent[-1]["content"] == "Add a pen."
    (move,), (done,) = sent[2]["tool_calls"], sent[4]["tool_calls"]
    assert [sent[3]["tool_call_id"], sent[5]["tool_call_id"]] == [move["id"], done["id"]]
    assert json.loads(move["function"]["arguments"]) == {"item": "glue", "shelf": "E2"}
    assert done["function"]["name"] == "complete_task" and sent[5]["content"] == "Task complete."
    # the examples are context: the rollout's own calls and metrics start after them
    assert traj.messages[:7] == sent and traj.metrics["turns"] == 1
    assert traj.metrics["tool_calls"] == 0 and traj.metrics["completed"] is True
    # a reward reads the agent's own part: from the task on, no example call in it
    own = agent_messages(traj)
    assert own[0] == {"role": "user", "content": "Add a pen."}
    assert [m["role"] for m in own] == ["user", "assistant", "tool"]
    assert not any(c["id"].startswith("example_") for m in own for c in m.get("tool_calls") or [])


@pytest.mark.parametrize(("data", "message"), [
    ({"calls": [], "summary": "s"}, "a worked example is"),
    ({"task": "t", "calls": "move", "summary": "s"}, "a worked example is"),
    ({"task": "t", "calls": [{"name": "x", "arguments": {}}], "summary": "s"}, "result (str)"),
    ({"task": "t", "calls": [{"name": "x", "arguments": [1], "result": ""}], "summary": "s"},
     "arguments (object)"),
])
def test_a_malformed_worked_example_is_refused(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WorkedExample.parse(data)


def test_the_inventory_worked_examples_load() -> None:
    examples = WorkedExample.load(ROOT / "examples/data/inventory_examples.json")
    assert len(examples) == 2 and all(ex.calls for ex in examples)


async def test_agent_loop_stops_at_the_turn_limit(tmp_path: Path) -> None:
    with ScriptedJudge(actions(*[{"name": "list_items", "arguments": {}}] * 3)) as llm:
        async with connect(INVENTORY, workdir=tmp_path) as session:
            traj = await run_agent(Model(name="m", base_url=llm.api_base), session, "look",
                                   config=AgentConfig(max_turns=3, action_format="json"))
    assert traj.metrics["ran_out_of_turns"] is True and traj.metrics["completed"] is False
    assert traj.metrics["turns"] == 3 and traj.metrics["tool_calls"] == 3


async def test_crash_fails_its_rollout_hang_is_cut_and_the_gather_goes_on(
        test_server: ServerSpec) -> None:
    """Three rollouts: one crashes its server, one hits a hanging tool, one is fine."""
    def reply(body: dict) -> str:
        task = body["messages"][1]["content"]
        if body["messages"][-1]["role"] == "tool":
            return json.dumps({"name": "complete_task", "arguments": {"summary": "done"}})
        return json.dumps({"name": task, "arguments": {"text": "hi"} if task == "echo" else {}})

    with ScriptedJudge(reply) as llm:
        model = Model(name="m", base_url=llm.api_base)
        cfg = AgentConfig(tool_timeout_s=1.0, action_format="json")

        async def one(task: str) -> Trajectory:
            async with connect(test_server) as session:
                return await run_agent(model, session, task, config=cfg)

        # a hang is cut by tool_timeout_s (asserted below); pytest-timeout catches a real hang
        groups = await gather_trajectory_groups([[one("crash"), one("hang"), one("echo")]],
                                                max_exceptions=1, show_progress=False)
        with pytest.raises(GatherError):
            await gather_trajectory_groups([[one("crash")]], show_progress=False)
    (group,) = groups
    assert len(group.exceptions) == 1 and group.exceptions[0].type == "ServerGone"
    hang, echo = group.trajectories
    assert "timed out" in hang.messages[3]["content"] and hang.metrics["completed"]
    assert echo.messages[3]["content"] == "hi" and echo.metrics["tool_errors"] == 0


async def test_parallel_native_calls_are_recorded_in_call_order(test_server: ServerSpec) -> None:
    traj = Trajectory(messages=[{"role": "user", "content": "x"}])
    calls = [{"id": f"p{i}", "type": "function",
              "function": {"name": "echo", "arguments": json.dumps({"text": str(i)})}}
             for i in range(4)] + [{"id": "bad", "type": "function",
                                    "function": {"name": "echo", "arguments": "{oops"}}]
    traj.messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    from art_mcp.agent import _run_calls

    async with connect(test_server) as session:
        assert isinstance(session, RecordingSession)
        done = await _run_calls(traj, session, calls)
    assert not done
    assert [m["tool_call_id"] for m in traj.messages[2:]] == ["p0", "p1", "p2", "p3", "bad"]
    assert [m["content"] for m in traj.messages[2:6]] == ["0", "1", "2", "3"]
    assert "not a JSON object" in traj.messages[-1]["content"]
    assert traj.metrics["tool_errors"] == 1


def test_import_art_mcp_is_light() -> None:
    code = ("import sys, art_mcp; bad = [m for m in ('mcp', 'litellm', 'torch', 'vllm') "
            "if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


async def test_server_spec_needs_exactly_one_target() -> None:
    for kwargs in ({}, {"command": ["x"], "url": "http://h"}, {"command": []}):
        with pytest.raises(ValueError):
            ServerSpec(**kwargs)
    await asyncio.sleep(0)
