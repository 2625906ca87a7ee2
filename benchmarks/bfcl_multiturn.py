"""BFCL multi-turn (`multi_turn_base`) on any model our gateway serves, scored by BFCL's own
multi-turn checker.

Each entry runs as BFCL's `inference_multi_turn_FC` runs it (art_bfcl/
multi_turn_rollout.py: per user turn, call until the model makes no call, BFCL's step limit,
BFCL's call decoding and execution on the episode's own API instances), greedy. Printed: the
official accuracy (an entry passes only if every turn passes) and the per-turn pass rate (turns
passed in a row from the first, over all turns), each with its 95% Wilson interval (the turns
of one entry are not independent: the per-turn interval is narrower than it should be), the
mean model calls per entry, and how many entries outgrew the context or hit the step limit.

    .venv/bin/python benchmarks/bfcl_multiturn.py                 # the base model, held-out 100
    .venv/bin/python benchmarks/bfcl_multiturn.py --limit 20      # the first 20 held-out entries
    .venv/bin/python benchmarks/bfcl_multiturn.py --base-url http://127.0.0.1:7999/v1 --model m

The held-out entries are those `held_out_ids` picks (a hash of the seed and the entry's id; the
rest is what examples would train on). Without `--base-url` a LocalBackend serves a fresh
model's step 0 (the base's weights, merged) with an 8,192-token context: an entry's tool docs
are ~5-7k tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from typing import Any

from art_bfcl import (
    BfclWorker,
    MultiTurnItem,
    held_out_ids,
    multi_turn_episode,
    multi_turn_report,
)

HELD_OUT = 100
CONTEXT = 8192


async def run(client: Any, model: str, items: list[MultiTurnItem], worker: BfclWorker,
              concurrency: int, max_tokens: int) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)
    done = 0
    t0 = time.perf_counter()

    async def one(item: MultiTurnItem) -> Any:
        nonlocal done
        async with gate:
            traj = await multi_turn_episode(client, model, item, worker, max_tokens=max_tokens)
        done += 1
        print(f"  {done}/{len(items)} {item.id}: turns passed {int(traj.metrics['turns_passed'])}"
              f"/{int(traj.metrics['turns'])}, {int(traj.metrics['model_calls'])} calls "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        return traj

    trajs = list(await asyncio.gather(*(one(i) for i in items)))
    print(multi_turn_report(trajs))
    print(f"({len(items)} entries in {time.perf_counter() - t0:.0f} s)")
    return trajs


async def main(argv: list[str] | None = None) -> int:
    from art_core.model import DEFAULT_BASE_MODEL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_BASE_MODEL)
    p.add_argument("--held-out", type=int, default=HELD_OUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="the first N held-out entries")
    p.add_argument("--base-url", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8)
    a = p.parse_args(argv)
    with BfclWorker() as worker:
        items = worker.multi_turn()
        try:
            keep = held_out_ids(items, a.held_out, a.seed)[:a.limit]
        except ValueError as e:
            raise SystemExit(f"--held-out: {e}") from None
        by_id = {i.id: i for i in items}
        chosen = [by_id[i] for i in keep]
        print(f"BFCL {worker.version} multi_turn_base, {len(chosen)} held-out entries (seed "
              f"{a.seed}), model {a.model}, greedy, max_tokens {a.max_tokens}")
        if a.base_url:
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=a.base_url, api_key=a.api_key or "none")
            await run(client, a.model, chosen, worker, a.concurrency, a.max_tokens)
            return 0
        from art_core import EngineConfig, LocalBackend, ModelConfig, TrainableModel

        with tempfile.TemporaryDirectory() as tmp:
            model = TrainableModel(name="bfcl-mt-base", project="bench", base_model=a.model,
                                   config=ModelConfig(engine=EngineConfig(max_model_len=CONTEXT)))
            async with LocalBackend(tmp) as backend:
                t0 = time.perf_counter()
                await model.register(backend)
                print(f"engine and gateway up in {time.perf_counter() - t0:.0f} s")
                await run(model.openai_client(), model.name, chosen, worker, a.concurrency,
                          a.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
