"""Faults of a training step without vLLM (the real trainer on the tiny random llama; the
engine is tests/support/runs.py's StubEngine), and what they leave behind:
- bad input is refused before anything is journaled, naming what is wrong: a NaN reward
  however it got in, a sequence longer than the limit, a model that is not registered;
- a step that fails for a reason a retry cannot fix is marked failed (never replayed), one a
  retry can fix stays interrupted (replayed); the gate and the engine are given back either way;
- a full disk at any save point commits nothing, leaves no temp directory, keeps serving the
  previous step, and the next step starts from the last checkpoint (the failed step's optimizer
  update does not leak); a disk without room is refused before the journal;
- a step commits as one unit (adapter, optimizer, request id, metrics) and its history row is
  rebuilt from it; step 0 never gets one;
- a cancelled `train()` neither loses its step nor leaks the model's lock.
Registration, the gateway and `art serve`: tests/unit/test_serving_faults.py.
"""

from __future__ import annotations

import asyncio
import errno
import json
import math
from pathlib import Path
from typing import Any

import pytest

from art_core import (
    SFTConfig,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)
from art_core.backend.remote import RemoteBackend
from art_core.base_models import base_model_limits, resolve_base_model
from art_core.inference.engine import EngineError
from art_core.train.errors import RetryableStepError
from art_core.trajectory import longest_sequence
from tests.support.runs import (
    CONFIG,
    adapter_tensors,
    agent_groups,
    groups_for,
    journal_files,
    make_backend,
    model_dir,
    temp_dirs,
    tokenizer,
)
from tests.support.server import KEY, snapshot, trajectory_json

SFT = SFTConfig(learning_rate=1e-2, epochs=1, bf16=False)

NAN = float("nan")




def long_trajectory(n_prompt: int, reward: float = 0.5) -> Trajectory:
    return Trajectory(
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        turns=[{"message_index": 1, "prompt_token_ids": [5] * n_prompt,
                "completion_token_ids": [6, 7], "logprobs": [-1.0, -1.0]}],
        reward=reward)



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


@pytest.mark.parametrize("kind", ["rl", "sft"])
async def test_a_retry_of_a_call_cancelled_mid_step_is_answered_not_trained_again(
        tiny_models, tmp_path, kind):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    md = model_dir(backend, model)
    started = asyncio.Event()

    def progress(event: dict[str, Any]) -> None:
        if event["phase"] == "journaled":
            started.set()

    def call(step: int, **kw: Any) -> Any:
        groups = groups_for(backend, model, step)
        if kind == "sft":
            return backend.train_sft(model, [t for g in groups for t in g], SFT, **kw)
        return backend.train(model, groups, CONFIG, **kw)

    try:
        first = asyncio.ensure_future(call(0, progress=progress))
        await asyncio.wait_for(started.wait(), 30)
        first.cancel()  # as asyncio.wait_for would on a timeout
        with pytest.raises(asyncio.CancelledError):
            await first
        retry = await asyncio.wait_for(call(0), 60)  # the same call again
        again = await asyncio.wait_for(call(0), 60)  # an ordinary call after it: trains
        other = await asyncio.wait_for(call(1), 60)
        assert (retry.step, again.step, other.step) == (1, 2, 3)
        assert md.steps() == [0, 1, 2, 3]
        assert [f for f in journal_files(md) if f.endswith(".jsonl")] == \
            ["0001.jsonl", "0002.jsonl", "0003.jsonl"]
    finally:
        await asyncio.wait_for(backend.close(), 60)


async def test_a_retry_of_a_call_whose_step_failed_trains_anew(tiny_models, tmp_path):
    from art_core.backend.orphans import Orphans

    orphans, key = Orphans(), (lambda: "k")

    async def fails() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("the step failed")

    task = asyncio.ensure_future(fails())
    waiter = asyncio.ensure_future(orphans.wait(task, key))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert orphans.claim(key) is task  # remembered while it runs
    orphans._remember("k", task)
    with pytest.raises(RuntimeError):
        await task
    await asyncio.sleep(0)
    assert orphans.claim(key) is None  # forgotten once it failed: a retry trains anew


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




# ---- 8. a served policy that is not the trained one ------------------------------------------

@pytest.mark.parametrize(("drift", "off_policy", "warned"), [
    (0.02, 0.0, False),  # numerics: normal
    (0.30, 0.0, True),  # on-policy turns far from the trainer: the engine served something else
    (0.30, 0.5, False),  # older policies sampled some turns: a difference is expected
])
def test_a_step_warns_when_the_served_policy_was_not_the_trained_one(caplog, drift, off_policy,
                                                                     warned):
    from art_core.backend.step import check_served_policy

    metrics = {"sampler_trainer_prob_diff": drift, "frac_turns_off_policy": off_policy}
    with caplog.at_level("WARNING", logger="art_core.backend.step"):
        check_served_policy(metrics, 4, "demo/agent")
    assert bool([r for r in caplog.records if "step 4" in r.message]) == warned
    assert metrics.get("served_policy_drift_warning", 0.0) == float(warned)
