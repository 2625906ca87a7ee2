"""The trainer on a tiny random model, no engine: parameters move, optimizer state resumes."""

from __future__ import annotations

import pytest
import torch

from art_core import LoraConfig, TrainConfig
from art_core.train.trainer import Trainer, activation_bytes, use_checkpointing
from tests.support.data import lora_state, make_group


@pytest.fixture
def trainer(tiny_models) -> Trainer:
    return Trainer(str(tiny_models["llama"]), LoraConfig(rank=4), device="cpu")


@pytest.mark.parametrize("loss", [{}, {"loss": "dppo"}, {"loss": "ppo", "tis_cap": 2.0}],
                         ids=["cispo", "dppo", "ppo-tis"])
def test_two_steps_change_every_lora_parameter(trainer, loss):
    before = lora_state(trainer)
    group = make_group(trainer.tokenizer)
    config = TrainConfig(learning_rate=1e-2, bf16=False, **loss)
    for _ in range(2):  # lora_B starts at zero, so lora_A gets no gradient on the first step
        metrics = trainer.step([group], config)
        assert metrics["trained_tokens"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    after = lora_state(trainer)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"LoRA parameters that did not change: {unchanged}"


def test_optimizer_state_resumes_only_for_its_own_checkpoint(trainer, tiny_models, tmp_path):
    config = TrainConfig(learning_rate=1e-2, bf16=False)
    trainer.step([make_group(trainer.tokenizer)], config)
    path = tmp_path / "optimizer.safetensors"
    trainer.save_optimizer(path, checkpoint=1)
    assert not path.with_name(path.name + ".tmp").exists()

    fresh = Trainer(str(tiny_models["llama"]), LoraConfig(rank=4), device="cpu")
    assert fresh.load_optimizer(path, config, checkpoint=2) is False  # another checkpoint's
    assert fresh.optimizer is None
    assert fresh.load_optimizer(tmp_path / "missing.safetensors", config, checkpoint=1) is False
    assert fresh.load_optimizer(path, config, checkpoint=1) is True
    for name, p in trainer.lora_params.items():
        saved, loaded = trainer.optimizer.state[p], fresh.optimizer.state[fresh.lora_params[name]]
        assert torch.equal(saved["exp_avg"], loaded["exp_avg"])
        assert torch.equal(saved["exp_avg_sq"], loaded["exp_avg_sq"])
        assert int(loaded["step"]) == int(saved["step"]) == 1


@pytest.mark.parametrize("settings", [
    (True, True, True),  # steps with checkpointing: one embedding hook, not one per step
    (True, False, True),  # off in between: its hook removed, then one again
    (False, False),  # never on: none
    (True, "auto", "auto"),  # 'auto' on a tiny model's few tokens: off, its hook removed
])
def test_checkpointing_keeps_one_embedding_hook_across_steps(trainer, settings):
    group = make_group(trainer.tokenizer)
    embeddings = trainer.model.get_input_embeddings()
    for setting in settings:
        metrics = trainer.step([group], TrainConfig(learning_rate=1e-2, bf16=False,
                                                    gradient_checkpointing=setting))
        on = setting is True
        assert metrics["checkpointing"] == float(on)
        assert len(embeddings._forward_hooks) == int(on), (settings, setting)


class Shape:
    """The sizes of SmolLM2-135M's config that the activation estimate reads."""

    num_hidden_layers, hidden_size, intermediate_size = 30, 576, 1536


CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("setting", "config", "tokens", "bf16", "device", "expected"), [
    ("auto", Shape(), 1_427, True, CPU, False),  # the race's step: 1.28 GB estimated
    ("auto", Shape(), 2_000, True, CPU, False),  # 1.80 GB
    ("auto", Shape(), 2_400, True, CPU, True),  # 2.16 GB: over the 2 GB line
    ("auto", Shape(), 1_427, False, CPU, True),  # float32 holds twice as much: 2.56 GB
    ("auto", Shape(), 100, True, GPU, True),  # a GPU always recomputes under 'auto'
    ("auto", object(), 100, True, CPU, True),  # sizes unknown: recompute, the safe side
    (True, Shape(), 100, True, CPU, True),  # an explicit setting is taken as it is
    (False, Shape(), 100_000, True, CPU, False),
])
def test_auto_checkpointing_recomputes_only_what_would_not_fit(setting, config, tokens, bf16,
                                                               device, expected):
    assert use_checkpointing(setting, config, tokens, bf16, device) is expected


def test_the_activation_estimate_is_calibrated_on_smollm2():
    # measured on SmolLM2-135M in bf16 (a 2-core CPU): 1.31 GB more peak RSS without
    # checkpointing for a packed row of 1,427 tokens
    assert activation_bytes(Shape(), 1_427, bf16=True) == pytest.approx(1.31e9, rel=0.05)


def test_grammar_chosen_tokens_train_at_ratio_one_on_the_trainers_own_logprobs(trainer):
    """A tool-call grammar's tokens carry the masked distribution's logprob (here a made-up
    -2.0, far from the model's): the trainer uses its own there, so the ratio is 1 exactly,
    the step is finite and the adapter still moves."""
    config = TrainConfig(learning_rate=1e-2, bf16=False)
    free = trainer.step([make_group(trainer.tokenizer)], config)
    assert abs(free["ratio_mean"] - 1) > 0.05  # -2.0 is not the model's logprob

    group = make_group(trainer.tokenizer)
    for t in group.trajectories:
        t.turns = [t.turns[0].model_copy(update={"constrained_from": 0})]
    before = lora_state(trainer)
    metrics = trainer.step([group], config)
    assert metrics["constrained_tokens"] == metrics["trained_tokens"] > 0
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["sampler_trainer_prob_diff"] == pytest.approx(0.0, abs=1e-6)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    after = lora_state(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)
