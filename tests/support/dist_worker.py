"""One rank for tests/unit/test_distributed.py, run by torchrun (not a test module itself).

    save ROOT BASE   every rank calls save_adapter(ROOT/rank<r>): only rank 0 may write
    kill ROOT BASE   rank 1 joins, loads the adapter, then dies by SIGKILL before the step;
                     rank 0 trains the journaled step 1 and must not commit a checkpoint
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from art_core.config import LoraConfig, TrainConfig
from art_core.storage import ModelDir
from art_core.train.distributed import (
    DistributedTrainer,
    init_process_group,
    train_journaled_step,
)

LORA = LoraConfig(rank=4)


def main() -> None:
    mode, root, base = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    rank, _ = init_process_group(timeout_s=60)
    if mode == "save":
        DistributedTrainer(base, LORA, device="cpu").save_adapter(root / f"rank{rank}")
    elif mode == "kill":
        md = ModelDir(root, "p", "m")
        if rank == 1:
            trainer = DistributedTrainer(base, LORA, device="cpu")  # same collectives as rank 0
            trainer.load_adapter(md.checkpoint(md.latest_step() or 0))
            os.kill(os.getpid(), signal.SIGKILL)
        train_journaled_step(md, 1, base, LORA, TrainConfig(learning_rate=1e-2, bf16=False))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
