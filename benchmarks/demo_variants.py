"""The demo (`art demo`) or the MCP inventory example (`--task mcp`, examples/mcp_rl.py) under
other settings, side by side: dynamic sampling on and off, and the losses (CISPO, DPPO, PPO,
PPO with truncated importance sampling).

Each run is a fresh `art_langgraph.demo.run` or `mcp_rl.run` (its own run directory, engine
started and stopped; run k is seeded k), one after the other (one vLLM engine at a time). It
prints, per run, held-out success before and after with 95% Wilson intervals (the demo's
`success`; MCP: `solved`, reward 1), whether the intervals overlap, and the wall time; then one
line per variant. The variants:

    default   the demo's defaults: CISPO, dynamic sampling (oversample 3)
    off       dynamic sampling off (oversample 1: the first draw trains as it comes);
              --off-steps steps, to compare at about equal wall time
    dppo      loss="dppo" (DPPO-Binary-TV)
    ppo       loss="ppo"
    ppo-tis   loss="ppo", tis_cap=2 (token-level truncated importance sampling)
    turn      MCP only: a reward per turn (its progress on the stock) and per-turn credit
              (TrainConfig(advantage="turn")), against `default`'s episode reward

    python benchmarks/demo_variants.py --variants default off --runs 2 --off-steps 7
    python benchmarks/demo_variants.py --variants dppo ppo ppo-tis --runs 2
    python benchmarks/demo_variants.py --task mcp --variants default dppo ppo ppo-tis \
        --runs 2 --out mcp.jsonl

With `--out`, a (task, variant, run) already in the file is not run again: a long table can be
filled over several sittings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from art_core import TrainConfig  # noqa: E402
from art_core.loop import EvalStats  # noqa: E402
from art_langgraph import demo  # noqa: E402

sys.path.insert(0, str(ROOT / "examples"))
import mcp_rl  # noqa: E402

LR = 1e-3  # the demo's
VARIANTS = {
    "default": {},
    "off": {"oversample": 1.0},
    "dppo": {"train_config": TrainConfig(learning_rate=LR, loss="dppo")},
    "ppo": {"train_config": TrainConfig(learning_rate=LR, loss="ppo")},
    "ppo-tis": {"train_config": TrainConfig(learning_rate=LR, loss="ppo", tis_cap=2.0)},
    "turn": {"credit": "turn"},
}
ONLY = {"turn": "mcp"}
"""Variants one task has: per-turn credit needs a reward per turn (MCP: the progress each turn
made on the stock, examples/mcp_server_inventory.py `turn_reward`); the demo has none."""


SUCCESS = {"demo": "success", "mcp": "solved"}
"""The held-out rate each task reports: the demo's answer check; MCP's reward 1 (stock right
and `complete_task` called)."""


def interval(stats: EvalStats, name: str) -> tuple[int, int, float, float]:
    rate = stats.rate(name)
    lo, hi = rate.ci
    return rate.k, rate.n, lo, hi


async def one(task: str, variant: str, run: int, steps: int, root: Path) -> dict[str, object]:
    t0 = time.perf_counter()
    path = str(root / f"{task}-{variant}-{run}")
    if task == "demo":
        out = await demo.run(path, steps=steps, fresh=True, seed=run, **VARIANTS[variant])
        before, after = out["before"], out["after"]
    else:
        result = await mcp_rl.run(path, steps=steps, seed=run, **VARIANTS[variant])
        before, after = result.before, result.after
    wall = time.perf_counter() - t0
    (k0, n0, lo0, hi0), (k1, n1, lo1, hi1) = (interval(before, SUCCESS[task]),
                                              interval(after, SUCCESS[task]))
    return {"task": task, "variant": variant, "run": run, "steps": steps, "before": f"{k0}/{n0}",
            "before_ci": [round(lo0, 3), round(hi0, 3)], "after": f"{k1}/{n1}",
            "after_ci": [round(lo1, 3), round(hi1, 3)], "beyond_noise": lo1 > hi0,
            "reward": [round(before.reward, 3), round(after.reward, 3)],
            **({"completed": [round(before.rate("completed").value, 3),
                              round(after.rate("completed").value, 3)]} if task == "mcp" else {}),
            "wall_s": round(wall)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=list(SUCCESS), default="demo")
    p.add_argument("--variants", nargs="+", default=["default", "off"], choices=list(VARIANTS))
    p.add_argument("--runs", type=int, default=2, help="runs per variant (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="steps per run (default: %(default)s)")
    p.add_argument("--off-steps", type=int, default=None,
                   help="steps for 'off' (default: --steps); more for about equal wall time")
    p.add_argument("--out", type=Path, default=None, help="append one JSON row per run here")
    args = p.parse_args()
    for variant in args.variants:
        if ONLY.get(variant, args.task) != args.task:
            p.error(f"variant {variant!r} runs only with --task {ONLY[variant]}")
    demo._quiet()
    rows = []
    done = set()
    if args.out and args.out.exists():
        for line in args.out.read_text().splitlines():
            r = json.loads(line)
            done.add((r.get("task", "demo"), r["variant"], r["run"]))
    with tempfile.TemporaryDirectory(prefix="demo-variants-") as tmp:
        for variant in args.variants:
            for run in range(args.runs):
                if (args.task, variant, run) in done:
                    print(f"{args.task} {variant} run {run}: in {args.out}, not run again")
                    continue
                steps = args.off_steps if variant == "off" and args.off_steps else args.steps
                row = asyncio.run(one(args.task, variant, run, steps, Path(tmp)))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with args.out.open("a") as f:
                        f.write(json.dumps(row) + "\n")
    print(f"\n{'variant':10} {'run':>3} {'steps':>5} {'before':>8} {'after':>8} "
          f"{'after 95% CI':>14} {'beyond noise':>12} {'wall':>7}")
    for r in rows:
        lo, hi = r["after_ci"]
        print(f"{r['variant']:10} {r['run']:>3} {r['steps']:>5} {r['before']:>8} {r['after']:>8} "
              f"{f'[{100 * lo:.0f}%, {100 * hi:.0f}%]':>14} {str(r['beyond_noise']):>12} "
              f"{r['wall_s']:>6}s")


if __name__ == "__main__":
    main()
