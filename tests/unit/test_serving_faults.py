"""Faults of serving without vLLM, and what they leave behind (the engine is
tests/support/runs.py's StubEngine; one real `art serve` subprocess never starts an engine):
- a registration the running engine cannot serve is refused naming the setting, and a failed
  registration leaves nothing served and, for a new model only, nothing on disk;
- the gateway's gate and the engine's sleep are counted; an on-demand load that fails is a 503;
  a failed sleep, a failed first start or a failed wake leaves nothing stuck;
- base-model limits come from an offline Hugging Face cache, and an unknown id is no crash;
- a JSON body nested too deeply is a 400, not a 500 (gateway and `art serve`);
- `art serve`: one job per request id posted twice at once, full disks answered 507;
  `RemoteBackend` never registers a model it did not register (a typo).
Faults of a training step: tests/unit/test_step_faults.py.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from art_core import (
    EngineConfig,
    LocalBackend,
    LoraConfig,
    ModelConfig,
    TrainableModel,
    TrajectoryGroup,
)
from art_core.backend.remote import RemoteBackend, RemoteBackendError
from art_core.base_models import BaseLimits, base_model_limits
from art_core.inference.engine import EngineError, VLLMEngine
from art_core.inference.gateway import Gateway, GatewayError, ServedModel
from art_core.model import Endpoint
from art_core.observe.loggers import Loggers
from tests.support.runs import (
    CONFIG,
    StubEngine,
    bare_backend,
    contents,
    groups_for,
    make_backend,
    model_dir,
)
from tests.support.server import KEY, Server, auth, snapshot, start_server, trajectory_json

REPO = Path(__file__).resolve().parents[2]





# ---- 8. registrations the engine cannot serve ------------------------------------------------

def _failing_loads(engine: StubEngine, model_name: str) -> None:
    original = engine.load_adapter

    def load_adapter(name: str, path: Path, *, latest: bool = False) -> None:
        if name.startswith(model_name + "@"):
            raise EngineError("vLLM /v1/load_lora_adapter failed (500): out of memory")
        original(name, path, latest=latest)

    engine.load_adapter = load_adapter  # type: ignore[method-assign]


REFUSED = [  # (id, model config, error, what its message names)
    ("serve_merged", ModelConfig(engine=EngineConfig(serve_merged=True)), ValueError,
     "engine.serve_merged=True (running: None)"),
    ("max_model_len", ModelConfig(engine=EngineConfig(max_model_len=1024)), ValueError,
     "engine.max_model_len=1024 (running: 4096)"),
    ("rank", ModelConfig(lora=LoraConfig(rank=16, alpha=32)), ValueError, "LoRA rank 16"),
    ("load fails", ModelConfig(), EngineError, "load_lora_adapter failed"),
]


@pytest.mark.parametrize(("config", "error", "needle"), [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
async def test_a_refused_registration_leaves_nothing_behind(tiny_models, tmp_path, config,
                                                            error, needle):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        engine = backend._engines[model.base_model]
        _failing_loads(engine, "second")
        second = TrainableModel(name="second", project="demo", base_model=model.base_model,
                                config=config)
        with pytest.raises(error) as e:
            await second.register(backend)
        assert needle in str(e.value)
        assert "second" not in backend.gateway.models
        assert not model_dir(backend, second).path.exists()
        assert not [n for n in engine.adapters if n.startswith("second@")]
        with pytest.raises(ValueError, match="is not registered"):
            await backend.train(second, groups_for(backend, model), CONFIG)
        # the model registered first is untouched
        assert backend.gateway.models["agent"].latest == 0 and "agent@0" in engine.adapters
    finally:
        await backend.close()


async def test_a_model_that_differs_only_in_runtime_settings_registers(tiny_models, tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        second = TrainableModel(name="second", project="demo", base_model=model.base_model,
                                config=ModelConfig(engine=EngineConfig(startup_timeout_s=5)))
        await second.register(backend)
        assert backend.gateway.models["second"].latest == 0
        assert model_dir(backend, second).steps() == [0]
    finally:
        await backend.close()


async def test_a_failed_registration_of_a_model_on_disk_keeps_its_checkpoints(
        tiny_models, tmp_path):
    root = tmp_path / "run"
    backend, model = await make_backend(root, tiny_models["llama"])
    await backend.train(model, groups_for(backend, model), CONFIG)
    await backend.close()
    md = model_dir(backend, model)
    before = contents(root)

    backend, engine = bare_backend(root, model.base_model)  # a restart, the engine failing
    try:
        _failing_loads(engine, model.name)
        with pytest.raises(EngineError):
            await model.register(backend)
        assert model.name not in backend.gateway.models
        assert md.steps() == [0, 1]
        assert contents(root) == before  # rewritten at most, never removed
        with pytest.raises(ValueError, match="is not registered"):
            await backend.train(model, groups_for(backend, model), CONFIG)
    finally:
        await backend.close()


async def test_changed_lora_settings_are_refused_and_the_model_keeps_serving(tiny_models,
                                                                           tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        changed = TrainableModel(name="agent", project="demo", base_model=model.base_model,
                                 config=ModelConfig(lora=LoraConfig(rank=4, alpha=8)))
        with pytest.raises(ValueError, match="cannot change"):
            await changed.register(backend)
        assert backend.gateway.models["agent"].latest == 0
        assert model_dir(backend, model).steps() == [0]
        assert (await backend.train(model, groups_for(backend, model), CONFIG)).step == 1
    finally:
        await backend.close()


# ---- 9. counted gate and sleep, on-demand loads, deep health ---------------------------------

async def test_the_gate_opens_when_every_pause_has_resumed():
    gw = Gateway(drain_timeout_s=1)
    await gw.pause()
    await gw.pause()  # two models training at once
    waiting = asyncio.create_task(gw.wait_gate())
    gw.resume()
    await asyncio.sleep(0.05)
    assert gw.paused and not waiting.done()
    gw.resume()
    await asyncio.wait_for(waiting, 1)
    assert not gw.paused
    gw.resume()  # one resume too many must not open the next pause in advance
    await gw.pause()
    assert gw.paused
    gw.resume()
    assert not gw.paused


def recording_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any
                     ) -> tuple[VLLMEngine, list[str]]:
    cuda = kw.pop("cuda", True)
    engine = VLLMEngine(str(tmp_path), served_name="m", cuda=cuda, config=EngineConfig(**kw))
    calls: list[str] = []

    def post(route: str, body: Any = None, params: Any = None) -> dict[str, Any]:
        calls.append(route)
        return {}

    monkeypatch.setattr(engine, "_post", post)
    return engine, calls


def test_the_engine_sleeps_once_and_wakes_with_the_last_wake_up(tmp_path, monkeypatch):
    engine, calls = recording_engine(tmp_path, monkeypatch)
    engine.sleep()
    engine.sleep()
    assert calls == ["/sleep"]
    engine.wake_up()
    assert calls == ["/sleep"]  # the other step still trains
    engine.wake_up()
    assert calls == ["/sleep", "/wake_up"]
    engine.wake_up()  # unmatched: nothing
    engine.sleep()
    assert calls == ["/sleep", "/wake_up", "/sleep"]


@pytest.mark.parametrize("kw", [{"cuda": False}, {"sleep_while_training": False}],
                         ids=["cpu", "sleep off"])
def test_the_engine_does_not_sleep_where_it_should_not(tmp_path, monkeypatch, kw):
    engine, calls = recording_engine(tmp_path, monkeypatch, **kw)
    engine.sleep()
    engine.wake_up()
    assert calls == []


class _UnloadableEngine:
    """An engine that is up but cannot load an adapter right now."""

    def __init__(self) -> None:
        self.served_name, self.config, self.state = "base", EngineConfig(), "ready"
        self.adapters: dict[str, str] = {}
        self.serve_merged, self.merged = False, None

    def load_adapter(self, name: str, path: Path, *, latest: bool = False) -> None:
        raise EngineError("vLLM /v1/load_lora_adapter failed (500): no free LoRA slot")

    def unload_adapter(self, name: str) -> None: ...

    def served_adapters(self, timeout: float = 2.0) -> set[str]:
        return set()


def gateway_with_unloadable(tmp_path: Path) -> Gateway:
    gw = Gateway()
    engine = _UnloadableEngine()
    gw.add_engine(engine)  # type: ignore[arg-type]
    gw.models["m"] = ServedModel("m", engine, checkpoints={0: tmp_path / "0000"},  # type: ignore[arg-type]
                                 latest=0)
    return gw


async def test_an_on_demand_load_that_fails_is_a_503_with_retry_after(tmp_path):
    gw = gateway_with_unloadable(tmp_path)
    with pytest.raises(GatewayError) as e:
        await gw.resolve("m@0")
    assert e.value.status == 503 and "no free LoRA slot" in e.value.message
    assert e.value.headers and int(e.value.headers["Retry-After"]) > 0
    transport = httpx.ASGITransport(app=gw.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and "Retry-After" in r.headers
    assert r.json()["error"]["type"] == "service_unavailable"
    assert gw.in_flight == 0  # the failed request left the count


async def test_deep_health_names_a_served_model_that_would_not_answer(tmp_path):
    gw = gateway_with_unloadable(tmp_path)  # step 0's directory does not exist
    assert (await gw.health())["status"] == "ok"  # shallow: liveness only
    deep = await gw.health(deep=True)
    assert deep["status"] == "degraded" and deep["unservable"] == [
        "m (m@0: checkpoint missing)"]
    (tmp_path / "0000").mkdir()
    deep = await gw.health(deep=True)
    assert deep["status"] == "ok" and deep["unservable"] == []


# ---- 10. base-model limits -------------------------------------------------------------------

@pytest.mark.parametrize(("config", "limits"), [
    ({"vocab_size": 300, "max_position_embeddings": 64}, BaseLimits(300, 64)),
    ({"text_config": {"vocab_size": 301, "max_position_embeddings": 65}}, BaseLimits(301, 65)),
    ({"vocab_size": 0, "max_position_embeddings": None}, BaseLimits(None, None)),
    ({"vocab_size": "many"}, BaseLimits(None, None)),
], ids=["plain", "text_config", "zero and null", "not a number"])
def test_base_model_limits_of_a_local_directory(tmp_path, config, limits):
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert base_model_limits(str(tmp_path)) == limits


def test_base_model_limits_of_a_hub_id_from_an_offline_cache(tmp_path):
    # huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported: a fresh process
    repo = tmp_path / "hf" / "hub" / "models--tiny-org--tiny-llama"
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd" / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 1234, "max_position_embeddings": 77,
        "hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
        "intermediate_size": 128}))
    code = ("import json, time; from art_core.base_models import base_model_limits as f\n"
            "t = time.monotonic()\n"
            "out = [list(f(n).__dict__.values()) for n in "
            "('tiny-org/tiny-llama', 'no-such-org/no-such-model', 'not a valid id!')]\n"
            "print(json.dumps([out, time.monotonic() - t]))")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_CACHE", None)
    env.pop("TRANSFORMERS_CACHE", None)
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out, seconds = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == [[1234, 77], [None, None], [None, None]]
    assert seconds < 30  # offline: no network waits


# ---- 11. deeply nested JSON ------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(("path", "needle"), [
    ("/v1/chat/completions", "nested too deeply"),
    ("/v1/completions", "nested too deeply"),
    ("/v1/art/completions/batch", "body must be"),
])
async def test_a_deeply_nested_body_is_a_400_from_the_gateway(path, needle):
    transport = httpx.ASGITransport(app=Gateway().app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        r = await client.post(path, content=DEEP, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert err["code"] == 400


# ---- 12. art serve and RemoteBackend -------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real `art serve` with no model registered: no engine ever starts."""
    srv = start_server(tmp_path_factory.mktemp("faults") / "run")
    yield srv
    srv.stop()


