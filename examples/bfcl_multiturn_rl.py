"""BFCL multi-turn (`multi_turn_base`) on the embedded SmolLM2-135M: a supervised warm start on
the ground truth, then GRPO with per-turn or episode credit, scored by BFCL's own multi-turn
checker, on a 2-core CPU.

    python examples/bfcl_multiturn_rl.py --fresh                   # per-turn credit; ~45-60 min
    python examples/bfcl_multiturn_rl.py --fresh --credit episode  # the same, episode credit

1. Split (fixed, saved as <run dir>/split.json): `held_out_ids` holds out `held_out` (100) of
   the 200 entries by a seeded hash of their ids; held-out entries are never trained on. A
   resumed run reuses the saved split and refuses one made with other settings. Training uses
   the `train_entries` training entries whose ground truth is shortest (characters of tools,
   user turns and ground-truth calls): every token costs here (a ~7k-token episode trains in
   tens of seconds on this CPU), and the long ones outgrow the 8,192-token context.
2. Warm start, once (the model's first step): SFT (`model.train_sft`) on those entries'
   ground-truth conversations (`ground_truth_episode`: each ground-truth call a step, BFCL's
   result of it the tool message, a short reply ending each user turn). The base model never
   makes a call that decodes here (docs/bfcl.md), so without it every RL group scores alike.
3. An episode (`multi_turn_episode`) runs as BFCL's `inference_multi_turn_FC` does: per user
   turn, the model is asked with the entry's tools until it makes no call, each call run by
   BFCL on the episode's own API instances; BFCL's step limit. Reward: the turns passed in a
   row from the first / turns (BFCL's checker, each prefix checked); each user turn that passed
   gives its last assistant turn 1 / turns, the per-turn rewards.
4. Held-out: the first `eval_entries` held-out entries, one greedy episode each, after the warm
   start and after training; the table is the official accuracy (all turns pass) and the
   per-turn pass rate, with 95% Wilson intervals.
5. Each step: `groups_per_step` training entries with signal (dynamic sampling) x
   `rollouts_per_group` episodes at temperature 1, one GRPO step on the LoRA with
   `--credit turn` (`TrainConfig(advantage="turn")`: each turn's return-to-go against the
   group's other episodes at the same turn) or `--credit episode` (`advantage="group"`: the
   episode's reward on every sampled token), hot-swap (art_core.loop.train_loop).

Measured (docs/bfcl.md, 2-core CPU): the warm start takes ~26 min and teaches the call format
(calls that decode, none before) but not right calls: no held-out turn passed (0/27) and RL's
first step found no group with signal. SmolLM2-135M is too small for this benchmark:
`--base-model` trains a larger one (on a GPU host, docs/gpu.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_bfcl import (
    BFCL_VERSION,
    BfclWorker,
    MultiTurnItem,
    ground_truth_episode,
    held_out_ids,
    multi_turn_episode,
    multi_turn_report,
)
from art_core import (
    EngineConfig,
    LocalBackend,
    ModelConfig,
    SFTConfig,
    TrainableModel,
    TrainConfig,
    TrajectoryGroup,
)
from art_core.loop import load_eval_groups, train_loop
from art_core.model import DEFAULT_BASE_MODEL, TrainResult

CONTEXT = 8192  # an entry's tool docs are ~5-7k tokens (docs/bfcl.md)
CREDITS = {"turn": "turn", "episode": "group"}  # --credit -> TrainConfig.advantage


@dataclass(frozen=True)
class Task:
    item: MultiTurnItem
    held_out: bool


@dataclass
class Settings:
    steps: int = 4
    groups_per_step: int = 2
    rollouts_per_group: int = 4
    learning_rate: float = 5e-4
    seed: int = 0
    held_out: int = 100  # half of the 200 entries: the held-out table
    eval_entries: int = 8  # held-out entries evaluated (~0.5-1 min each, greedy, here)
    train_entries: int = 12  # shortest training entries: SFT data and RL scenarios
    sft_epochs: int = 3
    sft_batch_size: int = 4  # 9 updates from 12 examples x 3 epochs (8 would give 5)
    sft_learning_rate: float = 1e-3  # few examples: benchmarks/sft_warmstart.py's rate
    credit: str = "turn"
    oversample: float = 2.0
    max_tokens: int = 256
    base_model: str = DEFAULT_BASE_MODEL  # the embedded SmolLM2-135M


def size(item: MultiTurnItem) -> int:
    """Characters of what an entry's episode holds before any result: its tools, user turns
    and ground-truth calls (a stand-in for its tokens, to pick the short entries)."""
    return (len(json.dumps(item.tools)) + len(json.dumps(item.turns))
            + sum(len(c) for turn in item.ground_truth for c in turn))


def the_split(items: list[MultiTurnItem], run_dir: Path, s: Settings) -> dict[str, Any]:
    """The split of this run: made and saved on the first run, read back on the next ones."""
    held = held_out_ids(items, s.held_out, s.seed)
    held_set = set(held)
    rest = sorted((i for i in items if i.id not in held_set), key=lambda i: (size(i), i.id))
    split = {"bfcl": BFCL_VERSION, "seed": s.seed, "held_out": held,
             "train": [i.id for i in rest[:s.train_entries]]}
    path = run_dir / "split.json"
    if path.exists():
        if json.loads(path.read_text()) != split:
            raise SystemExit(f"{path} was made with other settings (seed, --held-out, "
                             "--train-entries or BFCL version): use --fresh, or another --path")
    else:
        path.write_text(json.dumps(split, indent=1))
    return split


def step_line(result: TrainResult, groups: list[TrajectoryGroup]) -> str:
    """The step's turns passed in training, and what it cost."""
    trajs = [t for g in groups for t in g]
    ok = sum(int(t.metrics["turns_passed"]) for t in trajs)
    turns = sum(int(t.metrics["turns"]) for t in trajs)
    m = result.metrics
    return (f"step {result.step:>3}  train turns passed {ok:>3}/{turns:<3} "
            f"({len(groups)} groups)  loss {m['loss']:+.4f}  {m['seconds']:.1f} s train")


