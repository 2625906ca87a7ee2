"""Data and loaders shared by tests: hand-made trajectory groups for trainer steps (token ids
from a real tokenizer, engine-free), training settings compared across processes, and the
examples/ and benchmarks/ scripts loaded as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

from art_core import LoraConfig, TrainConfig, Trajectory, TrajectoryGroup

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BENCHMARKS = EXAMPLES.parent / "benchmarks"

LORA = LoraConfig(rank=4)
# One sequence per micro-batch, so both sides run forward passes of the same shapes: the base
# weights are bf16 where the CPU supports it, and regrouping sequences into micro-batches alone
# (different padding) moves the loss by ~3e-4 relative in one process (measured: micro-batch 1
# vs 8), which Adam's first step (~lr x sign(grad)) turns into 2 x lr jumps of near-zero
# gradients. What remains is the summation order of fp32 gradients across ranks.
CONFIG = TrainConfig(learning_rate=1e-2, bf16=False, micro_batch_size=1)
TOL = 1e-5


def make_groups(tokenizer) -> list[TrajectoryGroup]:
    """Two groups of four, completions of different lengths (uneven shares per rank)."""
    groups = []
    for question, replies in [
        ("What do you say?", [("yes", 0.0), ("no thanks", 1.0), ("maybe so, I think", 0.5),
                              ("ok then", 1.0)]),
        ("Where is Paris?", [("France", 1.0), ("the capital of Italy is Rome", 0.0),
                             ("Paris is in France", 1.0), ("no", 0.0)]),
    ]:
        prompt = tokenizer.encode(question)
        trajectories = []
        for text, reward in replies:
            ids = tokenizer.encode(text)
            trajectories.append(Trajectory(
                messages=[{"role": "user", "content": question},
                          {"role": "assistant", "content": text}],
                turns=[{"message_index": 1, "prompt_token_ids": prompt,
                        "completion_token_ids": ids, "logprobs": [-2.0] * len(ids),
                        "step": 0}],
                reward=reward))
        groups.append(TrajectoryGroup(trajectories=trajectories))
    return groups


def make_group(tokenizer) -> TrajectoryGroup:
    """One group of four replies to one question, with different rewards."""
    return make_groups(tokenizer)[0]


def lora_state(trainer) -> dict[str, torch.Tensor]:
    """A copy of a `Trainer`'s LoRA parameters, to compare before and after a step."""
    return {n: p.detach().clone() for n, p in trainer.lora_params.items()}


def load_example(name: str) -> ModuleType:
    """examples/<name>.py as a module."""
    return _load(EXAMPLES / f"{name}.py", f"examples_{name}")


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module, under its own name (as the scripts import each other)."""
    return _load(BENCHMARKS / f"{name}.py", name)


def _load(path: Path, module_name: str) -> ModuleType:
    """A script as a module, registered in sys.modules (where dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
