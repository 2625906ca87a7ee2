"""Data-parallel GRPO steps under torch.distributed (several GPUs, or several CPU processes).

The single-process `Trainer` stays the default; this module is used when a step runs on N ranks
(launched by torchrun, or by `run_distributed_step`, which starts torchrun itself):

1. every rank loads the same base model and the latest checkpoint's adapter; rank 0's LoRA
   weights are broadcast so all ranks start identical (peft's random init differs per process).
2. every rank computes the same advantages and sequence weights over *all* groups (cheap, and
   the weights must sum to 1 over the whole step), then trains its own share of the sequences.
3. gradients are summed across ranks by the library (`torch.distributed.all_reduce`, one flat
   bucket, like DDP's reducer); because each rank's loss is its part of one step-wide sum, the
   sum of gradients is exactly the single-process gradient. Metric sums are combined the same way.
4. every rank clips and steps its optimizer on identical gradients, so weights stay identical;
   only rank 0 writes the adapter (temp dir, then rename) and the optimizer state.

No lost work (invariant 3): the groups are journaled by the backend before the ranks start and
are read from the journal here. If a rank dies, the collectives of the others raise, no
checkpoint is committed, and the journaled step is left for `replay_interrupted`.

    torchrun --nproc-per-node 2 -m art_core.train.distributed --root .art --project p \\
        --name agent --base-model /path/to/base --step 3
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from art_core.config import LoraConfig, TrainConfig
from art_core.storage import ModelDir
from art_core.train import batch as B
from art_core.train.errors import RetryableStepError
from art_core.train.trainer import Trainer

log = logging.getLogger(__name__)


def init_process_group(timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group torchrun describes in the environment (gloo on CPU, nccl on
    CUDA); returns (rank, world size). A no-op when already initialized."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


class DistributedTrainer(Trainer):
    """A `Trainer` that is one rank of a data-parallel group (process group already joined)."""

    def __init__(self, base_model: str, lora: LoraConfig, device: str | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("DistributedTrainer needs torch.distributed initialized "
                               "(init_process_group(), or run under torchrun)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if device is None and torch.cuda.is_available():
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        super().__init__(base_model, lora, device=device)
        self.sync_weights()

    def sync_weights(self) -> None:
        """Give every rank rank 0's LoRA weights (after init or loading an adapter)."""
        with torch.no_grad():
            for p in self.lora_params.values():
                dist.broadcast(p.data, src=0)

    def load_adapter(self, adapter_dir: Path) -> None:
        super().load_adapter(adapter_dir)
        self.sync_weights()

    # ---- the data-parallel hooks of Trainer.step --------------------------------------------

    def _local_share(self, sequences: list[B.Sequence]) -> list[B.Sequence]:
        """Longest first, dealt round-robin: shares of similar token counts, identical on
        every rank because every rank sees the same sequences in the same order."""
        order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i))
        return [sequences[i] for i in order[self.rank::self.world_size]]

    def _reduce_across_ranks(self, sums: dict[str, float],
                             trained: int) -> tuple[dict[str, float], int]:
        params = list(self.lora_params.values())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # one bucket: one collective call
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n
        # Metric sums: a rank without sequences has no keys, so gather dicts, then add.
        gathered: list[tuple[dict[str, float], int] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, (sums, trained))
        total: dict[str, float] = {}
        tokens = 0
        for item in gathered:
            assert item is not None
            for k, v in item[0].items():
                total[k] = total.get(k, 0.0) + v
            tokens += item[1]
        return total, tokens

    # ---- files: rank 0 writes, the others wait ----------------------------------------------

    def save_adapter(self, out_dir: Path) -> None:
        if self.rank == 0:
            super().save_adapter(out_dir)
        dist.barrier()

    def save_optimizer(self, path: Path, checkpoint: int) -> None:
        if self.rank == 0:
            super().save_optimizer(path, checkpoint)
        dist.barrier()


