"""Data-parallel training on CPU ranks (gloo), launched by torchrun: 2 ranks give the adapter
1 rank and the single-process Trainer give; only rank 0 writes; a killed rank fails the step
with no checkpoint committed and the journal intact, and the step replays afterwards.

Tolerance: adapters and metrics agree to 1e-5 (absolute, fp32). Measured on a 2-core CPU:
max |difference| of the adapter weights after 2 steps 7.5e-8 (only the summation order of the
micro-batches differs); the gradient norm, which would be off 2x if ranks averaged instead of
summed, agrees to ~1e-7 relative.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from art_core.storage import ModelDir
from art_core.train.distributed import run_distributed_step
from art_core.train.trainer import Trainer
from tests.support.data import CONFIG, LORA, TOL, make_groups

WORKER = Path(__file__).parents[1] / "support" / "dist_worker.py"


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory) -> dict:
    """A step-0 adapter, the groups, and the single-process reference after 2 steps."""
    base = str(tiny_models["llama"])
    root = tmp_path_factory.mktemp("dist")
    trainer = Trainer(base, LORA, device="cpu")
    step0 = root / "step0"
    trainer.save_adapter(step0)
    groups = make_groups(trainer.tokenizer)
    metrics = [trainer.step(groups, CONFIG) for _ in range(2)]
    reference = {n: p.detach().clone() for n, p in trainer.model.state_dict().items()
                 if "lora_" in n}
    return {"base": base, "root": root, "step0": step0, "groups": groups,
            "metrics": metrics, "reference": reference}


def new_run(setup: dict, name: str, steps: int) -> ModelDir:
    """A run directory holding checkpoint 0 and the journal of steps 1..steps."""
    md = ModelDir(setup["root"] / name, "p", "m")
    md.checkpoints.mkdir(parents=True)
    shutil.copytree(setup["step0"], md.checkpoint(0))
    for step in range(1, steps + 1):
        md.journal_groups(step, setup["groups"])
    return md


def adapter(md: ModelDir, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(md.checkpoint(step) / "adapter_model.safetensors"))


def max_diff(saved: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference, matching peft's saved names to the model's."""
    diffs = []
    for name, tensor in saved.items():
        stem = name.removesuffix(".weight")
        match = [v for k, v in reference.items() if k.startswith(stem) and k.endswith("weight")]
        assert len(match) == 1, f"{name}: {len(match)} matches"
        diffs.append(float((tensor - match[0]).abs().max()))
    assert diffs
    return max(diffs)


@pytest.mark.slow  # starts processes: make test runs it, make unit does not
# one rank through torchrun is the path two ranks take, less the all-reduce: nightly
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.nightly), 2])
def test_ranks_train_the_single_process_adapter(setup, nproc):
    md = new_run(setup, f"n{nproc}", steps=2)
    metrics = [run_distributed_step(md, step, setup["base"], LORA, CONFIG, nproc)
               for step in (1, 2)]
    assert md.steps() == [0, 1, 2]
    diff = max_diff(adapter(md, 2), setup["reference"])
    print(f"nproc={nproc}: max |adapter - single process| = {diff:.3g}")
    assert diff < TOL
    for got, want in zip(metrics, setup["metrics"], strict=True):
        for key in ("loss", "grad_norm", "trained_tokens"):
            assert got[key] == pytest.approx(want[key], rel=TOL, abs=TOL), key
    # the update is real, so agreeing within TOL means something
    moved = max_diff(load_file(str(setup["step0"] / "adapter_model.safetensors")),
                     setup["reference"])
    assert moved > 100 * TOL


def torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(WORKER), *args], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow  # starts processes: make test runs it, make unit does not
def test_only_rank_zero_writes_the_adapter(setup, tmp_path):
    proc = torchrun("save", str(tmp_path), setup["base"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "rank0" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "rank1").exists()


@pytest.mark.slow  # starts processes: make test runs it, make unit does not
def test_a_killed_rank_fails_the_step_and_keeps_the_journal(setup):
    md = new_run(setup, "killed", steps=1)
    journal = (md.journal / "0001.jsonl").read_bytes()
    proc = torchrun("kill", str(md.root), setup["base"])
    assert proc.returncode != 0
    assert md.steps() == [0]  # nothing committed
    assert md.interrupted_steps() == [1]
    assert (md.journal / "0001.jsonl").read_bytes() == journal
    # the journaled step replays on 2 healthy ranks
    run_distributed_step(md, 1, setup["base"], LORA, CONFIG, nproc=2)
    assert md.steps() == [0, 1]
    assert not [d for d in md.checkpoints.iterdir() if d.name.startswith(".tmp")]
