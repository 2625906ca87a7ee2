"""Issue 40: a generator that cannot write tasks for a server fails in one attempt, with one
line that says how to go on; an attempt's requests run at once, under a progress bar; and every
failure a user can fix ends `art mcp-train` / `art autorl` with one line on stderr and exit
status 2, never a traceback. No engine starts here (the real run is in the report of issue 40:
`art mcp-train --generator embedded ... -- python tests/support/library_server.py`)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from art_core import Model
from art_mcp import ScenarioError, ServerSpec, generate_scenarios
from art_mcp.cli import CommandError, autorl_main, check_server, expected_error, finish, main
from art_mcp.scenarios import request_sizes
from ruler.testing import ScriptedJudge

ROOT = Path(__file__).resolve().parents[2]
LIBRARY_SERVER = [sys.executable, str(ROOT / "tests/support/library_server.py")]
TOOLS = [{"type": "function", "function": {
    "name": "search_catalogue", "description": "Find books by title or author.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}]


def asked(prompt: str) -> int:
    """How many tasks a scenario request asks for ("Write 7 diverse ...")."""
    return int(re.search(r"Write (\d+) diverse", prompt).group(1))


def tasks(kind: str, k: int, start: int) -> str:
    """An answer of `k` distinct tasks: about the tools ("related"), or not ("unrelated")."""
    text = {"related": "Find the books by author number {}.",
            "unrelated": "Translate poem {} into French."}[kind]
    return json.dumps({"scenarios": [{"task": text.format(start + i), "difficulty": 2}
                                     for i in range(k)]})


class Writer:
    """A scripted generator server's answers, one per request in arrival order: (kind, count)
    with kind "related" (tasks about the tools), "unrelated" or "refusal" (no JSON), and count
    the tasks written (None: as many as asked); the last one repeats. Every task is distinct."""

    def __init__(self, *answers: tuple[str, int | None]) -> None:
        self.answers, self.written = list(answers), 0

    def __call__(self, body: dict[str, Any]) -> str:
        kind, count = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if kind == "refusal":
            return "I cannot help with that."
        k = count if count is not None else asked(body["messages"][1]["content"])
        self.written += k
        return tasks(kind, k, self.written)


NOTHING, REFUSAL = ("unrelated", None), ("refusal", None)


@pytest.mark.parametrize(("answers", "requests", "attempts", "early"), [
    # 16 asked: the first attempt asks 20 in 3 requests (7, 7, 6); nothing usable: give up
    ([NOTHING], 3, 1, True),
    # 3 valid (under a quarter; 3 x 4 attempts < 16): give up too
    ([("related", 3), NOTHING], 3, 1, True),
    # answers with no tasks in them: the generator did answer; give up
    ([("related", 0)], 3, 1, True),
    # refusals (no JSON) say nothing about what the generator can write: all 4 attempts
    ([REFUSAL], 12, 4, False),
    # 5 valid (a quarter or more): go on; each later attempt asks 13 in 2 requests (7, 6)
    ([("related", 5), NOTHING], 3 + 2 + 2 + 2, 4, False),
])
async def test_a_generator_with_nothing_usable_gives_up_in_one_line(
        answers: list[tuple[str, int | None]], requests: int, attempts: int, early: bool) -> None:
    with ScriptedJudge(Writer(*answers)) as llm, pytest.raises(ScenarioError) as e:
        await generate_scenarios(16, tools=TOOLS, generator=Model(name="g", base_url=llm.api_base),
                                 show_progress=False)
    message = str(e.value)
    assert len(llm.requests) == requests
    assert "\n" not in message
    assert f"scenarios of 16 in {attempts} attempt" in message
    assert ("stopped early" in message) is early
    assert "--scenarios FILE" in message and "--generator MODEL" in message
    if answers == [NOTHING]:
        assert message.startswith("the generator gave 0 valid distinct scenarios of 16 in 1 "
                                  "attempt (stopped early")
        assert "shares no term with the tools: 20" in message
        assert "does not seem to understand these tools" in message


async def test_allow_fewer_takes_what_comes_without_stopping_early() -> None:
    with ScriptedJudge(Writer(("related", 3), NOTHING)) as llm:
        got = await generate_scenarios(16, tools=TOOLS, allow_fewer=True, show_progress=False,
                                       generator=Model(name="g", base_url=llm.api_base))
    # after the first attempt 13 are missing: 13 + 3 asked in 2 requests (8, 8) per attempt
    assert len(got) == 3 and len(llm.requests) == 3 + 2 + 2 + 2


@pytest.mark.parametrize(("k", "batch_size", "concurrency", "sizes"), [
    (4, 20, 4, [4]),                   # too few to split: one request
    (7, 20, 4, [7]),
    (20, 20, 4, [7, 7, 6]),            # 16 asked (+ a margin of 4): three at once
    (50, 20, 4, [13, 13, 12, 12]),
    (100, 20, 4, [20] * 5),            # batch_size bounds a request: a fifth one waits
    (20, 20, 1, [20]),
    (20, 5, 1, [5, 5, 5, 5]),
])
def test_request_sizes(k: int, batch_size: int, concurrency: int, sizes: list[int]) -> None:
    assert request_sizes(k, batch_size, concurrency) == sizes


class InFlight:
    """A generator (an `art_core.Model` to `ask_json`: `name`, `openai_client()`) whose answers
    wait until `expect` requests are in flight, and which records the most at once. Requests
    sent one at a time would never get there (the wait's limit only turns a hang into a
    failure)."""

    def __init__(self, expect: int) -> None:
        self.name, self.expect = "gen", expect
        self.now = self.most = self.written = 0
        self.prompts: list[str] = []
        self.gate = asyncio.Event()
        self.chat = SimpleNamespace(completions=self)

    def openai_client(self, timeout: float) -> InFlight:
        return self

    async def close(self) -> None:
        pass

    async def create(self, *, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        self.prompts.append(messages[1]["content"])
        self.now += 1
        self.most = max(self.most, self.now)
        if self.now >= self.expect:
            self.gate.set()
        await asyncio.wait_for(self.gate.wait(), 60)
        self.now -= 1
        k = asked(messages[1]["content"])
        self.written += k
        content = tasks("related", k, self.written)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=content))])


@pytest.mark.parametrize(("concurrency", "sizes"), [(4, [6, 7, 7]), (2, [10, 10]), (1, [20])])
async def test_the_requests_of_an_attempt_are_in_flight_at_once(concurrency: int,
                                                                 sizes: list[int]) -> None:
    gen = InFlight(expect=len(sizes))  # 16 asked: 20 in one attempt, split by `concurrency`
    got = await generate_scenarios(16, tools=TOOLS, generator=gen, concurrency=concurrency,
                                   show_progress=False)
    assert len(got) == 16
    assert gen.most == len(sizes)
    assert sorted(asked(p) for p in gen.prompts) == sizes


async def test_the_progress_bar_counts_valid_scenarios_as_answers_arrive(capsys) -> None:
    # 12 asked: 15 in two requests (8, 7); the first answer to arrive fills 7 or 8 of 12
    with ScriptedJudge(Writer(("related", None))) as llm:
        await generate_scenarios(12, tools=TOOLS, generator=Model(name="g", base_url=llm.api_base))
    bar = capsys.readouterr().err
    shown = [int(n) for n in re.findall(r"(\d+)/12 \[", bar)]
    assert shown[0] == 0 and shown[-1] == 12
    assert {7, 8} & set(shown)  # one step between: the bar moved per answer, not per attempt
    assert "scenarios: 100%" in bar and "attempt=1/4" in bar


async def test_the_library_server_lists_its_tools() -> None:
    tools = await check_server(ServerSpec(command=LIBRARY_SERVER))
    assert tools == ["marc_lookup", "z3950_search", "place_hold", "ill_request"]


def one_line(err: str, prog: str = "art mcp-train") -> str:
    """The message of the one error line `err` must be."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0].removeprefix(f"{prog}: error: ")


