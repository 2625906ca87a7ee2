"""`LocalBackend(train_processes=2)`: the whole `train` with 2 torchrun ranks on the session's
vLLM backend (tests/unit/test_train_processes.py checks the training path without vLLM)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from art_core import TrainableModel, TrainConfig
from art_core.gather import gather_trajectory_groups
from tests.support.engine import rollout, tiny_config

pytestmark = pytest.mark.engine


async def test_train_on_two_processes_through_vllm(backend, tiny_models):
    """The whole `train` with 2 ranks on the session's backend: vLLM sleeps, the ranks train,
    the new adapter serves as name@1, the history has the usual metrics."""
    model = TrainableModel(name="tp2-llama", project="tp", base_model=str(tiny_models["llama"]),
                           config=tiny_config())
    backend.train_processes = 2
    try:
        await model.register(backend)
        assert ("tp", "tp2-llama") not in backend.trainers.cached  # step 0 written, trainer freed
        groups = await gather_trajectory_groups(
            ([rollout(model, i) for i in range(4)] for _ in range(2)), show_progress=False)
        result = await model.train(groups, TrainConfig(learning_rate=1e-2))
    finally:
        backend.train_processes = 1
    assert result.step == 1 and result.metrics["trained_tokens"] > 0
    for key in ("save_seconds", "publish_seconds", "swap_seconds", "loss", "grad_norm"):
        assert key in result.metrics, key
    before = load_file(str(backend.checkpoint_dir(model, 0) / "adapter_model.safetensors"))
    after = load_file(str(backend.checkpoint_dir(model, 1) / "adapter_model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.model == "tp2-llama@1"
