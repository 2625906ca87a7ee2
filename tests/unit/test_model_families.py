"""Tiny random models of the families users train (Llama, Qwen 2.5, Qwen 3, Gemma 3) take one
LoRA step with the default target modules and save a peft adapter: transformers + peft only,
no vLLM (the engine tests of these families are separate)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from art_core import LoraConfig, TrainConfig
from art_core.testing.tiny import ARCHS, build_tiny_model
from art_core.train.trainer import Trainer
from tests.support.data import make_group


@pytest.mark.parametrize("arch", ARCHS)
def test_one_lora_step_per_family(arch, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch)
    trainer = Trainer(str(path), LoraConfig(rank=4), device="cpu")
    wrapped = {m.split(".")[-1] for n, _ in trainer.model.named_modules() if "lora_A" in n
               for m in [n.rsplit(".lora_A", 1)[0]]}
    assert wrapped == set(LoraConfig().target_modules), f"{arch}: LoRA on {sorted(wrapped)}"
    b_before = {n: p.detach().clone() for n, p in trainer.lora_params.items() if "lora_B" in n}
    metrics = trainer.step([make_group(trainer.tokenizer)],
                           TrainConfig(learning_rate=1e-2, bf16=False))
    assert metrics["trained_tokens"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert metrics["grad_norm"] > 0
    unchanged = [n for n, v in b_before.items() if torch.equal(v, trainer.lora_params[n])]
    assert not unchanged, f"{arch}: lora_B parameters that did not move: {unchanged[:3]}"
    out = tmp_path_factory.mktemp(f"{arch}-adapter")
    trainer.save_adapter(out)
    saved = load_file(str(out / "adapter_model.safetensors"))
    assert len(saved) == len(trainer.lora_params)
