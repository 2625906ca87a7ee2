"""Faults that used to cost a user a run, reproduced against the real engine (all `engine`).

- `art serve` killed (SIGKILL, by `ART_FAILPOINT`) at each point of a step and started again
  on the same port while a `RemoteBackend` retries the same request: exactly one new
  checkpoint, one history row per step, and the optimizer's moments kept (AdamW's step count
  goes on instead of starting over).
- vLLM killed with plain and streamed requests in flight: each request either succeeds after
  the restart or ends with a 503 (or a stream error event) that says the engine restarted;
  `/health` answers within 100 ms throughout.
- checkpoints deleted while vLLM restarts: the call returns at once and every remaining
  checkpoint serves afterwards; the deleted ones are 404.
- a client that gives up on a non-streamed request frees the engine within a second.
- a registration the engine cannot serve (a larger LoRA rank, other engine settings) leaves no
  served name and nothing on disk.
The unit-level halves (disk full, NaN rewards, cancelled train, ...) are tests/unit/test_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from safetensors import safe_open

from art_core import EngineConfig, ModelConfig, TrainableModel, TrainConfig, Trajectory
from art_core import TrajectoryGroup as Group
from art_core.backend.remote import RemoteBackend
from art_core.failpoints import POINTS
from tests.support.engine import tiny_config
from tests.support.server import KEY, alive, descendants, free_port, start_server

pytestmark = pytest.mark.engine

MSG = [{"role": "user", "content": "Count to five."}]


async def group_of(model: TrainableModel, n: int = 4) -> Group:
    client = model.openai_client()

    async def one(i: int) -> Trajectory:
        t = Trajectory(messages=list(MSG), reward=float(i))  # distinct rewards: a signal
        t.add_completion(await client.chat.completions.create(
            model=model.name, messages=MSG, max_tokens=6, temperature=1.0))
        return t

    return Group(trajectories=list(await asyncio.gather(*(one(i) for i in range(n)))))


def adam_steps(checkpoint: Path) -> int:
    with safe_open(str(checkpoint / "optimizer.safetensors"), framework="pt") as f:
        return int((f.metadata() or {})["step"])


async def wait_dead(proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the server did not die at its failpoint"
        await asyncio.sleep(0.1)


async def test_a_server_killed_after_training_trains_the_step_once(tmp_path, tiny_models):
    # the point with the most at stake: trained, not yet committed (test_resume kills mid-step)
    await killed_at_each_point(("trained",), tmp_path, tiny_models)


@pytest.mark.nightly
async def test_a_server_killed_at_each_point_of_a_step_trains_it_once(tmp_path, tiny_models):
    await killed_at_each_point(POINTS, tmp_path, tiny_models)


async def killed_at_each_point(points: tuple[str, ...], tmp_path, tiny_models) -> None:
    # each point kills the server once, at its own step: one restart per point
    armed = [f"{point}@{k}" for k, point in enumerate(points, start=1)]
    root, port = tmp_path / "run", free_port()
    server = start_server(root, port=port, env={"ART_FAILPOINT": ",".join(armed)})
    remote = RemoteBackend(server.url, api_key=KEY, progress_bar=False, retry_deadline_s=300)
    model = TrainableModel(name="crash", project="faults", base_model=str(tiny_models["llama"]),
                           config=tiny_config())
    md = root / "faults" / "models" / "crash"
    try:
        await model.register(remote)
        for k, point in enumerate(points, start=1):
            group = await group_of(model)
            training = asyncio.ensure_future(model.train([group], TrainConfig(
                learning_rate=1e-3)))
            await wait_dead(server.proc)  # killed at `point`, the client retrying
            assert not training.done(), f"{point}: {training.result()}"
            armed.remove(f"{point}@{k}")  # the same address; this point disarmed
            server = start_server(root, port=port, env={"ART_FAILPOINT": ",".join(armed)})
            result = await training  # the retry registers the model again, then trains
            steps = sorted(int(p.name) for p in (md / "checkpoints").iterdir()
                           if p.name.isdigit())
            assert result.step == k and steps == list(range(k + 1)), (point, steps)
            rows = [json.loads(line)["step"] for line in
                    (md / "history.jsonl").read_text().splitlines()]
            assert rows == list(range(1, k + 1)), (point, rows)  # one row per step, no gap
            assert adam_steps(md / "checkpoints" / f"{k:04d}") == k, point  # moments kept
            record = json.loads((md / "checkpoints" / f"{k:04d}" / "step.json").read_text())
            assert record["metrics"]["trained_tokens"] > 0
    finally:
        await remote.close()
        server.stop()


@pytest.fixture(scope="module")
async def tiny(backend, tiny_models) -> TrainableModel:
    model = TrainableModel(name="faults-tiny", project="faults",
                           base_model=str(tiny_models["llama"]), config=tiny_config())
    await model.register(backend)
    return model


def vllm_pids(engine) -> set[int]:
    return descendants(engine._proc.pid) if engine._proc is not None else set()


def kill_vllm(engine) -> None:
    """SIGKILL vLLM's server process (the watchdog's child), as an OOM kill would."""
    pids = sorted(vllm_pids(engine))
    assert pids, "no vLLM process"
    os.kill(pids[0], signal.SIGKILL)


async def probe_health(url: str, stop: asyncio.Event, latencies: list[float]) -> None:
    async with httpx.AsyncClient(timeout=5) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await c.get(url)
            latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200
            await asyncio.sleep(0.05)


async def test_vllm_killed_with_requests_in_flight(backend, tiny):
    engine = backend._engines[tiny.base_model]
    generation = engine.generation
    client = tiny.openai_client(max_retries=0)
    body = {"model": tiny.name, "messages": MSG, "max_tokens": 900,
            "extra_body": {"ignore_eos": True}}

    async def plain() -> str:
        try:
            await client.chat.completions.create(**body)
            return "ok"
        except openai.APIStatusError as e:
            return "503-restart" if e.status_code == 503 and "restart" in str(e) else repr(e)

    async def streamed() -> str:
        try:
            async for _ in await client.chat.completions.create(**body, stream=True):
                pass
            return "ok"
        except openai.APIError as e:
            return "stream-error-restart" if "restart" in str(e) else repr(e)

    stop, latencies = asyncio.Event(), []
    health = asyncio.ensure_future(probe_health(backend.base_url.removesuffix("/v1") + "/health",
                                                stop, latencies))
    requests = [asyncio.ensure_future(plain()) for _ in range(6)] + \
        [asyncio.ensure_future(streamed()) for _ in range(3)]
    await asyncio.sleep(0.5)  # in flight
    kill_vllm(engine)
    outcomes = await asyncio.gather(*requests)
    after = await plain()  # the restarted engine serves the model again
    stop.set()
    await health
    print(f"outcomes {outcomes}; health max {max(latencies) * 1000:.0f} ms over "
          f"{len(latencies)} probes")
    assert engine.generation == generation + 1
    assert all(o in ("ok", "503-restart", "stream-error-restart") for o in outcomes), outcomes
    assert after == "ok"
    # every probe was answered 200 (probe_health asserts it) all through the restart; how fast
    # is measured by benchmarks/engine_kill.py, never bounded here (shared machines stall)
    assert latencies


async def test_checkpoints_deleted_during_a_restart_leave_the_rest_servable(backend, tiny):
    for _ in range(3):
        await tiny.train([await group_of(tiny)], TrainConfig(learning_rate=1e-3))
    engine = backend._engines[tiny.base_model]
    kill_vllm(engine)
    deadline = time.monotonic() + 60  # a hang guard, not a speed bound
    while engine.state == "ready":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    deleted = await tiny.delete_checkpoints()
    seconds = time.perf_counter() - t0
    assert deleted and seconds < 5, (deleted, seconds)  # not held behind the restart
    await asyncio.to_thread(engine.wait_ready, 300)
    latest = await tiny.get_step()
    kept = [s for s in range(latest + 1) if s not in deleted]
    client = tiny.openai_client(max_retries=0)
    for name in [tiny.name, *(f"{tiny.name}@{s}" for s in kept)]:
        r = await client.chat.completions.create(model=name, messages=MSG, max_tokens=2)
        assert r.model_extra["art_step"] in kept, name
    for s in deleted:
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model=f"{tiny.name}@{s}", messages=MSG,
                                                 max_tokens=2)
    assert not {f"{tiny.name}@{s}" for s in deleted} & set(engine.adapters)


async def running_requests(engine) -> float:
    async with httpx.AsyncClient(timeout=5) as c:
        text = (await c.get(engine.base_url + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


async def test_a_client_that_gives_up_frees_the_engine(backend, tiny):
    engine = backend._engines[tiny.base_model]
    url = backend.base_url + "/chat/completions"
    body = {"model": tiny.name, "messages": MSG, "max_tokens": 900, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=0.5) as c:
        for _ in range(3):
            with pytest.raises(httpx.ReadTimeout):
                await c.post(url, json=body)
    t0 = time.monotonic()  # freed soon; 60 s only so that a leak fails instead of hanging
    while time.monotonic() - t0 < 60 and (backend.gateway.in_flight
                                         or await running_requests(engine)):
        await asyncio.sleep(0.05)
    assert backend.gateway.in_flight == 0 and await running_requests(engine) == 0


@pytest.mark.parametrize(("config", "needle"), [
    (ModelConfig(lora={"rank": 16}, engine=tiny_config().engine), "LoRA rank 16"),
    (ModelConfig(engine=EngineConfig(max_model_len=1024, max_num_seqs=16, serve_merged=True)),
     "engine.serve_merged=True"),
], ids=["rank", "serve_merged"])
async def test_a_registration_the_engine_cannot_serve_leaves_nothing(backend, tiny, config,
                                                                     needle):
    ghost = TrainableModel(name="ghost", project="faults", base_model=tiny.base_model,
                           config=config)
    with pytest.raises(ValueError, match=needle):
        await ghost.register(backend)
    ids = {m.id for m in (await tiny.openai_client().models.list()).data}
    assert "ghost" not in ids and "ghost@0" not in ids
    assert not (backend.root / "faults" / "models" / "ghost").exists()
    assert alive(backend._engines[tiny.base_model]._proc.pid)
