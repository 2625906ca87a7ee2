"""Faults without vLLM: what a training step, a registration, the gateway and `art serve` do
when something goes wrong, and what they leave behind.

Checked here (the real trainer on the tiny random llama; the engine is tests/support/runs.py's
StubEngine; one real `art serve` subprocess that never starts an engine):
- bad input is refused before anything is journaled, naming what is wrong: a NaN reward
  however it got in, a sequence longer than the limit, a model that is not registered;
- a step that fails for a reason a retry cannot fix is marked failed (never replayed), one a
  retry can fix stays interrupted (replayed); the gate and the engine are given back either way;
- a full disk at any save point commits nothing, leaves no temp directory, keeps serving the
  previous step, and the next step starts from the last checkpoint (the failed step's optimizer
  update does not leak); a disk without room is refused before the journal;
- a step commits as one unit (adapter, optimizer, request id, metrics) and its history row is
  rebuilt from it; step 0 never gets one;
- a cancelled `train()` neither loses its step nor leaks the model's lock;
- a registration the running engine cannot serve is refused naming the setting, and a failed
  registration leaves nothing served and, for a new model only, nothing on disk;
- the gateway's gate and the engine's sleep are counted; an on-demand load that fails is a 503;
- base-model limits come from an offline Hugging Face cache, and an unknown id is no crash;
- a JSON body nested too deeply is a 400, not a 500 (gateway and `art serve`);
- `art serve`: one job per request id posted twice at once, full disks answered 507;
  `RemoteBackend` never registers a model it did not register (a typo).
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
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
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)
from art_core.backend.remote import RemoteBackend, RemoteBackendError
from art_core.base_models import BaseLimits, base_model_limits, resolve_base_model
from art_core.inference.engine import EngineError, VLLMEngine
from art_core.inference.gateway import Gateway, GatewayError, ServedModel
from art_core.model import Endpoint
from art_core.observe.loggers import Loggers
from art_core.storage import ModelDir
from art_core.train.errors import RetryableStepError
from art_core.trajectory import longest_sequence
from tests.support.runs import CONFIG, StubEngine, agent_groups, make_backend, tokenizer
from tests.support.server import KEY, Server, auth, snapshot, start_server, trajectory_json

REPO = Path(__file__).resolve().parents[2]
NAN = float("nan")


# ---- helpers ---------------------------------------------------------------------------------

def model_dir(backend: LocalBackend, model: TrainableModel) -> ModelDir:
    return ModelDir(backend.root, model.project, model.name)


def journal_files(md: ModelDir) -> list[str]:
    return sorted(p.name for p in md.journal.iterdir()) if md.journal.exists() else []


def temp_dirs(md: ModelDir) -> list[str]:
    return [p.name for p in md.checkpoints.iterdir() if p.name.startswith(".tmp")]


def groups_for(backend: LocalBackend, model: TrainableModel, step: int = 0
               ) -> list[TrajectoryGroup]:
    """One group with reward variance: the cheapest step that trains."""
    return agent_groups(tokenizer(backend, model), step)[:1]


def long_trajectory(n_prompt: int, reward: float = 0.5) -> Trajectory:
    return Trajectory(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        turns=[{"message_index": 1, "prompt_token_ids": [5] * n_prompt,
                "completion_token_ids": [6, 7], "logprobs": [-1.0, -1.0]}],
        reward=reward)


def bare_backend(root: Path, base_model: str) -> tuple[LocalBackend, StubEngine]:
    """A LocalBackend with a StubEngine for `base_model` and nothing registered yet."""
    backend = LocalBackend(root)
    backend.loggers = Loggers(backend.root, [], from_env=False)
    engine = StubEngine(base_model)
    backend._engines[base_model] = engine  # type: ignore[assignment]
    backend.gateway.add_engine(engine)  # type: ignore[arg-type]
    return backend, engine


def adapter_tensors(checkpoint: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "adapter_model.safetensors"))


# ---- 1. NaN rewards --------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("reward", NAN), ("reward", float("inf")), ("reward", float("-inf")),
    ("metrics", {"score": NAN}), ("metadata", {"x": float("inf")}),
])
def test_assigning_a_non_finite_value_raises_and_keeps_the_old_one(field, value):
    t = long_trajectory(4, reward=0.25)
    before = getattr(t, field)
    with pytest.raises(ValueError, match="finite"):
        setattr(t, field, value)
    assert getattr(t, field) == before


def _setattr(t: Trajectory, v: float) -> Trajectory:
    object.__setattr__(t, "reward", v)  # what validate_assignment cannot see
    return t


BYPASSES = {
    "object.__setattr__": _setattr,
    "model_copy(update=)": lambda t, v: t.model_copy(update={"reward": v}),
    "model_construct": lambda t, v: Trajectory.model_construct(**{**dict(t), "reward": v}),
}


@pytest.mark.parametrize("bypass", BYPASSES)
@pytest.mark.parametrize("value", [NAN, float("inf")], ids=["nan", "inf"])
async def test_a_non_finite_reward_that_got_in_is_refused_before_the_journal(
        tiny_models, tmp_path, bypass, value):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        md = model_dir(backend, model)
        group = groups_for(backend, model)[0]
        group.trajectories[2] = BYPASSES[bypass](group.trajectories[2], value)
        assert not math.isfinite(group.trajectories[2].reward)  # the bypass worked
        with pytest.raises(ValueError, match=r"groups\[0\]\.trajectories\[2\]\.reward"):
            await backend.train(model, [group], CONFIG)
        assert journal_files(md) == [] and md.steps() == [0] and md.read_history() == []
        assert not backend.gateway.paused
    finally:
        await backend.close()


async def test_remote_backend_refuses_a_nan_reward_without_a_request():
    # port 9 (discard) on loopback: nothing listens; a request would be "cannot reach"
    rb = RemoteBackend("http://127.0.0.1:9", api_key=KEY, progress_bar=False)
    t = _setattr(Trajectory.model_validate(trajectory_json()), NAN)
    with pytest.raises(ValueError, match=r"groups\[0\]\.trajectories\[0\]\.reward"):
        await rb.train(TrainableModel(name="m", project="proj"),
                       [TrajectoryGroup(trajectories=[t])])
    await rb.close()


# ---- 2. over-long sequences ------------------------------------------------------------------

async def test_an_over_long_trajectory_is_refused_before_the_journal(tiny_models, tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        md = model_dir(backend, model)
        normal = agent_groups(tokenizer(backend, model), 0)
        longest = max(longest_sequence(t) for g in normal for t in g)
        context = base_model_limits(model.base_model).context
        assert context is not None and context > longest
        cases = [
            # (groups, config, the trajectory named, its length, the limit)
            (normal, TrainConfig(max_sequence_tokens=16), "groups[0].trajectories[0]",
             longest_sequence(normal[0].trajectories[0]), 16),
            # only the last trajectory is too long: it is the one named
            ([normal[0], TrajectoryGroup(trajectories=[normal[1].trajectories[0],
                                                       long_trajectory(longest)])],
             TrainConfig(max_sequence_tokens=longest), "groups[1].trajectories[1]",
             longest + 2, longest),
            # no limit given: the base model's context length (max_position_embeddings)
            ([TrajectoryGroup(trajectories=[long_trajectory(context), long_trajectory(3, 0.0)])],
             TrainConfig(), "groups[0].trajectories[0]", context + 2, context),
        ]
        for groups, config, named, n, limit in cases:
            with pytest.raises(ValueError) as e:
                await backend.train(model, groups, config)
            assert f"{named} has a sequence of {n} tokens" in str(e.value)
            assert f"limit of {limit}" in str(e.value)
            assert journal_files(md) == [] and md.steps() == [0]
        assert not backend.gateway.paused
    finally:
        await backend.close()


# ---- 3. failed vs interrupted steps ----------------------------------------------------------

@pytest.mark.parametrize(("error", "failed"), [
    (ValueError("a bad group"), True),
    (FloatingPointError("non-finite gradient norm"), True),
    (RuntimeError("shape mismatch"), True),
    (OSError(errno.EIO, "Input/output error"), False),
    (TimeoutError("ranks timed out"), False),
    (RetryableStepError("rank 1 died"), False),
    (EngineError("vLLM /sleep failed"), False),
], ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else str(x))
async def test_a_step_that_cannot_succeed_is_marked_failed_one_that_can_stays_interrupted(
        tiny_models, tmp_path, monkeypatch, error, failed):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        md = model_dir(backend, model)
        calls = []

        def step(self, groups, config):
            calls.append(len(groups))
            raise error

        monkeypatch.setattr("art_core.train.trainer.Trainer.step", step)
        groups = groups_for(backend, model)
        with pytest.raises(type(error)):
            await backend.train(model, groups, CONFIG)
        assert md.steps() == [0] and calls == [1]
        assert not backend.gateway.paused  # the gate opened again
        assert (model.project, model.name) not in backend.trainers.cached  # rolled back
        if failed:
            assert md.interrupted_steps() == []
            assert md.failed_steps() == {1: f"{type(error).__name__}: {error}"}
            assert journal_files(md) == ["0001.failed.json", "0001.failed.jsonl"]
            assert md.journaled(1) is None
            assert await backend.replay_interrupted(model, CONFIG) == []
            assert calls == [1]  # not retried
        else:
            assert md.interrupted_steps() == [1] and md.failed_steps() == {}
            assert [g.model_dump() for g in md.journaled(1)] == [g.model_dump() for g in groups]
            with pytest.raises(type(error)):  # replayed: the same groups train again
                await backend.replay_interrupted(model, CONFIG)
            assert calls == [1, 1] and md.interrupted_steps() == [1]
    finally:
        await backend.close()


# ---- 4. full disks ---------------------------------------------------------------------------

def _full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def _adapter_half_written(self, out_dir: Path) -> None:
    (Path(out_dir) / "adapter_model.safetensors").write_bytes(b"\0" * 100)
    raise _full()


def _optimizer_half_written(self, path: Path, checkpoint: int) -> None:
    Path(str(path) + ".tmp").write_bytes(b"\0" * 100)
    raise _full()


def _record_half_written(self, tmp: Path, step: int, record: Any = None) -> Path:
    (Path(tmp) / "step.json").write_text('{"st')
    raise _full()


SAVE_POINTS = {
    "art_core.train.trainer.Trainer.save_adapter": _adapter_half_written,
    "art_core.train.trainer.Trainer.save_optimizer": _optimizer_half_written,
    "art_core.storage.ModelDir.commit_checkpoint": _record_half_written,
}


@pytest.mark.parametrize("target", SAVE_POINTS, ids=lambda t: t.rsplit(".", 1)[1])
async def test_a_full_disk_at_a_save_point_commits_nothing_and_rolls_the_trainer_back(
        tiny_models, tmp_path, monkeypatch, target):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        md = model_dir(backend, model)
        engine = backend._engines[model.base_model]
        groups = groups_for(backend, model)
        monkeypatch.setattr(target, SAVE_POINTS[target])
        with pytest.raises(OSError, match="No space left") as e:
            await backend.train(model, groups, CONFIG)
        assert e.value.errno == errno.ENOSPC
        assert md.steps() == [0] and md.latest_step() == 0 and temp_dirs(md) == []
        assert md.read_history() == []
        assert backend.gateway.models[model.name].latest == 0  # still serves step 0
        assert engine.loads == [f"{model.name}@0"]
        assert not backend.gateway.paused
        assert md.interrupted_steps() == [1] and md.failed_steps() == {}  # a retry can fix it
        # the trainer that stepped in memory is gone: the next step reloads checkpoint 0
        assert (model.project, model.name) not in backend.trainers.cached
        monkeypatch.undo()  # space again

        result = await backend.train(model, groups, CONFIG)
        assert result.step == 1 and md.steps() == [0, 1] and md.interrupted_steps() == []
        assert engine.loads[-1] == f"{model.name}@1"

        def from_checkpoint_0(out: Path) -> None:  # on the trainers' torch thread, as they do
            from art_core.train.trainer import Trainer

            fresh = Trainer(resolve_base_model(model.base_model), model.config.lora)
            fresh.load_adapter(md.checkpoint(0))
            assert not fresh.load_optimizer(md.optimizer(0), CONFIG, checkpoint=0)
            fresh.step(groups, CONFIG)
            fresh.save_adapter(out)

        await asyncio.wrap_future(backend.trainers.submit(from_checkpoint_0, tmp_path / "ref"))
        got, want = adapter_tensors(md.checkpoint(1)), adapter_tensors(tmp_path / "ref")
        assert got.keys() == want.keys()
        start = adapter_tensors(md.checkpoint(0))
        assert any(not (got[k] == start[k]).all() for k in got)  # the step did train
        for k in got:  # and only once, from checkpoint 0
            assert (got[k] - want[k]).abs().max().item() < 1e-6, k
    finally:
        await backend.close()


async def test_a_disk_without_room_is_refused_before_the_journal(tiny_models, tmp_path,
                                                                 monkeypatch):
    import shutil

    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        md = model_dir(backend, model)
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr("art_core.storage.shutil.disk_usage",
                            lambda path: type(usage)(usage.total, usage.total - 1024, 1024))
        with pytest.raises(OSError, match="No space left on device") as e:
            await backend.train(model, groups_for(backend, model), CONFIG)
        assert e.value.errno == errno.ENOSPC
        assert journal_files(md) == [] and md.steps() == [0] and md.interrupted_steps() == []
        assert not backend.gateway.paused
    finally:
        await backend.close()


# ---- 5. a step commits as one unit -----------------------------------------------------------

async def test_a_step_commits_its_request_id_metrics_and_optimizer_and_history_is_rebuilt(
        tiny_models, tmp_path):
    root = tmp_path / "run"
    backend, model = await make_backend(root, tiny_models["llama"])
    try:
        md = model_dir(backend, model)
        r1 = await backend.train(model, groups_for(backend, model), CONFIG, request_id="r1")
        rec = md.step_record(1)
        assert rec is not None and (rec["step"], rec["kind"], rec["request_id"]) == (1, "rl", "r1")
        assert isinstance(rec["committed_at"], float)
        assert rec["metrics"] and rec["metrics"].items() <= r1.metrics.items()
        assert (md.checkpoint(1) / "optimizer.safetensors").is_file()
        assert not (md.checkpoint(0) / "optimizer.safetensors").exists()
        assert md.step_record(0)["kind"] == "init"
        assert md.answered("r1")["step"] == 1 and md.answered("r2") is None

        await backend.train(model, groups_for(backend, model, 1), CONFIG, request_id="r2")
        assert (md.checkpoint(2) / "optimizer.safetensors").is_file()
        assert not (md.checkpoint(1) / "optimizer.safetensors").exists()  # the latest only
        assert md.answered("r1")["step"] == 1 and md.answered("r2")["step"] == 2
        assert [r["step"] for r in md.read_history()] == [1, 2]
    finally:
        await backend.close()

    def drop_row(step: int) -> None:  # as if the process died between commit and append
        rows = [r for r in md.read_history() if r["step"] != step]
        md.history.write_text("".join(json.dumps(r) + "\n" for r in rows))

    drop_row(1)
    assert md.repair_history() == [1]
    assert md.repair_history() == []  # once
    rows = {r["step"]: r for r in md.read_history()}
    assert sorted(rows) == [1, 2]  # step 0 (kind "init") never gets a row
    assert {k: rows[1][k] for k in rec["metrics"]} == rec["metrics"]

    drop_row(2)  # and a registration rebuilds it too
    backend, model = await make_backend(root, tiny_models["llama"])
    try:
        assert sorted(r["step"] for r in md.read_history()) == [1, 2]
        assert await backend.get_step(model) == 2
    finally:
        await backend.close()


# ---- 6. cancelled train() ------------------------------------------------------------------

@pytest.mark.parametrize("when", ["at once", "mid-step", "queued"])
async def test_a_cancelled_train_neither_loses_its_step_nor_leaks_the_lock(
        tiny_models, tmp_path, when):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    md = model_dir(backend, model)
    journaled: list[int] = []
    started = asyncio.Event()

    def progress(event: dict[str, Any]) -> None:
        if event["phase"] == "journaled":
            journaled.append(event["step"])
            started.set()

    def train(step: int, **kw: Any) -> Any:
        return backend.train(model, groups_for(backend, model, step), CONFIG, **kw)

    try:
        if when == "at once":
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(train(0, progress=progress), 0.01)
            later = await asyncio.wait_for(train(1), 60)
            # the first step, if it got as far as starting, finished before the later one
            assert later.step == (2 if journaled else 1)
        elif when == "mid-step":
            first = asyncio.ensure_future(train(0, progress=progress))
            await asyncio.wait_for(started.wait(), 30)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            later = await asyncio.wait_for(train(1), 60)
            assert later.step == 2 and journaled == [1]
        else:  # cancelled while waiting for the model's lock: it must never run
            first = asyncio.ensure_future(train(0, progress=progress))
            await asyncio.wait_for(started.wait(), 30)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(train(0), 0.05)
            assert (await first).step == 1
            later = await asyncio.wait_for(train(1), 60)
            assert later.step == 2
        assert md.steps() == list(range(later.step + 1))
        assert [r["step"] for r in md.read_history()] == list(range(1, later.step + 1))
        assert not backend.gateway.paused
    finally:
        await asyncio.wait_for(backend.close(), 60)
    assert md.steps() == list(range(later.step + 1))  # nothing else trained after
    assert journal_files(md) == [f"{s:04d}.jsonl" for s in range(1, later.step + 1)]


# ---- 7. unregistered models ------------------------------------------------------------------

@pytest.mark.parametrize(("name", "project"), [("agnet", "demo"), ("agent", "other")],
                         ids=["typo", "other project"])
async def test_an_unregistered_model_is_refused_and_nothing_is_created(
        tiny_models, tmp_path, name, project):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        typo = TrainableModel(name=name, project=project, base_model=model.base_model)
        groups = groups_for(backend, model)
        before = snapshot(backend.root)
        with pytest.raises(ValueError, match="is not registered"):
            await backend.train(typo, groups, CONFIG)
        with pytest.raises(ValueError, match="is not registered"):
            await backend.log(typo, groups)
        assert not model_dir(backend, typo).path.exists()
        assert snapshot(backend.root) == before
        assert set(backend.gateway.models) == {"agent"}
    finally:
        await backend.close()


# ---- 8. registrations the engine cannot serve ------------------------------------------------

def _failing_loads(engine: StubEngine, model_name: str) -> None:
    original = engine.load_adapter

    def load_adapter(name: str, path: Path) -> None:
        if name.startswith(model_name + "@"):
            raise EngineError("vLLM /v1/load_lora_adapter failed (500): out of memory")
        original(name, path)

    engine.load_adapter = load_adapter  # type: ignore[method-assign]


REFUSED = [  # (id, model config, error, what its message names)
    ("serve_merged", ModelConfig(engine=EngineConfig(serve_merged=True)), ValueError,
     "engine.serve_merged=True (running: False)"),
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
    before = snapshot(root)

    backend, engine = bare_backend(root, model.base_model)  # a restart, the engine failing
    try:
        _failing_loads(engine, model.name)
        with pytest.raises(EngineError):
            await model.register(backend)
        assert model.name not in backend.gateway.models
        assert md.steps() == [0, 1]
        assert {k: v for k, v in snapshot(root).items() if k in before} == before
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

    def load_adapter(self, name: str, path: Path) -> None:
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


def test_two_posts_of_one_request_id_at_once_are_one_job(tmp_path, monkeypatch):
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

    async def main() -> None:
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

    asyncio.run(main())


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