@pytest.mark.parametrize("path", ["/art/v1/models", "/art/v1/models/proj/x/train",
                                  "/v1/chat/completions"])
def test_a_deeply_nested_body_is_a_400_from_art_serve(server, path):
    before = snapshot(server.root)
    r = httpx.post(server.url + path, content=DEEP,
                   headers={**auth(), "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.json()["error"]["message"]
    assert snapshot(server.root) == before
    assert httpx.get(server.url + "/health").status_code == 200  # still up


@pytest.mark.parametrize("registered_here", [False, True], ids=["never", "by this client"])
async def test_remote_train_of_an_unknown_model_registers_only_what_it_registered(
        server, monkeypatch, registered_here):
    rb = RemoteBackend(server.url, api_key=KEY, progress_bar=False, retry_deadline_s=5)
    typo = TrainableModel(name="typo", project="proj")
    registers: list[str] = []

    async def register(model: TrainableModel) -> Endpoint:  # the server restarted and forgot
        registers.append(model.name)
        return Endpoint(base_url=f"{server.url}/v1", api_key=KEY)

    monkeypatch.setattr(rb, "register", register)
    if registered_here:
        rb._registered.add((typo.project, typo.name))
    group = TrajectoryGroup.model_validate(
        {"trajectories": [trajectory_json(1.0), trajectory_json(0.0)]})
    t0 = time.monotonic()
    try:
        with pytest.raises(RemoteBackendError) as e:
            await rb.train(typo, [group])
    finally:
        await rb.close()
    assert e.value.status == 409 and e.value.code == "model_not_registered"
    assert ("never registered" in e.value.message) is not registered_here
    assert registers == (["typo"] if registered_here else [])  # once, then the error
    assert time.monotonic() - t0 < 5  # answered, not retried until the deadline
    assert not (server.root / "proj" / "models" / "typo").exists()


async def test_two_posts_of_one_request_id_at_once_are_one_job(tmp_path, monkeypatch):
    from art_core.serve.app import ArtServer
    from art_core.serve.jobs import TrainJob

    srv = ArtServer(tmp_path / "run")
    calls: list[str | None] = []

    async def new_job(project: str, name: str, request_id: str | None, body: Any) -> TrainJob:
        calls.append(request_id)
        await asyncio.sleep(0.05)  # parsing a large body: the other post arrives meanwhile
        if body.get("config") == "fail":
            raise ValueError("bad groups")
        return TrainJob(uuid.uuid4().hex, project, name, request_id)

    monkeypatch.setattr(srv, "_new_job", new_job)
    body = {"groups": [], "request_id": "r-1"}
    a, b = await asyncio.gather(srv.start_training("proj", "m", body),
                                srv.start_training("proj", "m", body))
    assert a is b and calls == ["r-1"]
    other = await srv.start_training("proj", "m", {**body, "request_id": "r-2"})
    assert other is not a and calls == ["r-1", "r-2"]
    bad = {"groups": [], "request_id": "r-3", "config": "fail"}
    results = await asyncio.gather(srv.start_training("proj", "m", bad),
                                   srv.start_training("proj", "m", bad),
                                   return_exceptions=True)
    assert [type(r) for r in results] == [ValueError, ValueError]
    assert calls == ["r-1", "r-2", "r-3"]
    assert srv._starting == {}  # the id is free again: a retry trains
    await srv.start_training("proj", "m", {**bad, "config": None})
    assert calls == ["r-1", "r-2", "r-3", "r-3"]


@pytest.mark.parametrize(("code", "status"), [
    (errno.ENOSPC, 507), (errno.EDQUOT, 507), (errno.EROFS, 507), (errno.ECONNREFUSED, 500)])
def test_storage_errors_are_a_507_that_names_no_absolute_path(tmp_path, code, status):
    from art_core.serve.app import ArtServer

    srv = ArtServer(tmp_path / "run")
    where = srv.root / "proj" / "models" / "m" / "checkpoints"
    err = srv._client_error(OSError(code, os.strerror(code), str(where)), "training proj/m")
    assert err.status == status
    assert str(srv.root) not in err.message
    if status == 507:
        assert err.code == "insufficient_storage" and os.strerror(code) in err.message
        assert "proj/models/m/checkpoints" in err.message


# ---- the engine: a failed sleep, a failed start, a failed wake ---------------------------------

def test_a_failed_sleep_does_not_keep_the_engine_awake_for_good(tmp_path, monkeypatch):
    engine, calls = recording_engine(tmp_path, monkeypatch)
    record = engine._post

    def post(route: str, body: Any = None, params: Any = None) -> dict[str, Any]:
        record(route, body, params)
        if calls == ["/sleep"]:
            raise EngineError("vLLM /sleep failed (500)")
        return {}

    monkeypatch.setattr(engine, "_post", post)
    with pytest.raises(EngineError):
        engine.sleep()  # LocalBackend then wakes nothing: the step never slept
    engine.sleep()  # the next step
    engine.wake_up()
    assert calls == ["/sleep", "/sleep", "/wake_up"]


async def test_a_failed_engine_start_leaves_no_engine_and_a_fixed_config_may_register(
        tiny_models, tmp_path, monkeypatch):
    starts: list[int] = []

    def start(self: VLLMEngine) -> None:  # no vLLM here: every start fails
        starts.append(self.config.max_model_len)
        raise EngineError("vLLM exited with code 1 during start-up")

    monkeypatch.setattr(VLLMEngine, "start", start)
    backend = LocalBackend(tmp_path / "run")
    backend.loggers = Loggers(backend.root, [], from_env=False)
    base = str(tiny_models["llama"])
    try:
        too_long = ModelConfig(engine=EngineConfig(max_model_len=8192))
        with pytest.raises(EngineError):
            await TrainableModel(name="a", project="p", base_model=base,
                                 config=too_long).register(backend)
        assert base not in backend.gateway.engines  # nothing served
        with pytest.raises(EngineError):  # the corrected config gets a start of its own
            await TrainableModel(name="a", project="p", base_model=base).register(backend)
        assert starts == [8192, 4096]
    finally:
        await backend.close()


async def test_a_committed_step_completes_when_the_engine_fails_to_wake(tiny_models, tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        md = model_dir(backend, model)

        def wake_up() -> None:
            raise EngineError("vLLM /wake_up failed (500)")

        backend._engines[model.base_model].wake_up = wake_up  # type: ignore[method-assign]
        try:
            result = await backend.train(model, groups_for(backend, model), CONFIG)
        finally:
            assert md.steps() == [0, 1]  # committed either way
        assert result.step == 1 and [r["step"] for r in md.read_history()] == [1]
        assert backend.gateway.models[model.name].latest == 1
    finally:
        await backend.close()


def test_a_policy_mismatch_reaches_the_client_by_name(tmp_path):
    from art_core.inference.policy_check import PolicyMismatch
    from art_core.serve.app import ArtServer

    srv = ArtServer(tmp_path / "run")
    err = srv._client_error(PolicyMismatch("agent@3: what vLLM serves does not match what the "
                                           "trainer trained", {}), "training proj/m")
    assert (err.status, err.code) == (500, "policy_mismatch")
    assert "agent@3: what vLLM serves does not match" in err.message
