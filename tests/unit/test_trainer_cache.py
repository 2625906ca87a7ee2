"""LocalBackend keeps at most `trainers_in_memory` trainers loaded; one dropped for memory comes
back from its checkpoint and optimizer file, as it was. No engine: the trainer half only."""

from __future__ import annotations

import pytest
import torch

from art_core import LocalBackend, LoraConfig, ModelConfig, TrainableModel, TrainConfig
from tests.support.data import lora_state, make_group


def moments(trainer) -> dict[str, torch.Tensor]:
    return {n: trainer.optimizer.state[p]["exp_avg"].clone()
            for n, p in trainer.lora_params.items()}


def test_least_recently_used_trainer_is_dropped_then_reloaded_as_it_was(tiny_models, tmp_path):
    backend = LocalBackend(tmp_path, trainers_in_memory=2)
    a, b, c = (TrainableModel(name=n, project="cache", base_model=str(tiny_models["llama"]),
                              config=ModelConfig(lora=LoraConfig(rank=4))) for n in "abc")
    config = TrainConfig(learning_rate=1e-2, bf16=False)
    first = backend.trainers.get(a)
    group = make_group(first.tokenizer)
    for step in (1, 2):  # two steps, so that every LoRA parameter and moment is non-zero
        backend.trainers.train_and_save(a, [group], config, step)
    trained, trained_moments = lora_state(first), moments(first)

    backend.trainers.get(b)
    assert backend.trainers.get(a) is first  # used again: b is now the least recently used
    backend.trainers.get(c)
    assert list(backend.trainers.cached) == [("cache", "a"), ("cache", "c")]
    backend.trainers.get(b)  # drops a
    assert ("cache", "a") not in backend.trainers.cached and len(backend.trainers.cached) == 2

    again = backend.trainers.get(a)
    assert again is not first
    for name, value in trained.items():
        torch.testing.assert_close(lora_state(again)[name], value, msg=name)
    for name, value in trained_moments.items():
        torch.testing.assert_close(moments(again)[name], value, msg=name)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_trainers_in_memory_must_be_a_positive_integer(tmp_path, bad):
    with pytest.raises(ValueError, match="trainers_in_memory must be an integer >= 1"):
        LocalBackend(tmp_path, trainers_in_memory=bad)
