"""`art launch`'s decisions, without a cloud: `wait_healthy` against a real HTTP server on
127.0.0.1, and `launch_backend`'s reuse of a cluster (up and healthy: no launch, the saved key;
up but unhealthy: the serve job again; stopped or absent: `sky.launch`).

SkyPilot itself is not installed here (it lives in .venv-sky, where tests/sky_checks.py checks
our task with it); `launch_backend` takes the SDK as a parameter, so these tests pass a
stand-in that implements the few calls it makes and records them.
"""

from __future__ import annotations

import json
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from art_core.launch import LaunchConfig, LaunchError, launch_backend, wait_healthy

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
