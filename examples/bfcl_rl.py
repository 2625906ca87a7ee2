"""GRPO on BFCL, the Berkeley Function Calling Leaderboard: the embedded SmolLM2-135M learns to
choose a function and fill its arguments, and when no function fits, not to call one, scored by
BFCL's own checker, on a 2-core CPU.

    python examples/bfcl_rl.py            # ~25-35 min on a 2-core CPU; again: 12 more steps

1. Split (fixed, saved as <run dir>/split.json): per category (simple_python, multiple,
   parallel, irrelevance) a seeded hash of each item's id orders the items; the first
   `HELD_OUT[c]` are held out, the rest train. Held-out items are never trained on. A resumed run reuses the saved
   split, and refuses one made with other settings.
2. An attempt: the item's question and its functions as OpenAI tools (BFCL's own conversion),
   one chat completion with a forced strict call (the gateway holds the call to the tools'
   schemas; several calls allowed) and BFCL's AST checker on the answer
   (art_bfcl/, the checker in the side environment .venv-bfcl). An `irrelevance` item offers
   functions none of which fits and is asked with the choice left to the model
   (`tool_choice="auto"`); BFCL passes it when the answer makes no call.
3. Reward = 1 when the checker passes the answer; else `count_credit` (default 0.2) when it made
   as many calls as the item's ground truth holds (none for irrelevance, two to four for
   parallel), plus `call_credit` (default 0.5) x the share of the ground truth's calls it made
   right, each call passing BFCL's per-call check, over as many calls as it made if more
   (`Verdict.matched`). The count credit keeps a signal on *how many* calls in groups where no
   attempt passes: with pass/fail alone, once the model learned "one call" from the single-call
   items, every parallel group failed all 8 attempts and was never trained on again (parallel
   10% -> 0% in three runs of 24 steps). With the count credit alone, the held-out parallel
   answers after training made one right call and stopped (`math_factorial(5)` for "the
   factorial of 5, 7 and 9"): the call credit makes each further right call worth more,
   a ladder up to the pass. Held-out accuracy is BFCL's pass/fail alone.
4. Before training, and after, every held-out item is asked once, greedily (BFCL asks at
   temperature 0.001); the table is BFCL's accuracy per category with 95% Wilson intervals.
5. Each step: `groups_per_step` training items with signal (dynamic sampling: items whose
   attempts all score alike are replaced, up to `oversample` x as many drawn), shared out over
   the four categories (`balance`: without it the steps fill up with the categories the model
   still varies on, and parallel, on which it collapses to one call, is hardly trained: 3 of 60
   groups in 12 steps, 18 of 68 with it), `parallel` and `irrelevance` weighted 3 each
   (`parallel_weight`, `irrelevance_weight`) against 1 for `simple_python` and `multiple`
   (`train_loop(stratum_weights=...)`, a share of places and of draws). With one share for
   all, the single-call items taught "one call" everywhere within four steps and held-out
   parallel fell (1/40 -> 0/40 at seed 1, twice). With `parallel` at 2 and `irrelevance`
   at 1, the forced calls of the other categories taught calling where nothing fits, and
   `irrelevance` groups found signal only once that drift had happened, a few draws a step:
   held-out irrelevance 40/40 -> 32/40 at seed 1. With 3 and 3 seeds 0 and 1 held both
   (docs/bfcl.md),
   x `rollouts_per_group` attempts sampled at `TEMPERATURE`, one GRPO step on a LoRA,
   hot-swap (art_core.loop.train_loop).

The prompting is the same before and after: only the weights change. Several calls are
allowed on every item (as OpenAI's API default, which BFCL's handler leaves alone), so how many
calls to make is the model's to learn: the base model fills a call well but repeats it, which
BFCL fails as a wrong count (see docs/bfcl.md for the measured runs).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from art_bfcl import (
    BfclWorker,
    Item,
    Prompting,
    Split,
    Verdict,
    make_split,
    summarize,
    table,
)
from art_core import (
    LocalBackend,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)
from art_core.loop import load_eval_groups, train_loop
from art_core.model import TrainResult

HELD_OUT = {"simple_python": 100, "multiple": 60, "parallel": 40, "irrelevance": 40}
"""Held-out items per category: 100 + 60 for the goal (simple_python + multiple), and enough of
parallel and irrelevance to see them move; the rest of each category trains (300, 140, 160,
200). Training only on items that need a call taught the model to call where nothing fits
(26 of 40 unseen irrelevance items, against 0 of 40 for the base model): irrelevance items
train beside them, and their groups hold signal once the model starts calling there."""
TEMPERATURE = 1.0
EVAL = Prompting(temperature=0.0)  # BFCL's near-greedy decoding
TRAIN = Prompting(temperature=TEMPERATURE)


@dataclass(frozen=True)
class Task:
    item: Item
    held_out: bool


@dataclass
class Settings:
    steps: int = 12  # ~25-35 min here; held-out simple_python+multiple 42-51% (docs/bfcl.md)
    groups_per_step: int = 6
    rollouts_per_group: int = 8
    learning_rate: float = 1e-3
    seed: int = 0
    held_out: dict[str, int] = field(default_factory=lambda: dict(HELD_OUT))
    oversample: float = 3.0  # dynamic sampling: items drawn per step, at most, per item trained
    count_credit: float = 0.2  # reward of a failed answer with the right number of calls
    call_credit: float = 0.5  # reward of a failed answer per expected call it got right
    balance: bool = True  # each step's groups shared out over the categories (strata)
    # shares of a step's groups and draws against 1 for simple_python and multiple (docs/bfcl.md)
    parallel_weight: float = 3.0  # 2 beside irrelevance at 3: parallel 1/40 -> 0/40 at seed 1
    irrelevance_weight: float = 3.0  # 1: a few draws a step, behind the drift to calling
    kl_coef: float = 0.0  # TrainConfig.kl_coef: a pull towards the base model


async def attempt(model: TrainableModel, worker: BfclWorker, task: Task,
                  count_credit: float = 0.0, call_credit: float = 0.0) -> Trajectory:
    """One attempt at a task, as a trainable trajectory scored by BFCL's checker, and for a
    failed answer, `count_credit` for the right number of calls and `call_credit` times the
    share of calls it got right (step 3 above)."""
    item = task.item
    prompting = EVAL if task.held_out else TRAIN
    traj = Trajectory(messages=[dict(m) for m in item.messages], tools=item.tools)
    response = await model.openai_client().chat.completions.create(
        model=model.name, **prompting.request(item))
    message = traj.add_completion(response)
    verdict = worker.check(item, message)  # ~0.1 ms: no thread needed
    calls = len(message.get("tool_calls") or [])
    right_count = calls == len(item.ground_truth)  # irrelevance: no ground truth, no call
    right_calls = verdict.matched / max(verdict.expected, calls, 1)  # extra calls count against
    traj.reward = (1.0 if verdict.valid
                   else count_credit * right_count + call_credit * right_calls)
    traj.metrics["passed"] = verdict.valid
    traj.metrics["right_calls"] = right_calls
    traj.metrics["called"] = calls > 0
    traj.metrics["right_count"] = right_count
    traj.metadata.update(id=item.id, category=item.category,
                         error_type=verdict.error_type or "")
    return traj


def step_line(result: TrainResult, groups: list[TrajectoryGroup]) -> str:
    """The step's pass count, and the categories of the groups it trained on (which of them
    still hold signal)."""
    m, passed = result.metrics, [t.metrics["passed"] for g in groups for t in g]
    cats = Counter(str(g.trajectories[0].metadata["category"]) for g in groups if g.trajectories)
    return (f"step {result.step:>3}  train passed {sum(passed):>2}/{len(passed)}  "
            f"loss {m['loss']:+.4f}  {m['seconds']:.1f} s train  groups: "
            + ", ".join(f"{c} {n}" for c, n in sorted(cats.items())))


def held_out_results(run_dir: Path, step: int) -> list[tuple[str, Verdict]]:
    """(category, verdict) of each held-out attempt `train_loop` saved at `step`."""
    return [(str(t.metadata["category"]),
             Verdict(bool(t.metrics.get("passed")), str(t.metadata.get("error_type")) or None))
            for g in load_eval_groups(run_dir, step) for t in g]


def the_split(worker: BfclWorker, run_dir: Path, seed: int,
              held_out: dict[str, int] | None = None) -> Split:
    """The split of this run: made and saved on the first run, read back on the next ones."""
    held_out = held_out or HELD_OUT
    items = [i for c in held_out for i in worker.load(c)]
    split = make_split(items, held_out, seed=seed)
    path = run_dir / "split.json"
    if path.exists():
        saved = Split.load(path)
        if saved != split:
            raise SystemExit(f"{path} was made with other settings (seed, held-out sizes or "
                             "BFCL version): use --fresh, or another --path")
    else:
        split.save(path)
    return split


async def run(path: str = ".art", settings: Settings | None = None, fresh: bool = False,
              name: str = "bfcl", project: str = "bfcl") -> dict[str, Any]:
    s = settings or Settings()
    t_start = time.perf_counter()
    with BfclWorker() as worker:
        async with LocalBackend(path) as backend:
            model = TrainableModel(name=name, project=project)
            run_dir = Path(path) / project / "models" / name
            if fresh and run_dir.exists():
                shutil.rmtree(run_dir)
                print(f"--fresh: removed {run_dir}")
            run_dir.mkdir(parents=True, exist_ok=True)
            split = the_split(worker, run_dir, s.seed, s.held_out)
            by_id = {i.id: i for c in split.held_out for i in worker.load(c)}
            held = [Task(by_id[i], True) for c, ids in split.held_out.items() for i in ids]
            train = [Task(by_id[i], False) for c, ids in split.train.items() for i in ids]
            t0 = time.perf_counter()
            await model.register(backend)
            print(f"registered {model.name} on {model.base_model} "
                  f"({time.perf_counter() - t0:.0f} s); BFCL {worker.version}; split "
                  f"{run_dir / 'split.json'}: held out "
                  + ", ".join(f"{c} {len(v)}" for c, v in split.held_out.items())
                  + "; train " + ", ".join(f"{c} {len(v)}" for c, v in split.train.items()))
            loop = await train_loop(
                model, lambda task: attempt(model, worker, task, s.count_credit, s.call_credit), train, held,
                run_dir,
                steps=s.steps, groups_per_step=s.groups_per_step,
                rollouts_per_group=s.rollouts_per_group, eval_rollouts=1,
                train_config=TrainConfig(learning_rate=s.learning_rate, kl_coef=s.kl_coef), seed=s.seed,
                max_concurrency=16, oversample=s.oversample, on_step=step_line,
                stratify=(lambda task: task.item.category) if s.balance else None,
                stratum_weights={"parallel": s.parallel_weight,
                                 "irrelevance": s.irrelevance_weight} if s.balance else None)
            first, last = min(loop.evals), loop.after.step
            before = summarize(held_out_results(run_dir, first))
            after = summarize(held_out_results(run_dir, last))
            print("\nheld-out accuracy (BFCL's checker, greedy, one attempt per item):")
            print(table({f"step {first}": before, f"step {last}": after}))
            print(f"\n{time.perf_counter() - t_start:.0f} s in all; run directory {run_dir}")
            return {"before": before, "after": after, "steps": loop.steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    p.add_argument("--path", default=".art", help="run directory (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    p.add_argument("--rollouts-per-group", type=int, default=d.rollouts_per_group)
    p.add_argument("--learning-rate", type=float, default=d.learning_rate)
    p.add_argument("--seed", type=int, default=d.seed, help="of the split and the steps' draws")
    p.add_argument("--oversample", type=float, default=d.oversample,
                   help="dynamic sampling: items drawn per step, at most, as a multiple of "
                        "--groups-per-step, while items whose attempts all pass or all fail are "
                        "replaced; 1 trains the first draw (default: %(default)s)")
    p.add_argument("--count-credit", type=float, default=d.count_credit,
                   help="reward of a failed answer that made as many calls as the ground truth "
                        "(0: BFCL's pass/fail alone) (default: %(default)s)")
    p.add_argument("--call-credit", type=float, default=d.call_credit,
                   help="reward of a failed answer per share of the ground truth's calls it "
                        "made right, over as many calls as it made if more (default: "
                        "%(default)s)")
    p.add_argument("--no-balance", dest="balance", action="store_false",
                   help="draw the step's items from all categories at once, not an even share "
                        "of each")
    p.add_argument("--parallel-weight", type=float, default=d.parallel_weight,
                   help="parallel's share of each step's groups and draws, in categories' "
                        "shares (default: %(default)s)")
    p.add_argument("--irrelevance-weight", type=float, default=d.irrelevance_weight,
                   help="irrelevance's share of each step's groups and draws, in categories' "
                        "shares (default: %(default)s)")
    p.add_argument("--kl-coef", type=float, default=d.kl_coef,
                   help="weight of a KL penalty to the base model (default: %(default)s)")
    p.add_argument("--fresh", action="store_true", help="start over: delete the run's model")
    a = p.parse_args(argv)
    for flag, w in (("--parallel-weight", a.parallel_weight),
                    ("--irrelevance-weight", a.irrelevance_weight)):
        if not w > 0:
            p.error(f"{flag} must be positive, got {w}")
    asyncio.run(run(a.path, Settings(a.steps, a.groups_per_step, a.rollouts_per_group,
                                     a.learning_rate, a.seed, oversample=a.oversample,
                                     count_credit=a.count_credit, call_credit=a.call_credit,
                                     balance=a.balance, parallel_weight=a.parallel_weight,
                                     irrelevance_weight=a.irrelevance_weight,
                                     kl_coef=a.kl_coef),
                    a.fresh))
    return 0


if __name__ == "__main__":
    sys.exit(main())
