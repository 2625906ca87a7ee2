"""SFT on the same LoRA as RL (the real trainer on the tiny random llama; the engine is
tests/support/runs.py's StubEngine):
- an SFT step lowers the loss on its data and changes every LoRA parameter;
- SFT then RL is one checkpoint chain (kinds "sft", "rl"), each step training from the last;
- a killed SFT step is journaled as SFT and replays as SFT; a request id is never trained twice;
- a JSONL file trains like trajectories; over-long examples are counted or refused;
- distillation from a teacher's rollouts keeps each group's best and fine-tunes on them.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from art_core import SFTConfig, Trajectory, TrajectoryGroup
from art_core.config import LoraConfig
from art_core.distill import best_of_groups, distill
from art_core.model import Model
from art_core.sft.data import SFTDataError
from art_core.train.sft import learning_rate, sft_step
from art_core.train.trainer import Trainer
from tests.support.runs import CONFIG, adapter_tensors, groups_for, make_backend, model_dir

SFT = SFTConfig(epochs=4, batch_size=2, learning_rate=1e-2, bf16=False)

TOOLS = [{"type": "function", "function": {
    "name": "lookup_country", "description": "Facts about a country.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"]}}}]


def example(country: str, capital: str) -> dict[str, Any]:
    """A tool-using conversation in the OpenAI fine-tuning chat format."""
    call = {"id": f"call_{country}", "type": "function",
            "function": {"name": "lookup_country", "arguments": json.dumps({"name": country})}}
    return {"messages": [
        {"role": "system", "content": "Answer with the capital. Use the tool."},
        {"role": "user", "content": f"What is the capital of {country}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{country}", "content": f"capital: {capital}"},
        {"role": "assistant", "content": f"The capital is {capital}."},
    ], "tools": TOOLS}


DATA = [example(c, k) for c, k in [("France", "Paris"), ("Peru", "Lima"), ("Chad", "N'Djamena"),
                                   ("Fiji", "Suva"), ("Mali", "Bamako")]]


def trajectories() -> list[Trajectory]:
    return [Trajectory(messages=d["messages"], tools=d["tools"]) for d in DATA]


def test_sft_lowers_the_loss_on_its_data_and_changes_every_lora_parameter(tiny_models):
    trainer = Trainer(str(tiny_models["llama"]), LoraConfig())
    before = {n: p.detach().clone() for n, p in trainer.lora_params.items()}
    m = sft_step(trainer, trajectories(), SFT, limit=None)
    assert m["loss"] < 0.8 * m["loss_first_epoch"], m
    assert m["examples"] == 5 and m["updates"] == 4 * 3 and m["skipped_over_long"] == 0
    assert m["trained_tokens"] > 0 and m["forwarded_tokens"] > 0
    unchanged = [n for n, p in trainer.lora_params.items() if torch.equal(p, before[n])]
    assert unchanged == []
    for g in trainer.optimizer.param_groups:  # the schedule leaves the base rate behind
        assert g["lr"] == SFT.learning_rate


@pytest.mark.parametrize(("schedule", "update", "total", "expected"), [
    ("constant", 5, 10, 1.0),
    ("linear", 0, 10, 1.0),
    ("linear", 5, 10, 0.5),
    ("cosine", 0, 10, 1.0),
    ("cosine", 5, 10, 0.5),
    ("cosine", 10, 10, 0.0),
])
def test_learning_rate_schedules(schedule, update, total, expected):
    config = SFTConfig(learning_rate=1.0, schedule=schedule, warmup_ratio=0.0)
    assert learning_rate(config, update, total) == pytest.approx(expected)


def test_warm_up_ramps_to_the_peak():
    config = SFTConfig(learning_rate=1.0, warmup_ratio=0.2, schedule="constant")
    assert [learning_rate(config, u, 10) for u in range(3)] == [0.5, 1.0, 1.0]


async def test_sft_then_rl_continue_one_checkpoint_chain(tiny_models, tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        md = model_dir(backend, model)
        r1 = await backend.train_sft(model, trajectories(), SFT, request_id="sft-1")
        assert r1.step == 1 and md.step_record(1)["kind"] == "sft"
        sft_adapter = adapter_tensors(md.checkpoint(1))
        zero = adapter_tensors(md.checkpoint(0))
        assert any(not torch.equal(sft_adapter[k], zero[k]) for k in zero)
        assert backend.gateway.models[model.name].latest == 1  # served, like an RL step

        backend.trainers.drop(model)  # the RL step must reload step 1 from disk
        r2 = await backend.train(model, groups_for(backend, model, 1), CONFIG)
        assert r2.step == 2 and md.step_record(2)["kind"] == "rl"
        rows = md.read_history()
        assert [(r["step"], r["kind"]) for r in rows] == [(1, "sft"), (2, "rl")]
        # the RL row names its credit (`art view` marks trained groups by its rule)
        assert [r.get("advantage") for r in rows] == [None, CONFIG.advantage]
        # the same id again: answered from the committed step, not trained a second time
        again = await backend.train_sft(model, trajectories(), SFT, request_id="sft-1")
        assert again.step == 1 and md.steps() == [0, 1, 2]
    finally:
        await backend.close()


async def test_a_killed_sft_step_replays_as_sft(tiny_models, tmp_path, monkeypatch):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        md = model_dir(backend, model)

        def killed(*args: Any, **kwargs: Any) -> None:
            raise OSError("killed mid-step")  # what a replay can get past, as a kill is

        monkeypatch.setattr("art_core.train.sft.sft_step", killed)
        with pytest.raises(OSError):
            await backend.train_sft(model, trajectories(), SFT)
        assert md.interrupted_steps() == [1] and md.steps() == [0]
        assert md.journaled_sft_config(1) == SFT
        monkeypatch.undo()
        [result] = await backend.replay_interrupted(model, CONFIG)
        assert result.step == 1 and md.step_record(1)["kind"] == "sft"
        assert result.metrics["examples"] == 5
        assert md.interrupted_steps() == []
    finally:
        await backend.close()


async def test_a_jsonl_file_trains_and_over_long_examples_are_counted(tiny_models, tmp_path):
    path = tmp_path / "data.jsonl"
    long = example("Chad", "N'Djamena " * 300)
    path.write_text("".join(json.dumps(d) + "\n" for d in [*DATA[:3], long]))
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    try:
        config = SFTConfig(epochs=1, max_length=2000, bf16=False)  # the long one: ~5k tokens
        r = await backend.train_sft(model, str(path), config)
        assert r.metrics["examples"] == 3 and r.metrics["skipped_over_long"] == 1
        with pytest.raises(SFTDataError, match=r"data.jsonl:4: \d+ tokens, longer than"):
            await backend.train_sft(model, path, config.model_copy(update={"over_long": "error"}))
        assert model_dir(backend, model).steps() == [0, 1]
    finally:
        await backend.close()


def _traj(reward: float, answer: str) -> Trajectory:
    return Trajectory(messages=[{"role": "user", "content": "capital of Peru?"},
                                {"role": "assistant", "content": answer}], reward=reward)


def test_art_distill_is_the_function_even_after_its_package_is_imported():
    import art_core
    import art_core.distill.on_policy  # noqa: F401 - importing a submodule must not shadow it

    assert art_core.distill is distill and callable(art_core.distill)


def test_best_of_groups_keeps_each_groups_best_above_the_floor():
    groups = [TrajectoryGroup(trajectories=[_traj(0.2, "a"), _traj(0.9, "b"), _traj(0.5, "c")]),
              TrajectoryGroup(trajectories=[_traj(0.1, "d"), _traj(0.0, "e")])]
    assert [t.messages[1]["content"] for t in best_of_groups(groups)] == ["b", "d"]
    assert [t.messages[1]["content"] for t in best_of_groups(groups, 2)] == ["b", "c", "d", "e"]
    assert [t.messages[1]["content"] for t in best_of_groups(groups, 1, 0.5)] == ["b"]


async def test_distill_fine_tunes_the_student_on_the_teachers_best(tiny_models, tmp_path):
    backend, model = await make_backend(tmp_path / "run", tiny_models["llama"])
    seen: list[str] = []

    async def rollout(teacher: Model, scenario: str) -> Trajectory:
        seen.append(teacher.name)
        good = len(seen) % 2 == 0
        return _traj(1.0 if good else 0.0, f"Lima, {scenario}" if good else "no idea")

    try:
        r = await distill(model, f"{model.name}@0", rollout, ["a", "b", "c"],
                          rollouts_per_group=2, config=SFTConfig(epochs=1, bf16=False))
        assert set(seen) == {f"{model.name}@0"} and len(seen) == 6
        assert r.metrics["distilled_trajectories"] == 3
        assert r.metrics["teacher_reward_mean"] == pytest.approx(0.5)
        journaled = model_dir(backend, model).journaled(r.step)
        assert all(t.reward == 1.0 for g in journaled for t in g.trajectories)
        with pytest.raises(ValueError, match="min_reward"):
            await distill(model, f"{model.name}@0", rollout, ["a"], rollouts_per_group=1,
                          min_reward=2.0)
    finally:
        await backend.close()


def test_art_sft_refuses_a_bad_file_with_its_line_before_an_engine_starts(tmp_path):
    from typer.testing import CliRunner

    from art_core.cli import app

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(DATA[0]) + "\n" + json.dumps(
        {"messages": [{"role": "wizard", "content": "hi"}]}) + "\n")
    result = CliRunner().invoke(app, ["sft", str(path), "--model", "m", "--path",
                                      str(tmp_path / "run")])
    assert result.exit_code == 1
    assert f"{path}:2" in result.output and "wizard" in result.output
    assert not (tmp_path / "run").exists()
