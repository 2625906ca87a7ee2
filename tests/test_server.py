"""`art serve` and `RemoteBackend`, against real server processes.

Two servers per module, both real `art serve` subprocesses on 127.0.0.1 with an API key:
- `light`: a run directory with a fake model on disk and no engine ever started (~2 s to
  start): auth, limits, bad input, checkpoint listing/download/delete, start-up refusal.
- `served` (marked `engine`): the tiny random llama on vLLM: register, rollouts through the
  served OpenAI API, training steps, a client that disconnects mid-step, two clients training
  one model, and SIGTERM during a step.
Clients use only `RemoteBackend`, the OpenAI client and raw HTTP.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from art_core import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_core.backend.remote import TRAIN_PHASES, RemoteBackend, RemoteBackendError

KEY = "test-" + secrets.token_hex(16)
BODY_LIMIT_MB = 1
MSG = [{"role": "user", "content": "What is the capital of France?"}]


# ---- helpers (also used by test_remote_client_env.py) ------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    root: Path
    log: Path

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(root: Path, *, api_key: str | None = KEY, extra: tuple[str, ...] = (),
                 python: str = sys.executable, timeout: float = 60.0) -> Server:
    """`art serve` as a subprocess on a free loopback port; waits for /health."""
    port = free_port()
    log = root.parent / f"{root.name}-server-{port}.log"
    env = {**os.environ, "ART_API_KEY": api_key or ""}
    cmd = [python, "-m", "art_core.cli", "serve", "--path", str(root), "--port", str(port),
           "--max-body-mb", str(BODY_LIMIT_MB), "--shutdown-grace", "60", *extra]
    with log.open("wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
    server = Server(proc, f"http://127.0.0.1:{port}", root, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"art serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"art serve did not become healthy:\n{server.log_tail()}")


def make_fake_run(root: Path, project: str = "proj", name: str = "fake", steps: int = 3) -> Path:
    """A model directory as LocalBackend writes it, with small fake adapter files (no engine
    is needed to list, download or delete them)."""
    md = root / project / "models" / name
    for s in range(steps):
        d = md / "checkpoints" / f"{s:04d}"
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({"r": 8, "step": s}))
        (d / "adapter_model.safetensors").write_bytes(os.urandom(4096 + s))
    (md / "model.json").write_text(json.dumps({"name": name, "project": project,
                                               "base_model": "tiny"}))
    rows = [{"step": s, "reward_mean": r, "loss": 0.1} for s, r in [(1, 0.9), (2, 0.2)]][
        : max(0, steps - 1)]
    (md / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return md


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under the run dir (engine logs aside) with size and mtime."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if "logs" not in p.relative_to(root).parts}


def descendants(pid: int) -> set[int]:
    """Child processes of `pid`, recursively, from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - out
        out |= frontier
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def auth(key: str | None = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


# ---- the light server: no engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("light") / "run"
    make_fake_run(root)
    make_fake_run(root, name="fake-delete", steps=4)
    link = root / "proj" / "models" / "fake" / "checkpoints" / "0001" / "outside.txt"
    link.symlink_to("/etc/hostname")  # a symlink out of the run dir must never be served
    replay = make_fake_run(root, name="fake-replay", steps=3)  # step 2 answered request r-2
    (replay / "requests.jsonl").write_text(json.dumps(
        {"request_id": "r-2", "step": 2, "metrics": {"loss": 0.1}}) + "\n")
    server = start_server(root)
    yield server
    server.stop()


def test_health_needs_no_key(light):
    r = httpx.get(light.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert str(light.root) not in r.text  # names no paths


PROTECTED = [
    ("POST", "/v1/chat/completions", {"model": "fake", "messages": MSG}),
    ("POST", "/v1/completions", {"model": "fake", "prompt": "hi"}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/art/completions/chatcmpl-1", None),
    ("POST", "/art/v1/models", {"name": "x", "project": "proj"}),
    ("GET", "/art/v1/models/proj/fake/step", None),
    ("POST", "/art/v1/models/proj/fake/train", {"groups": []}),
    ("GET", "/art/v1/jobs/0123456789abcdef0123456789abcdef", None),
    ("GET", "/art/v1/models/proj/fake/checkpoints", None),
    ("DELETE", "/art/v1/models/proj/fake/checkpoints", None),
    ("GET", "/art/v1/models/proj/fake/checkpoints/1/files", None),
    ("GET", "/art/v1/models/proj/fake/checkpoints/1/files/adapter_config.json", None),
    ("GET", "/art/v1/no/such/route", None),
]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED,
                         ids=[f"{m} {p}" for m, p, _ in PROTECTED])
@pytest.mark.parametrize("headers", [
    {}, auth("wrong-key"), auth(KEY + "x"), {"Authorization": KEY},
    {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"},
], ids=["missing", "wrong", "longer", "no-scheme", "basic", "empty"])
def test_every_route_but_health_needs_the_key(light, method, path, body, headers):
    before = snapshot(light.root)
    r = httpx.request(method, light.url + path, json=body, headers=headers)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and "API key" in err["message"]
    assert r.headers["www-authenticate"] == "Bearer"
    assert snapshot(light.root) == before


def test_the_right_key_is_accepted_on_openai_routes(light):
    import openai

    client = openai.OpenAI(base_url=light.url + "/v1", api_key=KEY)
    assert client.models.list().data == []  # no model registered in this server: empty list
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=light.url + "/v1", api_key="nope").models.list()


@pytest.mark.parametrize(("name", "project"), [
    ("../x", "proj"), ("", "proj"), ("a" * 129, "proj"), ("x", "../etc"), ("..", "proj"),
    ("a/b", "proj"), ("x", ""),
])
def test_register_rejects_invalid_names(light, name, project):
    before = snapshot(light.root)
    r = httpx.post(light.url + "/art/v1/models", json={"name": name, "project": project},
                   headers=auth())
    assert r.status_code == 400, r.text
    assert "invalid" in r.json()["error"]["message"] and "name" in r.json()["error"]["message"]
    assert snapshot(light.root) == before


@pytest.mark.parametrize(("project", "name", "status"), [
    ("proj", "%2E%2E", 400), ("proj", "a" * 129, 400), ("proj", "a%20b", 400),
    ("%2E%2E", "fake", 400),
    ("proj", "..", 404),  # the client folds '/x/../' itself: a route that does not exist
    ("proj", "%2E%2E%2Ffake", 404),  # decodes to a '/': matches no route at all
    ("proj", "missing", 404),
])
@pytest.mark.parametrize("suffix", ["step", "checkpoints", "checkpoints/1/files"])
def test_path_names_are_validated(light, project, name, status, suffix):
    before = snapshot(light.root)
    r = httpx.get(f"{light.url}/art/v1/models/{project}/{name}/{suffix}", headers=auth())
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert ("invalid" in msg) if status == 400 else ("does not exist" in msg or "route" in msg)
    assert str(light.root) not in msg
    assert snapshot(light.root) == before


def _trajectory(reward: float = 1.0, turns: bool = True) -> dict[str, Any]:
    msgs = [*MSG, {"role": "assistant", "content": "Paris"}]
    turn = {"message_index": 1, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5],
            "logprobs": [-0.5, -0.25]}
    return {"messages": msgs, "reward": reward, "turns": [turn] if turns else []}


GOOD_GROUP = {"trajectories": [_trajectory(0.0), _trajectory(1.0)]}
BAD_PAYLOADS = [
    ("not-json", b"{groups: [", "not valid JSON"),
    ("a-list", [1, 2], "JSON object"),
    ("no-groups", {"config": {}}, "'groups'"),
    ("empty-groups", {"groups": []}, "non-empty list"),
    ("groups-not-list", {"groups": {"trajectories": []}}, "non-empty list"),
    ("unknown-field", {"groups": [GOOD_GROUP], "lr": 1}, "unknown field"),
    ("group-not-object", {"groups": [3]}, "groups[0]"),
    ("bad-role", {"groups": [{"trajectories": [
        {"messages": [{"role": "robot", "content": "x"}]}]}]}, "role"),
    ("logprob-length", {"groups": [{"trajectories": [
        dict(_trajectory(), turns=[{"message_index": 1, "prompt_token_ids": [1],
                                    "completion_token_ids": [2, 3], "logprobs": [-1.0]}])]}]},
     "same length"),
    ("turn-points-at-user", {"groups": [{"trajectories": [
        dict(_trajectory(), turns=[dict(_trajectory()["turns"][0], message_index=0)])]}]},
     "assistant message"),
    ("nan-reward", b'{"groups": [{"trajectories": [{"messages": [], "reward": NaN}]}]}',
     "finite"),
    ("untrainable", {"groups": [{"trajectories": [_trajectory(turns=False)]}]},
     "no sampled turn"),
    ("unknown-config-key", {"groups": [GOOD_GROUP], "config": {"learning_rat": 1}},
     "config.learning_rat"),
    ("bad-learning-rate", {"groups": [GOOD_GROUP], "config": {"learning_rate": -1}},
     "config.learning_rate"),
    ("bad-request-id", {"groups": [GOOD_GROUP], "request_id": "../x"}, "request_id"),
]


@pytest.mark.parametrize(("case", "payload", "needle"), BAD_PAYLOADS,
                         ids=[c for c, _, _ in BAD_PAYLOADS])
def test_malformed_train_payloads_get_400(light, case, payload, needle):
    before = snapshot(light.root)
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = httpx.post(light.url + "/art/v1/models/proj/fake/train", content=content,
                   headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert "Traceback" not in r.text and str(light.root) not in r.text
    assert snapshot(light.root) == before


def test_valid_groups_for_an_unregistered_model_get_409(light):
    before = snapshot(light.root)
    r = httpx.post(light.url + "/art/v1/models/proj/fake/train", json={"groups": [GOOD_GROUP]},
                   headers=auth())
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_not_registered"
    assert snapshot(light.root) == before


def test_a_retried_request_answered_before_a_restart_is_not_trained_again(light):
    # `requests.jsonl` says r-2 produced step 2 (in an earlier server process): the retry gets
    # that result, even before the model is registered again, and nothing is written
    before = snapshot(light.root)
    url = light.url + "/art/v1/models/proj/fake-replay/train"
    r = httpx.post(url, json={"groups": [GOOD_GROUP], "request_id": "r-2"}, headers=auth())
    assert r.status_code == 200, r.text
    events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert events[-1] == {"event": "result", "step": 2, "metrics": {"loss": 0.1},
                          "replayed": True}
    r = httpx.post(url, json={"groups": [GOOD_GROUP], "request_id": "r-3"}, headers=auth())
    assert r.status_code == 409  # an unknown request id is a new step: register first
    assert snapshot(light.root) == before


def _raw_request(url: str, head: str) -> tuple[int, dict[str, Any]]:
    """Send only a request head (no body) and read the answer: proves the server answers
    before reading a body it has refused."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize("path", ["/art/v1/models/proj/fake/train", "/art/v1/models",
                                  "/v1/chat/completions"])
def test_oversized_bodies_get_413(light, path):
    before = snapshot(light.root)
    limit = BODY_LIMIT_MB * 2**20
    # 1. a Content-Length over the limit: refused from the head alone
    status, body = _raw_request(light.url, f"POST {path} HTTP/1.1\r\nHost: x\r\n"
                                f"Authorization: Bearer {KEY}\r\nContent-Type: application/json"
                                f"\r\nContent-Length: {10 * limit}\r\n\r\n")
    assert status == 413 and "larger than the server's limit" in body["error"]["message"]
    # 2. a real body over the limit
    big = b'{"groups": ["' + b"x" * (limit + 1000) + b'"]}'
    r = httpx.post(light.url + path, content=big, headers=auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"

    # 3. a chunked body (no Content-Length): counted while it streams in
    def chunks() -> Iterator[bytes]:
        yield b'{"groups": ["'
        for _ in range(limit // 65536 + 2):
            yield b"x" * 65536
        yield b'"]}'

    r = httpx.post(light.url + path, content=chunks(), headers=auth())
    assert r.status_code == 413, r.text
    assert "1.0 MiB" in r.json()["error"]["message"]
    assert snapshot(light.root) == before


async def test_checkpoints_list_download_without_engine(light, tmp_path):
    model = TrainableModel(name="fake", project="proj")
    async with RemoteBackend(light.url, api_key=KEY) as backend:
        assert await backend.get_step(model) == 2
        cps = await backend.list_checkpoints(model)
        assert [c.step for c in cps] == [0, 1, 2]
        assert cps[1].metrics == {"reward_mean": 0.9, "loss": 0.1}
        dest = await backend.download_checkpoint(model, 1, tmp_path / "dl")
        src = light.root / "proj" / "models" / "fake" / "checkpoints" / "0001"
        assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json",
                                                          "adapter_model.safetensors"]
        for f in dest.iterdir():
            assert f.read_bytes() == (src / f.name).read_bytes()
        latest = await backend.download_checkpoint(model, None, tmp_path / "latest")
        assert json.loads((latest / "adapter_config.json").read_text())["step"] == 2
        with pytest.raises(RemoteBackendError, match="no checkpoint 7") as e:
            await backend.download_checkpoint(model, 7, tmp_path / "none")
        assert e.value.status == 404


@pytest.mark.parametrize(("filename", "status"), [
    ("outside.txt", 404), ("%2E%2E", 400), ("%2E%2E%2Fmodel.json", 404), ("a%20b", 400),
])
def test_file_download_stays_inside_the_checkpoint(light, filename, status):
    r = httpx.get(f"{light.url}/art/v1/models/proj/fake/checkpoints/1/files/{filename}",
                  headers=auth())
    assert r.status_code == status, r.text
    assert "localhost" not in r.text and str(light.root) not in r.text
    assert r.json()["error"]["message"]


async def test_delete_checkpoints_keeps_latest_and_best(light):
    model = TrainableModel(name="fake-delete", project="proj")
    async with RemoteBackend(light.url, api_key=KEY) as backend:
        # history: step 1 reward 0.9 (measured on checkpoint 0), step 2 reward 0.2 -> best is 0
        assert await backend.delete_checkpoints(model) == [1, 2]
        assert [c.step for c in await backend.list_checkpoints(model)] == [0, 3]
        assert await backend.delete_checkpoints(model) == []
        with pytest.raises(RemoteBackendError, match="metric name"):
            await backend.delete_checkpoints(model, "m" * 200)


def test_json_errors_for_unknown_routes_and_methods(light):
    r = httpx.get(light.url + "/art/v1/nothing", headers=auth())
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx.put(light.url + "/art/v1/models", headers=auth())
    assert r.status_code == 405 and r.json()["error"]["message"]
    r = httpx.get(light.url + "/art/v1/jobs/../x", headers=auth())
    assert r.status_code == 404 and "error" in r.json()


def test_non_loopback_bind_without_key_is_refused(tmp_path):
    root = tmp_path / "never"
    env = {k: v for k, v in os.environ.items() if k != "ART_API_KEY"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "art_core.cli", "serve", "--host", "0.0.0.0",
                           "--path", str(root), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to listen on '0.0.0.0' without an API key" in proc.stderr
    assert "--api-key" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 15
    assert not root.exists()  # nothing started, nothing written


ENGINE_ARGS = {"engine": {"extra_args": ["--trust-remote-code"]}}
TEMPLATE = {"engine": {"chat_template": "/etc/hostname"}}


@pytest.mark.parametrize(("base_models", "allow_engine_args", "base_model", "config", "refused"), [
    ((), False, "HuggingFaceTB/SmolLM2-135M-Instruct", {}, None),
    ((), False, "/any/local/dir", {}, None),                     # no patterns: any base model
    ((), False, "HuggingFaceTB/SmolLM2-135M-Instruct", ENGINE_ARGS, "engine_args_not_allowed"),
    ((), False, "HuggingFaceTB/SmolLM2-135M-Instruct", TEMPLATE, "engine_args_not_allowed"),
    ((), True, "HuggingFaceTB/SmolLM2-135M-Instruct", ENGINE_ARGS, None),
    (("Qwen/*", "HuggingFaceTB/*"), False, "Qwen/Qwen3-0.6B", {}, None),
    (("Qwen/*", "HuggingFaceTB/*"), False, "/data/models/mine", {}, "base_model_not_allowed"),
    (("Qwen/*",), False, "qwen/Qwen3-0.6B", {}, "base_model_not_allowed"),  # case-sensitive
    (("Qwen/*",), True, "Qwen/Qwen3-0.6B", ENGINE_ARGS, None),
])
def test_register_policy(tmp_path, base_models, allow_engine_args, base_model, config, refused):
    from art_core.server import ApiError, ArtServer

    art = ArtServer(tmp_path / "run", base_models=base_models,
                    allow_engine_args=allow_engine_args)
    model = TrainableModel(name="m", project="p", base_model=base_model, config=config)
    if refused is None:
        art._check_allowed(model)
    else:
        with pytest.raises(ApiError) as e:
            art._check_allowed(model)
        assert e.value.status == 403 and e.value.code == refused
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_register_policy_over_http(tmp_path):
    server = start_server(tmp_path / "run", extra=("--allow-base-model", "HuggingFaceTB/*"))
    try:
        before = snapshot(server.root)
        for body, code in [
            ({"base_model": "/etc"}, "base_model_not_allowed"),
            ({"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "config": ENGINE_ARGS},
             "engine_args_not_allowed"),
        ]:
            r = httpx.post(server.url + "/art/v1/models", headers=auth(),
                           json={"name": "policy", "project": "p", **body})
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["code"] == code and "--allow-" in error["message"]
        assert snapshot(server.root) == before  # nothing written for a refused model
    finally:
        server.stop()


def test_sigterm_stops_an_idle_server_cleanly(tmp_path):
    server = start_server(tmp_path / "run")
    t0 = time.monotonic()
    code = server.stop()
    assert code in (0, -signal.SIGTERM), server.log_tail()
    assert time.monotonic() - t0 < 15
    assert "Traceback" not in server.log.read_text()


# ---- the real engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("served") / "run")
    yield server
    server.stop()


@pytest.fixture(scope="module")
async def remote(served) -> AsyncIterator[RemoteBackend]:
    backend = RemoteBackend(served.url, api_key=KEY)
    yield backend
    await backend.close()


@pytest.fixture(scope="module")
async def model(remote, tiny_models) -> TrainableModel:
    from tests.conftest import tiny_config

    m = TrainableModel(name="srv-tiny", project="server", base_model=str(tiny_models["llama"]),
                       config=tiny_config())
    await m.register(remote)
    return m


def build_trajectory(messages: list[dict[str, Any]], response: Any, reward: float) -> Trajectory:
    t = Trajectory(messages=list(messages), reward=reward)
    t.add_completion(response)  # the assistant message + its exact sampled tokens
    return t


async def rollout_group(model: TrainableModel, n: int = 4, served_name: str | None = None
                        ) -> TrajectoryGroup:
    client = model.openai_client()

    async def one(i: int) -> Trajectory:
        msgs = [{"role": "user", "content": f"Count to {i + 1}."}]
        r = await client.chat.completions.create(model=served_name or model.name,
                                                 messages=msgs, max_tokens=8, temperature=1.0)
        return build_trajectory(msgs, r, reward=float(i))  # distinct rewards: a signal

    return TrajectoryGroup(trajectories=list(await asyncio.gather(*(one(i) for i in range(n)))))


def no_tmp_left(served: Server, model: TrainableModel) -> bool:
    cps = served.root / model.project / "models" / model.name / "checkpoints"
    return not [p for p in cps.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.engine
async def test_register_rollout_train_serve_download(served, remote, model, tmp_path):
    assert model.base_url == served.url + "/v1" and model.api_key == KEY
    assert await remote.get_step(model) == 0
    group = await rollout_group(model)
    assert all(t.turns[0].step == 0 for t in group)
    phases: list[str] = []
    result = await model.train([group], TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and math.isfinite(result.metrics["loss"])
    assert result.metrics["trajectories_kept"] == 4
    assert await remote.get_step(model) == 1

    client = model.openai_client()
    for name in (f"{model.name}@1", model.name):
        r = await client.chat.completions.create(model=name, messages=MSG, max_tokens=2)
        assert r.model == f"{model.name}@1" and r.model_extra["art_step"] == 1
    ids = {m.id for m in (await client.models.list()).data}
    assert {model.name, f"{model.name}@0", f"{model.name}@1"} <= ids

    # progress events, as the bar sees them, on a second step
    result = await remote.train(model, [await rollout_group(model)],
                                TrainConfig(learning_rate=1e-3),
                                progress=lambda e: phases.append(e["phase"]))
    assert result.step == 2 and phases == list(TRAIN_PHASES)
    answered = [json.loads(line) for line in (served.root / "server" / "models" / model.name /
                                              "requests.jsonl").read_text().splitlines()]
    assert [row["step"] for row in answered] == [1, 2]  # what a retry after a restart finds

    cps = await remote.list_checkpoints(model)
    assert [c.step for c in cps] == [0, 1, 2] and "reward_mean" in cps[1].metrics
    dest = await remote.download_checkpoint(model, 1, tmp_path / "step1")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in
                                                                    dest.iterdir()}
    src = served.root / "server" / "models" / model.name / "checkpoints" / "0001"
    assert (dest / "adapter_model.safetensors").read_bytes() == \
        (src / "adapter_model.safetensors").read_bytes()
    assert no_tmp_left(served, model)



@pytest.mark.engine
async def test_an_unchanged_langgraph_graph_trains_through_the_server(served, remote, tiny_models):
    """Zero-change capture against `art serve`: the recorder reads the ledger over HTTP with
    the key the model was registered with (no key passed to the recorder)."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    from art_core import gather_trajectory_groups
    from art_langgraph import init_chat_model, record
    from tests.conftest import tiny_config

    model = TrainableModel(name="srv-lg", project="server", base_model=str(tiny_models["llama"]),
                           config=tiny_config())
    await model.register(remote)
    llm = init_chat_model(model, max_tokens=6)

    async def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_edge(START, "agent")
    g.add_edge("agent", END)
    graph = g.compile()

    async def rollout(q: str) -> Trajectory:
        async with record(reward=lambda s: float(len(str(s["messages"][-1].content)))) as t:
            await graph.ainvoke({"messages": [("user", q)]})
        return t

    for step in (1, 2):
        groups = await gather_trajectory_groups([rollout(q) for _ in range(4)] for q in "ab")
        assert all(t.turns[0].step == step - 1 for g in groups for t in g)
        assert (await model.train(groups, TrainConfig(learning_rate=1e-2))).step == step
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=MSG, max_tokens=2)
    assert r.model == f"{model.name}@2"

BAD_FOR_THE_MODEL = [
    ("token-out-of-vocab", {"groups": [{"trajectories": [
        dict(_trajectory(), turns=[dict(_trajectory()["turns"][0],
                                        completion_token_ids=[4, 10**6])])]}]}, "vocabulary"),
    ("untrainable", {"groups": [{"trajectories": [_trajectory(turns=False)]}]},
     "no sampled turn"),
    ("empty-groups", {"groups": []}, "non-empty list"),
]


@pytest.mark.engine
@pytest.mark.parametrize(("case", "payload", "needle"), BAD_FOR_THE_MODEL,
                         ids=[c for c, _, _ in BAD_FOR_THE_MODEL])
async def test_bad_groups_for_a_registered_model(served, model, case, payload, needle):
    before = snapshot(served.root)
    async with httpx.AsyncClient() as c:
        r = await c.post(f"{served.url}/art/v1/models/server/{model.name}/train",
                         json=payload, headers=auth())
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert snapshot(served.root) == before  # nothing journaled, no step started


@pytest.mark.engine
async def test_client_disconnect_mid_step_leaves_a_consistent_step(served, remote, model):
    before = await remote.get_step(model)
    group = await rollout_group(model)
    body = {"groups": [group.model_dump(mode="json")], "config": {"learning_rate": 1e-3}}
    async with httpx.AsyncClient(timeout=60) as c, c.stream(
            "POST", f"{served.url}/art/v1/models/server/{model.name}/train", json=body,
            headers=auth()) as r:
        assert r.status_code == 200
        first = json.loads(await r.aiter_lines().__anext__())
        assert first["event"] == "accepted"
        # leaving the block closes the connection mid-step
    deadline = time.monotonic() + 120
    while await remote.get_step(model) != before + 1:
        assert time.monotonic() < deadline, served.log_tail()
        await asyncio.sleep(0.25)
    async with httpx.AsyncClient(timeout=30) as c:
        job = (await c.get(f"{served.url}/art/v1/jobs/{first['job']}", headers=auth())).json()
    while job["status"] not in ("done", "failed"):
        await asyncio.sleep(0.25)
        async with httpx.AsyncClient(timeout=30) as c:
            job = (await c.get(f"{served.url}/art/v1/jobs/{first['job']}",
                               headers=auth())).json()
    assert job["status"] == "done" and job["result"]["step"] == before + 1
    assert no_tmp_left(served, model)
    r = await model.openai_client().chat.completions.create(model=model.name, messages=MSG,
                                                            max_tokens=2)
    assert r.model_extra["art_step"] == before + 1


@pytest.mark.engine
async def test_two_clients_training_one_model_are_serialized(served, model, tiny_models):
    before_clients = [RemoteBackend(served.url, api_key=KEY) for _ in range(2)]
    models = []
    for b in before_clients:  # each client registers its own copy of the model
        m = TrainableModel(name=model.name, project=model.project, base_model=model.base_model,
                           config=model.config)
        await m.register(b)
        models.append(m)
    before = await models[0].get_step()
    groups = [await rollout_group(m) for m in models]
    results = await asyncio.gather(*(m.train([g], TrainConfig(learning_rate=1e-3))
                                     for m, g in zip(models, groups, strict=True)))
    assert sorted(r.step for r in results) == [before + 1, before + 2]
    assert await models[1].get_step() == before + 2
    for b in before_clients:
        await b.close()


@pytest.mark.engine
async def test_retried_request_id_reattaches_instead_of_training_twice(served, remote, model):
    before = await remote.get_step(model)
    group = await rollout_group(model)
    body = {"groups": [group.model_dump(mode="json")], "config": {"learning_rate": 1e-3},
            "request_id": "retry-" + secrets.token_hex(4)}
    url = f"{served.url}/art/v1/models/server/{model.name}/train"
    async with httpx.AsyncClient(timeout=120) as c:
        async with c.stream("POST", url, json=body, headers=auth()) as r:
            job = json.loads(await r.aiter_lines().__anext__())["job"]
        r = await c.post(url, json=body, headers=auth())  # the same request again
    events = [json.loads(x) for x in r.text.splitlines()]
    assert events[0] == {**events[0], "event": "accepted", "job": job}
    assert events[-1]["event"] == "result" and events[-1]["step"] == before + 1
    assert await remote.get_step(model) == before + 1


@pytest.mark.engine
async def test_delete_checkpoints_unserves_deleted_steps(served, remote, model):
    latest = await remote.get_step(model)
    deleted = await remote.delete_checkpoints(model)
    kept = [c.step for c in await remote.list_checkpoints(model)]
    assert latest in kept and not set(deleted) & set(kept) and deleted
    client = model.openai_client()
    import openai

    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model=f"{model.name}@{deleted[0]}", messages=MSG,
                                             max_tokens=2)
    r = await client.chat.completions.create(model=model.name, messages=MSG, max_tokens=2)
    assert r.model_extra["art_step"] == latest


