"""`art serve` and `RemoteBackend` without an engine, against real server processes.

`light`: a real `art serve` subprocess on 127.0.0.1 with an API key, over a run directory with
a fake model on disk and no engine ever started (~2 s to start): auth, limits, bad input,
checkpoint listing/download/delete, start-up refusal, the register policy.
The same served with the tiny random llama on vLLM: test_server_engine.py.
Clients use only `RemoteBackend`, the OpenAI client and raw HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from art_core import TrainableModel
from art_core.backend.remote import RemoteBackend, RemoteBackendError
from tests.support.server import (
    BODY_LIMIT_MB,
    KEY,
    MSG,
    Server,
    auth,
    free_port,
    make_fake_run,
    snapshot,
    start_server,
    trajectory_json,
)


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
    mismatched = make_fake_run(root, name="fake-mismatch", steps=3)  # r-7 made step 2, which
    (mismatched / "requests.jsonl").write_text(json.dumps(  # failed the served-policy check
        {"request_id": "r-7", "step": 2, "metrics": {"loss": 0.1}}) + "\n")
    (mismatched / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 0.1},
        {"step": 2, "loss": 0.1, "policy_mismatch": 1.0, "policy_check_mean_abs": 0.52}]))
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
    ("POST", "/art/v1/models/proj/fake/log", {"groups": []}),
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


GOOD_GROUP = {"trajectories": [trajectory_json(0.0), trajectory_json(1.0)]}
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
        dict(trajectory_json(), turns=[{"message_index": 1, "prompt_token_ids": [1],
                                    "completion_token_ids": [2, 3], "logprobs": [-1.0]}])]}]},
     "same length"),
    ("turn-points-at-user", {"groups": [{"trajectories": [
        dict(trajectory_json(), turns=[dict(trajectory_json()["turns"][0], message_index=0)])]}]},
     "assistant message"),
    ("nan-reward", b'{"groups": [{"trajectories": [{"messages": [], "reward": NaN}]}]}',
     "finite"),
    ("untrainable", {"groups": [{"trajectories": [trajectory_json(turns=False)]}]},
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


@pytest.mark.parametrize(("payload", "status", "needle"), [
    ({"groups": [{"trajectories": [trajectory_json(1.0, turns=False)]}]}, 409,
     "not registered"),  # valid (a logged group needs no sampled turns) but unregistered
    ({"groups": []}, 400, "non-empty list"),
    ({"groups": [{"trajectories": [trajectory_json()]}], "split": 3}, 400, "split"),
    ({"groups": [], "step": 1}, 400, "request body must be"),
], ids=["unregistered", "no-groups", "bad-split", "unknown-field"])
def test_logging_validation_groups_checks_its_input(light, payload, status, needle):
    before = snapshot(light.root)
    r = httpx.post(light.url + "/art/v1/models/proj/fake/log", json=payload, headers=auth())
    assert r.status_code == status and needle in r.json()["error"]["message"]
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


def test_a_retry_of_a_step_that_failed_the_policy_check_fails_the_same_way(light):
    """Step 2 was committed but not published (its check failed): a retry with its request id
    is answered with that failure, not with the step as a success, and trains nothing."""
    before = snapshot(light.root)
    r = httpx.post(light.url + "/art/v1/models/proj/fake-mismatch/train",
                   json={"groups": [GOOD_GROUP], "request_id": "r-7"}, headers=auth())
    events = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert events[-1]["event"] == "error", events
    error = events[-1]["error"]
    assert error["code"] == "policy_mismatch" and "fake-mismatch@2" in error["message"]
    assert "0.520" in error["message"] and "not published" in error["message"]
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
    proc = subprocess.run([sys.executable, "-m", "art_core.cli", "serve", "--host", "0.0.0.0",
                           "--path", str(root), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "refusing to listen on '0.0.0.0' without an API key" in proc.stderr
    assert "--api-key" in proc.stderr and "Traceback" not in proc.stderr
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
    from art_core.serve.app import ApiError, ArtServer

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
    code = server.stop()
    assert code in (0, -signal.SIGTERM), server.log_tail()
    assert "Traceback" not in server.log.read_text()
