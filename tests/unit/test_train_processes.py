"""`LocalBackend(train_processes=N)` and `art serve --train-processes N`: the backend's training
path (`Trainers.train_and_save`, which `train` calls once the groups are journaled and vLLM sleeps)
with N = 2 torchrun ranks on CPU (gloo), on a tiny model; no vLLM engine is started.

- 2 ranks commit the checkpoint 1 process commits, with the same metric keys, and the
  in-process trainer cached before is dropped: a later in-process step trains from the
  checkpoint the ranks wrote (a stale cache would train from step 0, far off TOL).
- ranks that fail (here: all of them, on a corrupt base model) raise, commit nothing and leave
  the journal as it was, so `replay_interrupted` can train it again. One rank killed while the
  other trains is tests/unit/test_distributed.py's test (same `run_distributed_step`).
- tests/engine/test_train_processes.py: the whole `train` with 2 ranks through vLLM.

Tolerance: TOL = 1e-5 absolute on adapter weights (fp32), as in tests/unit/test_distributed.py,
which says why (only the summation order of the gradients across ranks differs).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from art_core import LocalBackend, ModelConfig, TrainableModel
from art_core.cli import app
from art_core.storage import ModelDir
from art_core.train.trainer import Trainer
from tests.support.data import CONFIG, LORA, TOL, make_groups


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory) -> dict:
    """A step-0 adapter of the tiny model and the groups to train on."""
    base = tiny_models["llama"]
    root = tmp_path_factory.mktemp("train_processes")
    trainer = Trainer(str(base), LORA, device="cpu")
    trainer.save_adapter(root / "step0")
    return {"base": base, "root": root, "groups": make_groups(trainer.tokenizer)}


def new_backend(setup: dict, name: str, n: int, base: Path | None = None
                ) -> tuple[LocalBackend, TrainableModel, ModelDir]:
    """A backend with `train_processes=n` and a model whose checkpoint 0 is the shared one
    (what `register` writes, without starting vLLM)."""
    backend = LocalBackend(setup["root"] / name, train_processes=n)
    model = TrainableModel(name="m", project="p", base_model=str(base or setup["base"]),
                           config=ModelConfig(lora=LORA))
    md = backend._dir(model)
    md.checkpoints.mkdir(parents=True)
    shutil.copytree(setup["root"] / "step0", md.checkpoint(0))
    return backend, model, md


def train(backend: LocalBackend, model: TrainableModel, md: ModelDir, groups: list,
          step: int) -> dict[str, float]:
    """What `LocalBackend.train` does around the trainer: journal first, then train."""
    md.journal_groups(step, groups)
    return backend.trainers.train_and_save(model, groups, CONFIG, step)


def diff(a: ModelDir, b: ModelDir, step: int) -> float:
    left = load_file(str(a.checkpoint(step) / "adapter_model.safetensors"))
    right = load_file(str(b.checkpoint(step) / "adapter_model.safetensors"))
    assert left.keys() == right.keys() and left
    return max(float((left[k] - right[k]).abs().max()) for k in left)


@pytest.mark.slow  # starts processes: make test runs it, make unit does not
def test_two_processes_commit_the_single_process_checkpoint(setup):
    groups = setup["groups"]
    one, model, md_one = new_backend(setup, "one", 1)
    want = [train(one, model, md_one, groups, step) for step in (1, 2)]

    two, model, md_two = new_backend(setup, "two", 2)
    stale = two.trainers.get(model)  # an in-process trainer at step 0, as after register
    got = train(two, model, md_two, groups, 1)  # torchrun, 2 ranks
    assert md_two.steps() == [0, 1]
    assert got.keys() == want[0].keys()  # what train() and the history read
    for key in ("loss", "grad_norm", "trained_tokens"):
        assert got[key] == pytest.approx(want[0][key], rel=TOL, abs=TOL), key
    print(f"step 1, 2 ranks vs 1 process: max |adapter difference| = {diff(md_one, md_two, 1):.3g}")
    assert diff(md_one, md_two, 1) < TOL

    two.train_processes = 1  # the next step in this process: from checkpoint 1, not the cache
    train(two, model, md_two, groups, 2)
    assert two.trainers.get(model) is not stale
    print(f"step 2, in process after the ranks: max |difference| = {diff(md_one, md_two, 2):.3g}")
    assert diff(md_one, md_two, 2) < TOL
    # the stale step-0 trainer would have written checkpoint 1 again as "2": that is far off
    step1 = load_file(str(md_one.checkpoint(1) / "adapter_model.safetensors"))
    step2 = load_file(str(md_one.checkpoint(2) / "adapter_model.safetensors"))
    assert max(float((step2[k] - step1[k]).abs().max()) for k in step1) > 100 * TOL


@pytest.mark.slow  # starts processes: make test runs it, make unit does not
def test_failed_ranks_commit_nothing_and_keep_the_journal(setup, tmp_path):
    broken = tmp_path / "broken-base"
    shutil.copytree(setup["base"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # every rank fails to load the base
    backend, model, md = new_backend(setup, "failed", 2, base=broken)
    md.journal_groups(1, setup["groups"])
    journal = (md.journal / "0001.jsonl").read_bytes()
    with pytest.raises(RuntimeError, match="journal kept for replay"):
        backend.trainers.train_and_save(model, setup["groups"], CONFIG, 1)
    assert md.steps() == [0]
    assert md.interrupted_steps() == [1]
    assert (md.journal / "0001.jsonl").read_bytes() == journal
    assert not [p for p in md.checkpoints.iterdir() if p.name.startswith(".tmp")]
    assert not list(md.path.glob(".metrics-*"))


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_bad_train_processes_are_refused(tmp_path, n):
    with pytest.raises(ValueError, match="train_processes"):
        LocalBackend(tmp_path, train_processes=n)


def test_more_processes_than_gpus_are_refused_on_cuda(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("CPU host: any number of CPU ranks is allowed")
    with pytest.raises(ValueError, match="GPU"):
        LocalBackend(tmp_path, train_processes=torch.cuda.device_count() + 1)


def test_art_serve_passes_train_processes_on(tmp_path):
    from art_core.serve.app import build_server

    server = build_server(tmp_path, port=1, train_processes=2)
    assert server.art.backend.train_processes == 2
    assert build_server(tmp_path, port=1).art.backend.train_processes == 1
    result = CliRunner().invoke(app, ["serve", "--train-processes", "0", "--path", str(tmp_path)])
    assert result.exit_code == 2 and "train-processes" in result.output
