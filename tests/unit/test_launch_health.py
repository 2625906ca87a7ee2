"""`art launch`'s decisions, without a cloud: `wait_healthy` against a real HTTP server on
127.0.0.1, `launch_backend`'s reuse of a cluster (up and healthy: no launch, the saved key;
up but unhealthy: the serve job again; stopped or absent: `sky.launch`), and the training
processes the task's run script gives `art serve` (run by bash against a stand-in `art`).

SkyPilot itself is not installed here (it lives in .venv-sky, where tests/support/sky_checks.py checks
our task with it); `launch_backend` takes the SDK as a parameter, so these tests pass a
stand-in that implements the few calls it makes and records them.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from art_core.cli import app
from art_core.launch import LaunchConfig, LaunchError, launch_backend, task_config, wait_healthy

OK = (200, {"status": "ok"})
STARTING = (503, {"status": "starting"})


class HealthServer:
    """A real HTTP server on 127.0.0.1 whose /health gives the scripted answers in order; the
    last one repeats. `answers` may be replaced while it runs."""

    def __init__(self, answers: list[tuple[int, dict[str, Any]]]) -> None:
        self.answers = list(answers)
        self.hits = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the http.server API)
                status, body = outer.answers[min(outer.hits, len(outer.answers) - 1)]
                outer.hits += 1
                data = json.dumps(body).encode()
                self.send_response(status if self.path == "/health" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def health() -> Iterator[Callable[[list], HealthServer]]:
    servers: list[HealthServer] = []

    def start(answers: list) -> HealthServer:
        servers.append(HealthServer(answers))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("answers, error", [
    ([STARTING, OK], None),                 # healthy on the second poll
    ([STARTING], "HTTP 503"),               # never healthy
    ([(200, {"status": "starting"})], "HTTP 200"),  # answers, but not ok
    (None, "ConnectError"),                 # nothing listens
])
def test_wait_healthy(health, answers, error):
    url = health(answers).url if answers else closed_port_url()
    if error is None:
        wait_healthy(url, timeout_s=10, poll_s=0.05)
        return
    with pytest.raises(LaunchError) as e:
        wait_healthy(url, timeout_s=0.5, poll_s=0.05)
    assert f"{url}/health" in str(e.value) and error in str(e.value)


def test_wait_healthy_polls_until_ok(health):
    server = health([STARTING, STARTING, OK])
    wait_healthy(server.url, timeout_s=10, poll_s=0.05)
    assert server.hits == 3


class StandInSky:
    """The SkyPilot SDK calls `launch_backend` makes. Requests are returned as they are, so
    `get`/`stream_and_get` just hand them back; `launch` and `exec` run `on_start` (the serve
    job starting) and every call is recorded."""

    def __init__(self, cluster_status: str | None, endpoint: str,
                 on_start: Callable[[], None]) -> None:
        self.cluster_status, self.endpoint, self.on_start = cluster_status, endpoint, on_start
        self.calls: list[str] = []
        self.tasks: list[dict[str, Any]] = []
        sky = self

        class Task:
            def __init__(self, config: dict[str, Any]) -> None:
                self.config = config

            @classmethod
            def from_yaml_config(cls, config: dict[str, Any]) -> Task:
                sky.tasks.append(config)
                return cls(config)

            def validate_name(self) -> None:
                pass

            def validate_run(self) -> None:
                pass

        self.Task = Task

    def get(self, request: Any) -> Any:
        return request

    def stream_and_get(self, request: Any) -> Any:
        return request

    def status(self, names: list[str]) -> list[dict[str, str]]:
        self.calls.append("status")
        return [{"name": names[0], "status": self.cluster_status}] if self.cluster_status else []

    def endpoints(self, cluster: str, port: int) -> dict[int, str]:
        return {port: self.endpoint.removeprefix("http://")}

    def launch(self, task: Any, cluster_name: str, dryrun: bool = False) -> None:
        self.calls.append("launch --dryrun" if dryrun else "launch")
        if not dryrun:
            self.on_start()

    def exec(self, task: Any, cluster_name: str) -> None:
        self.calls.append("exec")
        self.on_start()


SAVED = "saved-key"


@pytest.mark.parametrize("case, cluster_status, answers, saved, calls", [
    ("up and healthy: reused", "UP", [OK], SAVED, ["status"]),
    ("up, server gone: serve again", "UP", [STARTING], SAVED, ["status", "exec"]),
    ("stopped: launch restarts it", "STOPPED", [STARTING], SAVED, ["status", "launch"]),
    ("absent: launch, new key", None, [STARTING], None, ["status", "launch"]),
])
def test_launch_backend_reuses_what_it_can(health, tmp_path, monkeypatch, case,
                                           cluster_status, answers, saved, calls):
    monkeypatch.setenv("ART_HOME", str(tmp_path))
    state = tmp_path / "launch" / "art.json"
    if saved:
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"api_key": saved, "port": 7999}))
    server = health(answers)
    sky = StandInSky(cluster_status, server.url,
                     on_start=lambda: server.answers.__setitem__(slice(None), [OK]))
    cfg = LaunchConfig(reuse_timeout_s=0.3, health_timeout_s=10)
    backend = launch_backend(cfg, sky=sky)
    assert sky.calls == calls, case
    assert backend is not None and backend.base_url == server.url
    if saved:
        assert backend.api_key == SAVED
    else:
        assert backend.api_key and len(backend.api_key) >= 40
    # the server was started with the key the client got, and the key is kept, privately
    assert sky.tasks[-1]["secrets"] == {"ART_API_KEY": backend.api_key}
    kept = json.loads(state.read_text())
    assert kept["api_key"] == backend.api_key
    assert stat.S_IMODE(state.stat().st_mode) == 0o600


def test_launch_backend_dryrun_only_plans(health, tmp_path, monkeypatch):
    monkeypatch.setenv("ART_HOME", str(tmp_path))
    sky = StandInSky("UP", health([OK]).url, on_start=lambda: None)
    assert launch_backend(LaunchConfig(), dryrun=True, sky=sky) is None
    assert sky.calls == ["launch --dryrun"]
    assert not (tmp_path / "launch" / "art.json").exists()


def serve_args(task: dict[str, Any], home: Any) -> list[str]:
    """The arguments the task's run script gives `art serve`: bash runs it with the task's
    envs and a stand-in ~/art-venv/bin/art that prints them, one a line."""
    art = home / "art-venv" / "bin" / "art"
    art.parent.mkdir(parents=True, exist_ok=True)
    art.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    art.chmod(0o755)
    env = {**os.environ, **task["envs"], "HOME": str(home), "ART_API_KEY": "k"}
    out = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True,
                         timeout=30, check=True)
    return out.stdout.splitlines()


@pytest.mark.parametrize("accelerators, train_processes, expected", [
    ("L4:1", None, 1),          # the default: one GPU, one process
    ("L4", None, 1),            # no count: SkyPilot reads it as 1
    ("A100:4", None, 4),        # one process per GPU
    ("H100:8", None, 8),
    ("24GB+:2", None, 2),       # a memory spec with a count
    ("nvidia:24GB", None, 1),   # manufacturer and memory, no count
    ("A100:0.5", None, 1),      # a fractional GPU still trains in one process
    ("H100:8", 2, 2),           # explicit: fewer ranks than GPUs
    ("A100:4", 4, 4),
])
def test_serve_trains_on_one_process_per_gpu(tmp_path, accelerators, train_processes,
                                             expected):
    cfg = LaunchConfig(accelerators=accelerators, train_processes=train_processes)
    assert cfg.train_process_count() == expected
    args = serve_args(task_config(cfg, "k" * 43), tmp_path)
    assert args[0] == "serve"
    assert args[args.index("--train-processes") + 1] == str(expected)
    assert args[args.index("--port") + 1] == "7999"  # the other flags expand as before


@pytest.mark.parametrize("accelerators, train_processes, error", [
    ("L4", 2, "1 GPU(s)"),          # more processes than GPUs: refused before any launch
    ("A100:4", 5, "4 GPU(s)"),
    ("A100:0.5", 2, "0.5 GPU(s)"),
    ("A100:4", 0, "greater than or equal to 1"),
    ("A100:4", True, "valid integer"),  # strict: a bool is not a count
    ("A100:4", "2", "valid integer"),
])
def test_bad_train_processes_are_refused(accelerators, train_processes, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        LaunchConfig(accelerators=accelerators, train_processes=train_processes)


def test_launch_cli_refuses_more_processes_than_gpus():
    # refused by LaunchConfig before SkyPilot is imported, with exit code 2 and no traceback
    result = CliRunner().invoke(app, ["launch", "--gpus", "L4:1", "--train-processes", "2"])
    assert result.exit_code == 2, result.output
    assert "train_processes=2" in result.output and "1 GPU(s)" in result.output
