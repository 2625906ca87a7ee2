"""BFCL (the Berkeley Function Calling Leaderboard) on any model our gateway serves, scored by
BFCL's own AST checker.

For each item of the chosen categories: the item's messages and its functions as OpenAI tools
(converted by BFCL's own OpenAI handler), one chat completion through the ordinary OpenAI tools
API, and BFCL's verdict on the response (`bfcl-eval` 2026.3.23, run in the side environment
`.venv-bfcl` by art_bfcl/worker.py). Printed per category: items, passed, accuracy with
its 95% Wilson interval, and the checker's error types (wrong function, wrong value, wrong type,
missing argument, wrong count, ...).

    .venv/bin/python benchmarks/bfcl_eval.py                        # the base model (SmolLM2-135M)
    .venv/bin/python benchmarks/bfcl_eval.py --model bfcl@4 --path .art --project bfcl
    .venv/bin/python benchmarks/bfcl_eval.py --model bfcl --split .art/bfcl/models/bfcl/split.json
    .venv/bin/python benchmarks/bfcl_eval.py --base-url http://127.0.0.1:7999/v1 --model agent

Model names are the gateway's: the base model by its own name, a trained model `name` (its
latest step) or `name@k`. Without `--base-url` the script starts a LocalBackend: for a base
model it asks a fresh model's step 0 in a temporary directory (the base's weights, served
merged: on a CPU ~4x faster than the base's own name, which the gateway serves as a LoRA delta
beside them); for a trained model, its run directory (`--path`, `--project`). How items are asked (forced strict
calls, parallel calls allowed, greedy) is `art_bfcl/tasks.py`'s `Prompting`, the same
prompting `examples/bfcl_rl.py` trains and reports with; see docs/bfcl.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from art_bfcl import (
    CATEGORIES,
    OPEN_CATEGORIES,
    Attempt,
    BfclWorker,
    Item,
    Prompting,
    Split,
    evaluate,
    summarize,
    table,
)


def select(worker: BfclWorker, categories: list[str], limit: int | None = None,
           split: Split | None = None) -> list[Item]:
    """The items to ask: per category, those held out by `split` (when given), the first
    `limit` of them (when given)."""
    out = []
    for cat in categories:
        items = worker.load(cat)
        if split is not None:
            if cat not in split.held_out:
                raise SystemExit(f"the split holds out nothing of {cat!r}: "
                                 f"{sorted(split.held_out)}")
            held = set(split.held_out[cat])
            items = [i for i in items if i.id in held]
        out += items[:limit] if limit else items
    return out


async def run(client: Any, model: str, items: list[Item], worker: BfclWorker,
              prompting: Prompting, concurrency: int = 16) -> list[Attempt]:
    """Ask every item once; print the table; return the attempts."""
    t0 = time.perf_counter()
    attempts = await evaluate(client, model, items, worker, prompting, concurrency)
    print(table(summarize((a.item.category, a.verdict) for a in attempts)))
    print(f"({len(items)} items in {time.perf_counter() - t0:.0f} s)")
    return attempts


async def main(argv: list[str] | None = None) -> int:
    from art_core.model import DEFAULT_BASE_MODEL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_BASE_MODEL,
                   help="a name the gateway serves: the base model, name or name@k "
                        "(default: %(default)s)")
    p.add_argument("--categories", nargs="+", default=list(CATEGORIES),
                   choices=CATEGORIES + OPEN_CATEGORIES,
                   help="irrelevance is asked with tool_choice='auto' (default: %(default)s)")
    p.add_argument("--limit", type=int, default=None, help="the first N items per category")
    p.add_argument("--split", type=Path, default=None,
                   help="a split.json saved by examples/bfcl_rl.py: only its held-out items")
    p.add_argument("--base-url", default=None,
                   help="an OpenAI-compatible endpoint already running (art serve, a gateway)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--path", default=".art", help="run directory of a trained model")
    p.add_argument("--project", default="bfcl", help="project of a trained model")
    p.add_argument("--parallel", choices=("always", "never", "category"),
                   default=Prompting.parallel, help="when several calls are allowed")
    p.add_argument("--temperature", type=float, default=Prompting.temperature)
    p.add_argument("--max-tokens", type=int, default=Prompting.max_tokens)
    p.add_argument("--concurrency", type=int, default=16)
    a = p.parse_args(argv)
    prompting = Prompting(parallel=a.parallel, temperature=a.temperature,
                          max_tokens=a.max_tokens)

    with BfclWorker() as worker:
        split = Split.load(a.split) if a.split else None
        items = select(worker, a.categories, a.limit, split)
        print(f"BFCL {worker.version} ({', '.join(a.categories)}"
              f"{', held-out items of ' + str(a.split) if a.split else ''}), model {a.model}, "
              f"checker as {worker.registry}; {prompting}")
        if a.base_url:
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=a.base_url, api_key=a.api_key or "none")
            await run(client, a.model, items, worker, prompting, a.concurrency)
            return 0
        await _local(a, items, worker, prompting)
    return 0


async def _local(a: argparse.Namespace, items: list[Item], worker: BfclWorker,
                 prompting: Prompting) -> None:
    """Serve `a.model` from a LocalBackend, then run."""
    from art_core import LocalBackend, TrainableModel

    name = a.model.rpartition("@")[0] or a.model
    trained = Path(a.path) / a.project / "models" / name
    with tempfile.TemporaryDirectory() as tmp:
        if trained.is_dir():
            path, model = a.path, TrainableModel(name=name, project=a.project)
        elif "@" in a.model:
            raise SystemExit(f"no trained model {name!r} in {trained.parent}: train one with "
                             "examples/bfcl_rl.py, or give --path and --project")
        else:  # a base model: a fresh model's step 0 (see below)
            path, model = tmp, TrainableModel(name="bfcl-base", project="bench",
                                              base_model=a.model)
        async with LocalBackend(path) as backend:
            t0 = time.perf_counter()
            await model.register(backend)
            print(f"engine and gateway up in {time.perf_counter() - t0:.0f} s")
            # A fresh model's step 0 is the base's weights (its adapter is zero), served merged;
            # the base's own name is served as a LoRA delta beside them, ~4x slower on a CPU.
            asked = model.name if path == tmp else a.model
            await run(model.openai_client(), asked, items, worker, prompting, a.concurrency)


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
