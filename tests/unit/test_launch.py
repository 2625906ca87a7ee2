"""`art launch`: the SkyPilot task is parsed and validated by the real `sky` library (its task
and resources YAML schemas, name and run checks), the install hint shows without the extra, and `art serve`'s idle
exit (what lets SkyPilot's auto-stop fire) works. No cloud is contacted."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from art_core.cli import app
from art_core.launch import INSTALL_HINT, LaunchConfig
from art_core.serve.idle import ActivityTracker, exit_when_idle

ROOT = Path(__file__).resolve().parents[2]


SKY_PYTHON = ROOT / ".venv-sky" / "bin" / "python"


def test_sky_parses_and_validates_the_task():
    """The real `sky` library (in .venv-sky) parses and validates our tasks: tests/support/sky_checks.py."""
    if not SKY_PYTHON.exists():
        pytest.fail(f"{SKY_PYTHON} is missing: run `bash scripts/setup.sh --dev` (make test does)")
    out = subprocess.run([str(SKY_PYTHON), str(ROOT / "tests" / "support" / "sky_checks.py")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 tasks validated, bad task refused" in out.stdout


def test_launch_without_the_extra_prints_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "sky", None)  # what `import sky` sees without the extra
    result = CliRunner().invoke(app, ["launch", "--dryrun"])
    assert result.exit_code == 1
    assert INSTALL_HINT in result.output
    result = CliRunner().invoke(app, ["down"])
    assert result.exit_code == 1 and "art-agents[launch]" in result.output


def test_launch_config_is_strict():
    with pytest.raises(ValueError):
        LaunchConfig(clustr="x")  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        LaunchConfig(cluster="Bad_Name")


async def test_idle_exit_counts_requests_but_not_health_checks():
    async def asgi(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    tracker = ActivityTracker(asgi)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=tracker),
                                 base_url="http://t") as client:
        tracker.last_activity = time.monotonic() - 100
        await client.get("/health")
        assert tracker.idle_seconds() >= 100  # health checks are not use
        await client.post("/v1/chat/completions")
        assert tracker.idle_seconds() < 50  # reset by the request (it was 100)

    stopped: list[float] = []
    busy = [True]
    task = asyncio.create_task(exit_when_idle(
        tracker, minutes=0.002, busy=lambda: busy[0], stop=lambda: stopped.append(1),
        poll_s=0.02))
    await asyncio.sleep(0.3)
    assert not stopped  # a training step running is not idleness
    busy[0] = False
    await asyncio.wait_for(task, 2)
    assert stopped == [1]
