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

from art_bfcl import BfclWorker, MultiTurnItem, held_out_ids, multi_turn_episode

HELD_OUT = 100
CONTEXT = 8192


def report(trajs: list[Any]) -> str:
    from art_core.observe.base import wilson

    n = len(trajs)
    passed = sum(int(t.metrics["passed"]) for t in trajs)
    turns = sum(int(t.metrics["turns"]) for t in trajs)
    turns_ok = sum(int(t.metrics["turns_passed"]) for t in trajs)
    rows = [("official (all turns)", passed, n), ("per turn (in a row)", turns_ok, turns)]
    lines = [f"{'metric':<22} {'passed':>7} {'of':>5} {'rate':>7} {'95% interval':>14}"]
    for label, k, total in rows:
        lo, hi = wilson(k, total)
        lines.append(f"{label:<22} {k:>7} {total:>5} {100 * k / max(total, 1):>6.1f}% "
                     f"{f'[{100 * lo:.1f}%, {100 * hi:.1f}%]':>14}")
    calls = sum(t.metrics["model_calls"] for t in trajs) / max(n, 1)
    full = sum(int(t.metrics["context_full"]) for t in trajs)
    quit_ = sum(int(t.metrics["force_quit"]) for t in trajs)
    lines.append(f"{calls:.1f} model calls per entry; context full {full}, step limit {quit_} "
                 f"of {n} entries")
    return "\n".join(lines)


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
    print(report(trajs))
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
