"""A pinned 3-step curve (torchtune's loss-regression style): the tiny llama, two fixed groups,
three GRPO steps in float32; loss and gradient norm of each step must stay what they were.
A change anywhere in the training math (advantages, sequences, token weights, the loss, the
logprobs, the optimizer) moves these numbers; an intended change re-pins them, and says why in
its commit.

Float32 on purpose: the base loads in bf16 only on CPUs with native bf16, and this curve must
be the same on every machine. Measured on this project's 2-core CPU with 1 and 2 threads: the
numbers agree to ~2e-7 relative; the tolerance leaves room for other CPUs' kernels.
"""

from __future__ import annotations

import pytest
import torch

import art_core.train.trainer as trainer_module
from art_core import LoraConfig, TrainConfig
from tests.support.data import make_groups

# (loss, grad_norm) of steps 1-3, measured when pinned (commit "Tests: a pinned 3-step curve")
PINNED = [(-0.009266746579669416, 0.0605316124856472),
          (0.05394468642771244, 0.08223383128643036),
          (0.14047712460160255, 0.5513119697570801)]


def test_three_steps_follow_the_pinned_curve(tiny_models, monkeypatch):
    monkeypatch.setattr(trainer_module, "cpu_supports_bf16", lambda: False)  # float32 base
    torch.manual_seed(0)  # the LoRA A matrices are drawn at construction
    trainer = trainer_module.Trainer(str(tiny_models["llama"]), LoraConfig(rank=4), device="cpu")
    groups = make_groups(trainer.tokenizer)
    config = TrainConfig(learning_rate=1e-2, bf16=False)
    curve = []
    for _ in PINNED:
        m = trainer.step(groups, config)
        assert m["trained_tokens"] == 37
        curve.append((m["loss"], m["grad_norm"]))
    flat = [x for step in curve for x in step]
    assert flat == pytest.approx([x for step in PINNED for x in step], rel=1e-3, abs=1e-6), curve