def held_out_table(run_dir: Path, steps: list[int]) -> str:
    return "\n\n".join(f"step {step}:\n" + multi_turn_report(
        [t for g in load_eval_groups(run_dir, step) for t in g]) for step in steps)


async def run(path: str = ".art", settings: Settings | None = None, fresh: bool = False,
              name: str = "bfcl-mt", project: str = "bfcl") -> dict[str, Any]:
    s = settings or Settings()
    if s.credit not in CREDITS:
        raise ValueError(f"credit must be one of {sorted(CREDITS)}, got {s.credit!r}")
    t_start = time.perf_counter()
    with BfclWorker() as worker:
        async with LocalBackend(path) as backend:
            model = TrainableModel(name=name, project=project, config=ModelConfig(
                engine=EngineConfig(max_model_len=CONTEXT)), base_model=s.base_model)
            run_dir = Path(path) / project / "models" / name
            if fresh and run_dir.exists():
                shutil.rmtree(run_dir)
                print(f"--fresh: removed {run_dir}")
            run_dir.mkdir(parents=True, exist_ok=True)
            items = worker.multi_turn()
            split = the_split(items, run_dir, s)
            by_id = {i.id: i for i in items}
            held = [Task(by_id[i], True) for i in split["held_out"][:s.eval_entries]]
            train = [Task(by_id[i], False) for i in split["train"]]
            t0 = time.perf_counter()
            await model.register(backend)
            print(f"registered {model.name} on {model.base_model} "
                  f"({time.perf_counter() - t0:.0f} s); BFCL {worker.version} multi_turn_base; "
                  f"held out {len(split['held_out'])} (evaluated: {len(held)}), "
                  f"train {len(train)}; credit {s.credit}")
            if await model.get_step() == 0:
                data = [ground_truth_episode(t.item, worker) for t in train]
                t0 = time.perf_counter()
                result = await model.train_sft(data, SFTConfig(
                    epochs=s.sft_epochs, batch_size=s.sft_batch_size,
                    learning_rate=s.sft_learning_rate, max_length=CONTEXT))
                m = result.metrics
                print(f"warm start: SFT on {int(m['examples'])} ground-truth conversations "
                      f"({int(m['skipped_over_long'])} over {CONTEXT} tokens skipped), "
                      f"{s.sft_epochs} epochs, loss {m['loss_first_epoch']:.3f} -> "
                      f"{m['loss']:.3f}, {time.perf_counter() - t0:.0f} s")
            client = model.openai_client()

            def episode(task: Task) -> Any:
                return multi_turn_episode(client, model.name, task.item, worker,
                                          temperature=0.0 if task.held_out else 1.0,
                                          max_tokens=s.max_tokens)

            loop = await train_loop(
                model, episode, train, held, run_dir, steps=s.steps,
                groups_per_step=s.groups_per_step, rollouts_per_group=s.rollouts_per_group,
                eval_rollouts=1, train_config=TrainConfig(
                    learning_rate=s.learning_rate, advantage=CREDITS[s.credit]),
                seed=s.seed, max_concurrency=8, oversample=s.oversample, on_step=step_line)
            first, last = min(loop.evals), loop.after.step
            print(f"\nheld-out (BFCL's multi-turn checker, greedy, {len(held)} entries):")
            print(held_out_table(run_dir, [first, last]))
            print(f"\n{time.perf_counter() - t_start:.0f} s in all; run directory {run_dir}")
            return {"before": loop.before, "after": loop.after, "steps": loop.steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    p.add_argument("--path", default=".art", help="run directory (default: %(default)s)")
    p.add_argument("--credit", choices=sorted(CREDITS), default=d.credit,
                   help="per-turn or episode credit (default: %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    p.add_argument("--rollouts-per-group", type=int, default=d.rollouts_per_group)
    p.add_argument("--learning-rate", type=float, default=d.learning_rate)
    p.add_argument("--seed", type=int, default=d.seed, help="of the split and the steps' draws")
    p.add_argument("--held-out", type=int, default=d.held_out)
    p.add_argument("--eval-entries", type=int, default=d.eval_entries,
                   help="held-out entries evaluated (default: %(default)s)")
    p.add_argument("--train-entries", type=int, default=d.train_entries,
                   help="shortest training entries, for SFT and RL (default: %(default)s)")
    p.add_argument("--sft-epochs", type=int, default=d.sft_epochs)
    p.add_argument("--oversample", type=float, default=d.oversample)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--base-model", default=d.base_model,
                   help="the model to train (default: %(default)s, embedded)")
    p.add_argument("--fresh", action="store_true", help="start over: delete the run's model")
    a = p.parse_args(argv)
    for flag in ("steps", "eval_entries", "train_entries", "sft_epochs"):
        if getattr(a, flag) < (0 if flag == "steps" else 1):
            p.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(a, flag)}")
    asyncio.run(run(a.path, Settings(
        steps=a.steps, groups_per_step=a.groups_per_step,
        rollouts_per_group=a.rollouts_per_group, learning_rate=a.learning_rate, seed=a.seed,
        held_out=a.held_out, eval_entries=a.eval_entries, train_entries=a.train_entries,
        sft_epochs=a.sft_epochs, credit=a.credit, oversample=a.oversample,
        max_tokens=a.max_tokens, base_model=a.base_model), a.fresh))
    return 0


if __name__ == "__main__":
    sys.exit(main())