SERVER = ["--", *LIBRARY_SERVER]
JUDGED = ["--judge", "embedded", "--generator", "embedded"]


def scenario_files(tmp_path: Path) -> dict[str, str]:
    """{placeholder: path} of scenario files the table below names."""
    task = '{"task": "Find the books by Calvino."}\n'
    files = {"{no-task}": task + '{"difficulty": 2}\n', "{one-task}": task + task}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return {name: str(tmp_path / name) for name in files}


@pytest.mark.parametrize(("argv", "message"), [
    (["--judge", "embedded", "--scenarios", "/nonexistent/tasks.jsonl", *SERVER],
     "--scenarios: No such file or directory: /nonexistent/tasks.jsonl"),
    (["--judge", "embedded", "--scenarios", "{no-task}", *SERVER], ":2: invalid scenario: task: "),
    (["--judge", "embedded", "--scenarios", "{one-task}", *SERVER],
     "1 distinct tasks; at least 2 are needed"),
    ([*JUDGED, "--examples", "/nonexistent.json", *SERVER], "--examples: [Errno 2]"),
    ([*JUDGED, "--examples", str(ROOT / "README.md"), *SERVER], f"--examples: {ROOT}/README.md"),
    ([*JUDGED, "--env", "ART_TEST_UNSET_VARIABLE", *SERVER],
     "--env ART_TEST_UNSET_VARIABLE: not set in this environment"),
    (["--generator", "embedded", "--reward", "no_such_module:reward", *SERVER],
     "--reward no_such_module:reward: No module named 'no_such_module'"),
    ([*JUDGED, "--turn-reward", f"{ROOT}/examples/mcp_server_inventory.py:no_such", *SERVER],
     f"--turn-reward {ROOT}/examples/mcp_server_inventory.py:no_such: "),
    ([*JUDGED, "--", "/nonexistent/server"],
     "cannot start or connect to the MCP server '/nonexistent/server': /nonexistent/server: "
     "command not found"),
    ([*JUDGED, "--", sys.executable, "/nonexistent/server.py"],
     "it exited before answering; its last line on stderr: "),
    ([*JUDGED, "--url", "http://127.0.0.1:1/mcp"],
     "cannot start or connect to the MCP server 'http://127.0.0.1:1/mcp': ConnectError"),
    (["--generator", "embedded", "--judge", "openai/judge", "--judge-api-base",
      "http://127.0.0.1:1/v1", *SERVER], "--judge-api-base http://127.0.0.1:1/v1: cannot connect"),
    (["--generator", "embedded", "--judge", "openai/o4-mini", *SERVER],
     "--judge openai/o4-mini: set OPENAI_API_KEY"),
    (["--generator", "no-provider", "--judge", "embedded", *SERVER],
     "--generator no-provider: not a model litellm can route"),
])
def test_each_failure_is_one_line_and_status_2(argv: list[str], message: str, tmp_path: Path,
                                                capsys, monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("ART_TEST_UNSET_VARIABLE", raising=False)
    files = scenario_files(tmp_path)
    assert main([files.get(a, a) for a in argv]) == 2
    assert message in one_line(capsys.readouterr().err)


@pytest.mark.parametrize(("argv", "message"), [
    (["Triage support emails into billing or bugs.", "--generator", "no-provider"],
     "--generator no-provider: not a model litellm can route"),
    (["Triage support emails into billing or bugs.", "--judge", "openai/judge",
      "--judge-api-base", "http://127.0.0.1:1/v1"], "--judge-api-base http://127.0.0.1:1/v1"),
])
def test_autorl_failures_are_one_line_too(argv: list[str], message: str, capsys) -> None:
    assert autorl_main(argv) == 2
    assert message in one_line(capsys.readouterr().err, "art autorl")


def test_a_description_too_short_is_an_argument_error(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        autorl_main(["triage emails"])
    assert e.value.code == 2 and "describe the task in a few sentences" in capsys.readouterr().err


def _engine_error() -> Exception:
    from art_core.inference.vllm_args import EngineError

    return EngineError("vLLM exited with code 1 during start-up.\nINFO starting\n"
                       "ModuleNotFoundError: No module named 'vllm'\n")


def _connection_error() -> Exception:
    import httpx
    import openai

    return openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:1/v1/x"))


@pytest.mark.parametrize(("error", "message"), [
    (lambda: ScenarioError("the generator gave 2 valid distinct scenarios of 16 in 1 attempt"),
     "the generator gave 2 valid distinct scenarios of 16 in 1 attempt"),
    (lambda: CommandError("several\nlines\n  joined"), "several lines joined"),
    (_connection_error, "a model request failed at http://127.0.0.1:1/v1/x: APIConnectionError"),
    (_engine_error, "the inference engine failed: vLLM exited with code 1 during start-up. (its "
                    "log ends: ModuleNotFoundError: No module named 'vllm')"),
    (lambda: ModuleNotFoundError("No module named 'peft'", name="peft"),
     "this command needs the package 'peft'"),
])
def test_expected_errors_become_one_line(error: Any, message: str, capsys) -> None:
    def run() -> int:
        raise error()

    assert finish("art mcp-train", run) == 2
    assert one_line(capsys.readouterr().err).startswith(message)


def test_a_bug_keeps_its_traceback() -> None:
    assert expected_error(KeyError("step")) is None
    with pytest.raises(KeyError):
        finish("art mcp-train", lambda: {}["step"])


def test_the_art_command_exits_2_with_one_line() -> None:
    art = Path(sys.executable).parent / "art"
    done = subprocess.run([str(art), "mcp-train", *JUDGED, "--", "/nonexistent/server"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2
    assert "command not found" in one_line(done.stderr)
    assert done.stdout == ""
