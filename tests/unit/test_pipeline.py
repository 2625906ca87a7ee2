"""The pipelined trainer without vLLM (art_core/pipeline/): the real LocalBackend and trainer on
the tiny random llama, the engine a stand-in (tests/support/runs.py), rollouts made up with the
step they read (tests/support/pipeline.py), so that when a group was sampled is under the
test's control:
- steps train as soon as enough groups are complete; every group is stored before it trains
  and journaled by exactly one step;
- a group whose oldest turn is more than `max_steps_off_policy` behind is dropped and counted;
  one within the bound trains with its own steps and logprobs (the step's metrics say so);
- the store's recovery, table-driven; a pipeline killed at each point of a step and run again
  loses no group and trains no committed step twice (a process of its own, SIGKILLed);
- LocalBackend.train with the request id of a committed step answers with it.
The real engine (turns across a swap, both device modes, the three ways in, RemoteBackend):
tests/engine/test_pipeline.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from art_core import PipelineTrainer, TrajectoryGroup
from art_core.pipeline.store import Buffered, PipelineStore
from art_core.train import batch as B
from art_core.trajectory import off_policy_metrics, steps_off_policy
from tests.support.pipeline import made_up_rollout
from tests.support.runs import CONFIG, groups_for, make_backend, model_dir, tokenizer

ROOT = Path(__file__).resolve().parents[2]


def journaled_ids(md, step: int) -> list[str]:
    return [g.metadata["pipeline_group"] for g in md.journaled(step)]


def pipeline(model, rollout, run_dir: Path, **kw) -> PipelineTrainer:
    # made-up rollouts alternate rewards across concurrent groups, so a group may score alike:
    # dynamic sampling is off unless a test is about it (it would replace such groups)
    kw = {"groups_per_step": 2, "rollouts_per_group": 2, "train_config": CONFIG,
          "show_progress": False, "print_fn": lambda line: None, "oversample": None, **kw}
    return PipelineTrainer(model, rollout, ["a", "b", "c", "d"], run_dir=run_dir, **kw)


async def test_steps_train_on_stored_groups_each_journaled_once(tiny_models, tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    lines: list[str] = []
    try:
        rollout = made_up_rollout(model, tokenizer(backend, model))
        result = await pipeline(model, rollout, tmp_path / "pipe",
                                print_fn=lines.append).run(3)
        md = model_dir(backend, model)
        assert [r["step"] for r in result.steps] == [1, 2, 3] and md.steps() == [0, 1, 2, 3]
        ids = [journaled_ids(md, s) for s in (1, 2, 3)]
        flat = [i for step_ids in ids for i in step_ids]
        assert all(len(step_ids) == 2 for step_ids in ids) and len(set(flat)) == 6
        stored = {json.loads(line)["id"] for line in
                  (tmp_path / "pipe" / "groups.jsonl").read_text().splitlines()}
        assert set(flat) <= stored  # stored before trained; the rest wait in the pool
        committed = [e for e in PipelineStore(tmp_path / "pipe").events()
                     if e["event"] == "committed"]
        assert [e["step"] for e in committed] == [1, 2, 3]
        for row in result.steps:
            assert {"off_policy_steps_mean", "frac_turns_off_policy", "wait_seconds",
                    "groups_in_flight", "reward_mean"} <= set(row)
        assert len(lines) == 3 and lines[0].startswith("step 1: train reward")
        history = md.read_history()
        assert [r["step"] for r in history] == [1, 2, 3]
        assert all("off_policy_steps_max" in r for r in history)
    finally:
        await backend.close()


@pytest.mark.parametrize(("oversample", "skipped"), [(3.0, True), (None, False)],
                         ids=["dynamic-sampling", "off"])
async def test_groups_without_signal_are_replaced_within_the_budget(tiny_models, tmp_path,
                                                                    oversample, skipped):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        tok = tokenizer(backend, model)
        alternating = made_up_rollout(model, tok)

        async def rollout(scenario: str):
            t = await alternating(scenario)
            if scenario in ("a", "b"):
                t.reward = 1.0  # every episode of a and b alike: no signal
            return t

        trainer = pipeline(model, rollout, tmp_path / "pipe", oversample=oversample)
        result = await trainer.run(2)
        md = model_dir(backend, model)
        trained = [g for s in (1, 2) for g in md.journaled(s)]
        assert len(trained) == 4
        assert all(g.has_signal for g in trained) == skipped
        assert (result.skipped_no_signal > 0) == skipped
        assert sum(r["skipped_no_signal"] for r in result.steps) == result.skipped_no_signal
        dropped = [e for e in PipelineStore(tmp_path / "pipe").events()
                   if e["event"] == "dropped" and e["reason"] == "no_signal"]
        assert len(dropped) == (result.skipped_no_signal if skipped else 0)
    finally:
        await backend.close()


@pytest.mark.parametrize(("behind", "dropped"), [(1, False), (2, True)],
                         ids=["one-step-behind-trains", "two-steps-behind-dropped"])
async def test_a_straggler_trains_within_the_bound_and_is_dropped_beyond_it(
        tiny_models, tmp_path, behind, dropped):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    slow: dict[str, str] = {}

    async def hold(scenario: str, step: int) -> None:
        # The first group drawn, at step 0, finishes only once the policy is `behind` ahead
        # (noticed within 0.05 s); the next one at once (step 1 trains on it); every later one
        # 1 s after the policy has passed the step it started at. So the slow group, freed by a
        # step, is stored before any group started under the same policy however long a step
        # takes (a fixed 0.5 s lost that race on a loaded machine, where a step took longer).
        if slow.setdefault("scenario", scenario) == scenario and step == 0:
            while await model.get_step() < behind:
                await asyncio.sleep(0.05)
        elif slow.setdefault("next", scenario) != scenario or step > 0:
            while await model.get_step() <= step:
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)

    try:
        rollout = made_up_rollout(model, tokenizer(backend, model), hold)
        result = await pipeline(model, rollout, tmp_path / "pipe", groups_per_step=1,
                                max_groups_in_flight=2, max_steps_off_policy=1).run(3)
        md = model_dir(backend, model)
        stored = [json.loads(line) for line in
                  (tmp_path / "pipe" / "groups.jsonl").read_text().splitlines()]
        (slow_id,) = [r["id"] for r in stored if r["started_step"] == 0 and
                      slow["scenario"] in r["group"]["trajectories"][0]["messages"][0]["content"]]
        events = PipelineStore(tmp_path / "pipe").events()
        dropped_ids = [i for e in events if e["event"] == "dropped" for i in e["groups"]]
        assert result.dropped_stale == len(dropped_ids)
        assert sum(r["dropped_stale"] for r in result.steps) == len(dropped_ids)
        trained_in = [s for s in md.steps()[1:] if slow_id in journaled_ids(md, s)]
        if dropped:
            assert slow_id in dropped_ids and not trained_in
            (drop,) = [e for e in events if e["event"] == "dropped" and slow_id in e["groups"]]
            assert drop["reason"] == "stale" and drop["policy_step"] == 2
        else:  # trained one step late, with the step and logprobs it was sampled with
            assert slow_id not in dropped_ids and len(trained_in) == 1
            row = next(r for r in result.steps if r["step"] == trained_in[0])
            assert row["off_policy_steps_max"] == 1 and row["frac_turns_off_policy"] > 0
            group = next(g for g in md.journaled(trained_in[0])
                         if g.metadata["pipeline_group"] == slow_id)
            turn = group.trajectories[0].turns[0]
            assert turn.step == 0 and turn.logprobs[0] == -1.0  # as sampled at step 0
        # nothing staler than the bound was trained
        assert max(r["off_policy_steps_max"] for r in result.steps) <= 1
        assert md.steps() == [0, 1, 2, 3]
    finally:
        await backend.close()


async def test_a_group_that_can_only_finish_too_stale_is_cancelled(tiny_models, tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    slow: dict[str, str] = {}
    cancelled = asyncio.Event()

    async def hold(scenario: str, step: int) -> None:
        if slow.setdefault("scenario", scenario) == scenario and step == 0:
            try:
                await asyncio.Event().wait()  # a rollout that never finishes by itself
            except asyncio.CancelledError:
                cancelled.set()
                raise
        await asyncio.sleep(0.2)

    try:
        rollout = made_up_rollout(model, tokenizer(backend, model), hold)
        result = await pipeline(model, rollout, tmp_path / "pipe", groups_per_step=1,
                                max_groups_in_flight=2, max_steps_off_policy=1).run(4)
        # started under step 0, its first turn came from step 0 or 1: at step 3 it is doomed
        assert cancelled.is_set() and result.cancelled_stale == 1
        assert [r["cancelled_stale"] for r in result.steps] == [0, 0, 0, 1]
        assert result.dropped_stale == 0 and model_dir(backend, model).steps() == [0, 1, 2, 3, 4]
    finally:
        await backend.close()


def test_turns_of_older_adapters_carry_their_step_and_logprobs_into_the_loss(tiny_models):
    from art_core import Trajectory

    traj = Trajectory(
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}],
        turns=[{"message_index": 1, "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4],
                "logprobs": [-0.5, -0.25], "step": 3},
               {"message_index": 3, "prompt_token_ids": [1, 2, 3, 4, 5],
                "completion_token_ids": [6], "logprobs": [-2.0], "step": 4}],
        reward=1.0)
    (seq,) = B.build_sequences(traj, 1.0, 0)  # one sequence across the swap
    assert seq.token_ids == [1, 2, 3, 4, 5, 6]
    assert seq.old_logprobs == [0.0, 0.0, -0.5, -0.25, 0.0, -2.0]  # each turn's own sampler
    group = TrajectoryGroup(trajectories=[traj, traj.model_copy(update={"reward": 0.0})])
    assert steps_off_policy(group, 4) == 1 and steps_off_policy(group, 3) == 0
    m = off_policy_metrics([group], 4)
    assert m == {"off_policy_steps_mean": 0.5, "off_policy_steps_max": 1.0,
                 "frac_turns_off_policy": 0.5}
    assert off_policy_metrics([group], 3)["off_policy_steps_max"] == 0.0
    assert math.isclose(off_policy_metrics([group], 6)["off_policy_steps_mean"], 2.5)


def _group(reward: float = 1.0) -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[], metadata={"r": reward})


# (events after groups g1..g4 were stored) -> (pool ids, pending request id and its groups)
RECOVERY = {
    "nothing trained": ([], (["g1", "g2", "g3", "g4"], None)),
    "one step committed": ([("train", "r1", ["g1", "g2"]), ("committed", "r1", 1)],
                           (["g3", "g4"], None)),
    "killed after asking": ([("train", "r1", ["g1", "g2"])], (["g3", "g4"], ("r1", ["g1", "g2"]))),
    "committed, then asked again": ([("train", "r1", ["g1", "g2"]), ("committed", "r1", 1),
                                     ("train", "r2", ["g3"])], (["g4"], ("r2", ["g3"]))),
    "dropped stale": ([("dropped", ["g2", "g4"])], (["g1", "g3"], None)),
    "superseded ask gives its groups back": ([("train", "r1", ["g1"]), ("train", "r2", ["g2"])],
                                             (["g1", "g3", "g4"], ("r2", ["g2"]))),
}


@pytest.mark.parametrize("case", RECOVERY)
def test_store_recovery(tmp_path, case):
    events, (pool, pending) = RECOVERY[case]
    store = PipelineStore(tmp_path)
    for i in range(1, 5):
        store.add(Buffered(f"g{i}", 0, _group(i)))
    by_id = {f"g{i}": Buffered(f"g{i}", 0, _group(i)) for i in range(1, 5)}
    for e in events:
        if e[0] == "train":
            store.train(e[1], [by_id[i] for i in e[2]], 0)
        elif e[0] == "committed":
            store.committed(e[1], e[2], {"loss": 0.0})
        else:
            store.dropped([by_id[i] for i in e[1]], "stale", 2)
    with store.groups_file.open("a") as f:
        f.write('{"id": "torn", "started')  # a kill mid-append: skipped, not fatal
    got_pool, got_pending = store.recover()
    assert [b.id for b in got_pool] == pool
    assert [b.group.metadata["r"] for b in got_pool] == [float(i[1]) for i in pool]
    if pending is None:
        assert got_pending is None
    else:
        assert (got_pending.request_id, [b.id for b in got_pending.groups]) == \
            (pending[0], pending[1])


def _run_worker(root: Path, base: Path, pipe: Path, steps: int, failpoint: str | None
                ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("ART_FAILPOINT", None)
    if failpoint:
        env["ART_FAILPOINT"] = failpoint
    return subprocess.run(
        [sys.executable, "-m", "tests.support.pipeline_worker", str(root), str(base), str(pipe),
         str(steps)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["trained@2", "committed@2"])
def test_a_killed_pipeline_loses_no_group_and_repeats_no_step(tiny_models, tmp_path, point):
    root, pipe = tmp_path / "run", tmp_path / "pipe"
    killed = _run_worker(root, tiny_models["llama"], pipe, 3, point)
    assert killed.returncode == -9, killed.stderr[-2000:]
    asked = [e for e in PipelineStore(pipe).events() if e["event"] == "train"]
    assert len(asked) == 2  # step 2 was asked for when the kill came
    again = _run_worker(root, tiny_models["llama"], pipe, 2, None)
    assert again.returncode == 0, again.stderr[-2000:]
    trained = json.loads(again.stdout.strip().splitlines()[-1])["steps"]
    # killed before the commit: step 2 trains now, from the same groups; after: it is answered
    assert trained == ([2, 3] if point.startswith("trained") else [3, 4])

    from art_core.storage import ModelDir

    md = ModelDir(root, "demo", "agent")
    steps = md.steps()
    assert steps == list(range(steps[-1] + 1))
    assert [r["step"] for r in md.read_history()] == steps[1:]  # one row per step, none twice
    ids = {s: journaled_ids(md, s) for s in steps[1:]}
    flat = [i for v in ids.values() for i in v]
    assert len(flat) == len(set(flat))  # no group trained twice
    assert ids[2] == asked[1]["groups"]  # the step asked for before the kill: no group lost
    events = PipelineStore(pipe).events()
    assert sorted(e["step"] for e in events if e["event"] == "committed") == steps[1:]
    pool, pending = PipelineStore(pipe).recover()
    assert pending is None and not set(b.id for b in pool) & set(flat)


async def test_a_pipeline_cancelled_mid_step_and_run_again_trains_each_step_once(
        tiny_models, tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        rollout = made_up_rollout(model, tokenizer(backend, model))
        run = asyncio.ensure_future(pipeline(model, rollout, tmp_path / "pipe").run(3))
        store = PipelineStore(tmp_path / "pipe")
        while not [e for e in store.events() if e["event"] == "train"]:
            await asyncio.sleep(0.01)  # step 1 asked for: its train() call is in flight
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        result = await pipeline(model, rollout, tmp_path / "pipe").run(2)
        md = model_dir(backend, model)
        steps = md.steps()
        assert steps == list(range(steps[-1] + 1)) and steps[-1] >= 2
        assert [r["step"] for r in md.read_history()] == steps[1:]
        flat = [i for s in steps[1:] for i in journaled_ids(md, s)]
        assert len(flat) == len(set(flat))  # no group trained twice
        committed = [e["step"] for e in store.events() if e["event"] == "committed"]
        assert sorted(committed) == steps[1:] and len(result.steps) >= 1
    finally:
        await backend.close()


async def test_a_committed_request_id_is_answered_not_trained_again(tiny_models, tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        first = await backend.train(model, groups_for(backend, model), CONFIG, request_id="r1")
        again = await backend.train(model, groups_for(backend, model), CONFIG, request_id="r1")
        assert again.step == first.step == 1 and await model.get_step() == 1
        assert again.metrics["loss"] == first.metrics["loss"]
        assert model_dir(backend, model).steps() == [0, 1]
    finally:
        await backend.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"groups_per_step": 0}, "groups_per_step must be an integer >= 1"),
    ({"rollouts_per_group": 1}, "rollouts_per_group must be an integer >= 2"),
    ({"max_steps_off_policy": -1}, "max_steps_off_policy must be an integer >= 0"),
    ({"max_groups_in_flight": 0}, "max_groups_in_flight must be an integer >= 1"),
    ({"mode": "remote"}, "mode must be one of"),
    ({"oversample": 0.5}, "oversample must be None or a number >= 1"),
])
def test_bad_settings_are_refused_by_name(tmp_path, kwargs, message):
    from art_core import TrainableModel

    with pytest.raises(ValueError, match=message):
        PipelineTrainer(TrainableModel(name="m"), lambda s: None, ["a"], run_dir=tmp_path,
                        **kwargs)
    with pytest.raises(ValueError, match="scenarios is empty"):
        PipelineTrainer(TrainableModel(name="m"), lambda s: None, [], run_dir=tmp_path)