@pytest.mark.engine
async def test_sigterm_during_a_step_finishes_it_and_stops_vllm(served, model):
    """Last test of the module: it stops the shared server."""
    before = max(int(p.name) for p in (served.root / "server" / "models" / model.name /
                                       "checkpoints").iterdir() if p.name.isdigit())
    children = descendants(served.proc.pid)
    assert children, "vLLM should be a child of the server"
    group = await rollout_group(model)
    body = {"groups": [group.model_dump(mode="json")], "config": {"learning_rate": 1e-3}}
    events = []
    async with httpx.AsyncClient(timeout=120) as c, c.stream(
            "POST", f"{served.url}/art/v1/models/server/{model.name}/train", json=body,
            headers=auth()) as r:
        async for line in r.aiter_lines():
            events.append(json.loads(line))
            if len(events) == 1:
                served.proc.send_signal(signal.SIGTERM)
    assert events[-1]["event"] == "result" and events[-1]["step"] == before + 1, events
    served.proc.wait(90)
    assert served.proc.returncode in (0, -signal.SIGTERM), served.log_tail()
    deadline = time.monotonic() + 20
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in children), "vLLM outlived the server"
    assert no_tmp_left(served, model)
    log = served.log.read_text()
    assert "Traceback" not in log, served.log_tail()
