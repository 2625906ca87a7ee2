"""A pipeline run in a process of its own, so a crash test can kill it at a failpoint
(ART_FAILPOINT, art_core/failpoints.py) and run it again: the real trainer on a tiny model,
the engine a stand-in (tests/support/runs.py), rollouts made up with the step they read.

    python -m tests.support.pipeline_worker ROOT BASE_MODEL PIPELINE_DIR STEPS
prints one JSON line: the steps this run trained.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from art_core import PipelineTrainer
from tests.support.pipeline import made_up_rollout
from tests.support.runs import CONFIG, make_backend, tokenizer


async def main(root: str, base: str, pipe: str, steps: int) -> None:
    backend, model = await make_backend(Path(root), Path(base))
    try:
        rollout = made_up_rollout(model, tokenizer(backend, model))
        trainer = PipelineTrainer(model, rollout, ["a", "b", "c", "d"], run_dir=pipe,
                                  groups_per_step=2, rollouts_per_group=2, train_config=CONFIG,
                                  show_progress=False, print_fn=lambda line: None)
        result = await trainer.run(steps)
        print(json.dumps({"steps": [r["step"] for r in result.steps]}), flush=True)
    finally:
        await backend.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
