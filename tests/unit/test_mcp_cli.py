"""`art mcp-train` argument checks, the reward loader, the before/after table, and a custom
`Recorder` (what the LangGraph recorder plugs in) receiving RecordingSession's events."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from art_core import ToolEvent, TrainConfig, Trajectory, recording
from art_core.loop import Rate
from art_mcp import ServerSpec, connect
from art_mcp.cli import load_function, main
from art_mcp.train import EvalStats, as_server, credit_config, format_table

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("argv", "message"), [
    ([], "either --url URL or -- COMMAND"),
    (["--url", "http://h/mcp", "--", "python", "s.py"], "either --url URL or -- COMMAND"),
    (["--scenarios", "s.jsonl", "--", "python", "s.py"], "--reward"),
    (["--judge", "embedded", "--", "python", "s.py"], "--scenarios FILE.jsonl or --generator"),
    (["--judge", "x", "--scenarios", "s", "--rollouts-per-group", "1", "--", "s"],
     "--rollouts-per-group must be at least 2"),
    (["--judge", "x", "--scenarios", "s", "--n-scenarios", "1", "--", "s"],
     "--n-scenarios must be at least 2"),
    (["--judge", "x", "--url", "http://h/mcp", "--env", "K=V", "--scenarios", "s"],
     "--env applies to a stdio server"),
    (["--judge", "x", "--scenarios", "s", "--oversample", "0.5", "--", "s"],
     "--oversample must be at least 1"),
])
def test_bad_arguments_fail_before_anything_starts(argv: list[str], message: str, capsys) -> None:
    """Argument errors are argparse's (usage, then the error); a bad file, server or model is
    one line (tests/unit/test_mcp_errors.py)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_load_function_from_a_file_or_a_module() -> None:
    reward = load_function(f"{ROOT}/examples/mcp_server_inventory.py:reward")
    assert reward.__name__ == "reward"
    assert load_function("art_mcp.train:format_table") is format_table
    with pytest.raises(ValueError):
        load_function("no_colon")


@pytest.mark.parametrize(("server", "expect"), [
    ("http://127.0.0.1:1/mcp", ServerSpec(url="http://127.0.0.1:1/mcp")),
    ("python s.py --db 'a b'", ServerSpec(command=["python", "s.py", "--db", "a b"])),
    (["python", "s.py"], ServerSpec(command=["python", "s.py"])),
])
def test_as_server(server: object, expect: ServerSpec) -> None:
    assert as_server(server) == expect


def test_table_shows_both_steps_and_intervals() -> None:
    def stats(step: int, completed: int) -> EvalStats:
        return EvalStats(step=step, scenarios=4, rollouts=8, failed=0, reward=completed / 8,
                         rates={"completed": Rate(completed, 8), "solved": Rate(1, 8)},
                         means={"tool_errors": 1.5, "turns": 3.0})

    table = format_table(stats(0, 2), stats(6, 6), verifiable=True)
    assert "held-out: 4 scenarios x 2 rollouts" in table
    assert "step 0" in table and "step 6" in table
    assert "0.25 [0.07, 0.59]" in table and "0.75 [0.41, 0.93]" in table
    assert "1.50" in table and "3.00" in table
    assert "solved" in table
    assert "solved" not in format_table(stats(0, 2), stats(6, 6), verifiable=False)


class CountingRecorder:
    """A recorder that builds no messages (like the LangGraph callback's): it only keeps events."""

    def __init__(self) -> None:
        self.trajectory = Trajectory()
        self.tools: list[dict] = []
        self.events: list[ToolEvent] = []

    def record_tools(self, tools: list[dict]) -> None:
        self.tools.extend(tools)

    def record_tool_event(self, event: ToolEvent) -> str | None:
        self.events.append(event)
        return event.tool_call_id


async def test_a_custom_recorder_gets_the_events(tmp_path: Path) -> None:
    server = ServerSpec(command=[sys.executable, str(ROOT / "examples/mcp_server_inventory.py")])
    recorder = CountingRecorder()
    async with connect(server, workdir=tmp_path) as session:
        with recording(recorder):
            await session.list_tools()
            await session.call_tool("look_up", {"item": "glue"}, tool_call_id="g1")
            await session.call_tool("add_stock", {"item": "glue", "quantity": -1})
    assert len(recorder.tools) == 5 and not recorder.trajectory.messages
    ok, bad = recorder.events
    assert (ok.name, ok.arguments, ok.tool_call_id) == ("look_up", {"item": "glue"}, "g1")
    assert ok.content == "glue: 15 on shelf D2" and not ok.is_error
    assert ok.structured == {"result": "glue: 15 on shelf D2"} and ok.duration_s > 0
    assert bad.is_error and "quantity must be a positive number" in bad.content
    assert bad.error is None  # a tool failure is a result, not a raised error


def turn_reward(trajectory: Trajectory, context: object, turn: int) -> float:
    return 0.0


@pytest.mark.parametrize(("config", "reward", "advantage", "warns"), [
    (None, None, None, False),  # no turn reward: the config as given (None: the loop's)
    (None, turn_reward, "turn", False),  # a turn reward and no config: trained on, per turn
    (TrainConfig(advantage="turn"), turn_reward, "turn", False),
    (TrainConfig(), turn_reward, "group", True),  # kept as asked, but said: only recorded
    (TrainConfig(), None, "group", False),
])
def test_a_turn_reward_gets_per_turn_credit_unless_a_config_says_otherwise(
        config, reward, advantage, warns, caplog) -> None:
    with caplog.at_level("WARNING", logger="art_mcp.train"):
        out = credit_config(config, reward)
    assert (out.advantage if out else None) == advantage
    assert ("only recorded" in caplog.text) is warns
