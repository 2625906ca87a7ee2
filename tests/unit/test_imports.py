"""`import art_core` stays light and fast; the `art` command line works."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import art_core
from art_core.cli import app

HEAVY = [
    "torch",
    "vllm",
    "transformers",
    "litellm",
    "peft",
    "langgraph",
    "langchain_core",
    "fastapi",
]

PROBE = f"""
import json, sys, time
t = time.perf_counter()
import art_core, art_core.cli
elapsed = time.perf_counter() - t
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({HEAVY!r}))
print(json.dumps({{"elapsed": elapsed, "heavy": heavy}}))
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*args], capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "100"}
    )


def test_import_is_light_and_fast():
    proc = _run(sys.executable, "-c", PROBE)
    assert proc.returncode == 0, proc.stderr
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    # what keeps the import fast is that nothing heavy is imported; its time (~0.2 s) is
    # measured by benchmarks/import_time.py, not bounded here (shared machines stall)
    assert probe["heavy"] == [], f"import art_core pulled in {probe['heavy']}"


@pytest.mark.parametrize("package", ["art_core", "ruler", "art_langgraph", "art_mcp"])
def test_public_api_resolves(package):
    # every name in __all__, lazy ones included, must import (a stale entry breaks `import *`)
    module = importlib.import_module(package)
    missing = [n for n in getattr(module, "__all__", []) if getattr(module, n, None) is None]
    assert not missing, f"{package}.__all__ names what it cannot import: {missing}"


def test_unknown_attribute_is_a_clear_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        art_core.nope  # noqa: B018


runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        (["--help"], 0, ["version", "demo", "reinforcement learning"]),
        (["version"], 0, [art_core.__version__]),
        (["--version"], 0, [art_core.__version__]),
        (["version", "--help"], 0, ["Print the installed art-agents version"]),
        (["no-such-command"], 2, ["No such command"]),
    ],
)
def test_cli_in_process(args, code, expected):
    result = runner.invoke(app, args)
    assert result.exit_code == code, result.output
    for text in expected:
        assert text in result.output


def test_version_prints_only_the_version():
    result = runner.invoke(app, ["version"])
    assert result.output == f"{art_core.__version__}\n"


@pytest.mark.parametrize(("blocked", "args", "expected"), [
    ("art_langgraph.demo", ["demo"], "art_langgraph.demo is not part of this install"),
    ("art_core.demos.brevity", ["demo", "--task", "brevity"], "art_core.demos.brevity is not part of this install"),
    ("art_core.serve.app", ["serve"], "art_core.serve.app is not part of this install"),
    ("fastapi", ["serve"], "pip install 'art-agents[backend]'"),
])
def test_command_without_its_modules_fails_clearly(monkeypatch, blocked, args, expected):
    # None in sys.modules makes the import fail as if the module were not installed
    for name in [blocked, "art_core.serve.app", "art_core.demos.brevity", "art_langgraph.demo"]:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, blocked, None)
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert expected in result.output


@pytest.mark.parametrize(
    ("returned", "code"), [(None, 0), (0, 0), (3, 3)], ids=["none", "zero", "three"]
)
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("task", "module"), [
    ([], "art_langgraph.demo"), (["--task", "agent"], "art_langgraph.demo"),
    (["--task", "brevity"], "art_core.demos.brevity")], ids=["default", "agent", "brevity"])
def test_demo_calls_main(monkeypatch, returned, code, is_async, task, module):
    import types

    calls = []
    fake = types.ModuleType(module)

    if is_async:

        async def main(argv):
            calls.append(("async", argv))
            return returned
    else:

        def main(argv):
            calls.append(("sync", argv))
            return returned

    fake.main = main
    monkeypatch.setitem(sys.modules, module, fake)
    result = runner.invoke(app, ["demo", *task, "--steps", "2"])
    assert calls == [("async" if is_async else "sync", ["--steps", "2"])]
    assert result.exit_code == code


def test_demo_rejects_an_unknown_task():
    result = runner.invoke(app, ["demo", "--task", "chess"])
    assert result.exit_code == 2 and "--task must be one of agent, brevity" in result.output


def test_demo_names_a_missing_dependency(monkeypatch):
    import importlib

    real = importlib.import_module

    def fake_import(name, *a, **k):
        if name == "art_langgraph.demo":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 1
    assert "needs the package 'torch'" in result.output
    assert "pip install 'art-agents[backend,langgraph]'" in result.output


def _art_command() -> list[str]:
    script = Path(sys.executable).parent / "art"
    if script.exists():
        return [str(script)]
    found = shutil.which("art")
    if found:
        return [found]
    return [
        sys.executable,
        "-c",
        "import sys; from art_core.cli import app; sys.argv[0] = 'art'; app()",
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [(["--help"], "Usage: art"), (["version"], art_core.__version__)],
)
def test_console_script(args, expected):
    proc = _run(*_art_command(), *args)
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("args", "code", "expected"), [
    (["--help"], 0, ["--rollouts-per-group", "reward = 1 - min(words, 40) / 40"]),
    (["--steps", "0"], 2, ["--steps must be at least 1"]),
    (["--rollouts-per-group", "1"], 2, ["--rollouts-per-group must be at least 2"]),
    (["--learning-rate", "3"], 2, ["--learning-rate must be between 0 and 1"]),
    (["--steps", "x"], 2, ["invalid int value"]),
])
def test_demo_options_reach_its_parser(capsys, args, code, expected):
    # the real art_core.demos.brevity: --help and bad values are answered before anything starts
    from art_core.demos.brevity import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == code
    out = capsys.readouterr()
    for needle in expected:
        assert needle in out.out + out.err


def test_art_demo_help_is_the_demos_own():
    proc = _run(sys.executable, "-m", "art_core.cli", "demo", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--groups-per-step" in proc.stdout and "usage: art demo" in proc.stdout