def train_journaled_step(md: ModelDir, step: int, base_model: str, lora: LoraConfig,
                         config: TrainConfig, request_id: str | None = None,
                         kind: str = "rl") -> dict[str, float]:
    """One rank's part of training the journaled groups of `step` from the latest checkpoint.

    Rank 0 commits checkpoint `step` only after every rank finished its share (the gradient
    all-reduce needs them all); returns the step's metrics (the same on every rank but
    save_seconds), with the keys `LocalBackend`'s in-process step returns."""
    groups = md.journaled(step)
    if not groups:
        raise RuntimeError(f"no journaled groups for step {step} in {md.journal}")
    latest = md.latest_step()
    if latest is None or latest >= step:
        raise RuntimeError(f"step {step} cannot train on top of checkpoint {latest}")
    trainer = DistributedTrainer(base_model, lora)
    trainer.load_adapter(md.checkpoint(latest))
    trainer.load_optimizer(md.optimizer(latest), config, checkpoint=latest)
    metrics = {k: float(v) for k, v in trainer.step(groups, config).items()}
    t0 = time.perf_counter()
    tmp = md.temp_checkpoint(step) if trainer.rank == 0 else None
    trainer.save_adapter(tmp or Path())
    trainer.save_optimizer((tmp or Path()) / "optimizer.safetensors", checkpoint=step)
    metrics["save_seconds"] = time.perf_counter() - t0
    if tmp is not None:  # one unit: adapter, optimizer, the request and its metrics
        md.commit_checkpoint(tmp, step, {"kind": kind, "request_id": request_id,
                                         "metrics": metrics})
    return metrics


def run_distributed_step(md: ModelDir, step: int, base_model: str, lora: LoraConfig,
                         config: TrainConfig, nproc: int, *, timeout_s: float = 3600.0,
                         request_id: str | None = None, kind: str = "rl") -> dict[str, float]:
    """Train the journaled `step` on `nproc` ranks with torchrun; returns rank 0's metrics.

    Raises `RuntimeError` (with the end of the ranks' output) if any rank fails or the ranks
    run past `timeout_s` (then all of them are killed): no checkpoint is committed, and the
    journal stays for a replay."""
    out = md.path / f".metrics-{step:04d}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "art_core.train.distributed",
           "--root", str(md.root), "--project", md.path.parent.parent.name,
           "--name", md.path.name, "--base-model", base_model, "--step", str(step),
           "--lora", lora.model_dump_json(), "--config", config.model_dump_json(),
           "--metrics-out", str(out), "--kind", kind]
    if request_id is not None:
        cmd += ["--request-id", request_id]
    env = dict(os.environ)
    if not torch.cuda.is_available():  # CPU ranks share the cores; do not oversubscribe
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except BaseException as e:
        # SIGTERM, not SIGKILL: torchrun stops its ranks on SIGTERM; killed, it would orphan them
        proc.terminate()
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        output += f"\n(stopped after {timeout_s:g} s)"
    if proc.returncode != 0 or not out.exists():
        md.remove_partial_checkpoints()
        tail = "\n".join(output.splitlines()[-30:])
        raise RetryableStepError(f"distributed step {step} failed on {nproc} ranks (exit "
                                 f"{proc.returncode}); journal kept for replay.\n{tail}")
    metrics = json.loads(out.read_text())
    out.unlink()
    return metrics


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank (run by torchrun)."""
    p = argparse.ArgumentParser(prog="python -m art_core.train.distributed")
    p.add_argument("--root", required=True)
    p.add_argument("--project", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--base-model", required=True)
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--lora", default="{}", help="LoraConfig as JSON")
    p.add_argument("--config", default="{}", help="TrainConfig as JSON")
    p.add_argument("--metrics-out", default="", help="rank 0 writes the metrics here")
    p.add_argument("--timeout", type=float, default=600.0, help="collective timeout (s)")
    p.add_argument("--request-id", default=None, help="recorded with the committed step")
    p.add_argument("--kind", default="rl", help="the step's kind, recorded with it")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank%(process)d %(message)s")
    rank, _ = init_process_group(args.timeout)
    try:
        md = ModelDir(args.root, args.project, args.name)
        metrics = train_journaled_step(md, args.step, args.base_model,
                                       LoraConfig.model_validate_json(args.lora),
                                       TrainConfig.model_validate_json(args.config),
                                       request_id=args.request_id, kind=args.kind)
        if rank == 0 and args.metrics_out:
            tmp = Path(args.metrics_out + ".tmp")
            tmp.write_text(json.dumps(metrics))
            tmp.replace(args.metrics_out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
