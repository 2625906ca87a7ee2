"""The trainer on a tiny random model, no engine: parameters move, optimizer state resumes."""

from __future__ import annotations

import pytest
import torch

from art_core import LoraConfig, TrainConfig
from art_core.train.trainer import Trainer
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
])
def test_checkpointing_keeps_one_embedding_hook_across_steps(trainer, settings):
    group = make_group(trainer.tokenizer)
    embeddings = trainer.model.get_input_embeddings()
    for on in settings:
        trainer.step([group], TrainConfig(learning_rate=1e-2, bf16=False,
                                          gradient_checkpointing=on))
        assert len(embeddings._forward_hooks) == int(on), (settings, on)


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
