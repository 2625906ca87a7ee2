"""SFT before RL, and distillation, on the demo's agent task (art_langgraph/demo.py).

The student is the base model *without* the demo's two worked examples in its prompt (system
prompt and question only); the teacher is the same base model *with* them (the prompted
model the demo starts from). Every row is held-out success (8 countries never trained on x 3
fields x `--eval-samples` episodes, student prompt) with its 95% Wilson interval:

    base (student prompt)        step 0, no examples
    base (teacher prompt)        step 0, with the worked examples: the level to reach
    SFT                          art_core.distill: the teacher's rollouts of the training
                                 questions (`--teacher-rollouts` per question), the best of
                                 each group rewritten into the student's prompt (the worked
                                 examples left out), one SFT step on them
    SFT + K RL                   K GRPO steps continuing the SFT checkpoint
    K RL                         K GRPO steps from the base (student prompt)
    on-policy distill K          K steps of on-policy distillation from the base, the teacher
                                 the SFT + K RL checkpoint scoring the student's own tokens
                                 (art_core.distill.distill_on_policy), if installed

All models share one engine (one base). RL steps: `--groups-per-step` questions x
`--rollouts-per-group` episodes, the demo's learning rate. Prints the table and the wall time
of each part.

    .venv/bin/python benchmarks/sft_warmstart.py [--steps 3] [--eval-samples 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def student_format(traj: Any) -> Any:
    """A teacher episode as the student would have had it: the system prompt, the question and
    the teacher's turns on it (the worked examples left out). Rendered again for SFT, so the
    teacher's sampled tokens (of another prompt) are dropped."""
    from art_core import Trajectory

    msgs = traj.messages
    last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    return Trajectory(messages=[msgs[0], *msgs[last_user:]], tools=traj.tools,
                      reward=traj.reward, metrics=traj.metrics, metadata=traj.metadata)


async def main(args: argparse.Namespace) -> int:
    from art_core import LocalBackend, SFTConfig, TrainableModel, TrainConfig
    from art_core.distill import distill
    from art_core.loop import evaluate
    from art_langgraph import demo
    from art_langgraph.chat_model import init_chat_model

    root = Path(args.path or tempfile.mkdtemp(prefix="sft-warmstart-"))
    train_q = demo.questions(demo.TRAIN_COUNTRIES)
    held_out = demo.questions(demo.HELD_OUT_COUNTRIES)
    rows: list[tuple[str, Any]] = []
    times: dict[str, float] = {}
    train_config = TrainConfig(learning_rate=args.learning_rate)

    async with LocalBackend(root) as backend:
        models = {k: TrainableModel(name=k, project="warmstart")
                  for k in ("sft", "rl", "opd")}
        t0 = time.perf_counter()
        for m in models.values():
            await m.register(backend)
        times["engine start"] = time.perf_counter() - t0

        def graph_of(model: Any) -> Any:
            return demo.build_agent(init_chat_model(model, max_tokens=demo.MAX_TOKENS,
                                                    temperature=demo.TEMPERATURE))

        async def held_out_success(label: str, model: Any, examples: bool = False) -> None:
            graph = graph_of(model)
            t = time.perf_counter()
            stats = await evaluate(lambda q: demo.episode(graph, q, examples), held_out, 0,
                                   rollouts=args.eval_samples, description=label)
            times[f"eval {label}"] = time.perf_counter() - t
            rows.append((label, stats))
            print(f"{label}: {stats.rate('success').text(percent=True)}", flush=True)

        async def rl_steps(label: str, model: Any) -> None:
            graph = graph_of(model)
            rng = random.Random(args.seed)
            from art_core import gather_trajectory_groups

            t = time.perf_counter()
            for _ in range(args.steps):
                qs = rng.sample(train_q, args.groups_per_step)
                groups = await gather_trajectory_groups(
                    ([demo.episode(graph, q, False) for _ in range(args.rollouts_per_group)]
                     for q in qs), description=label)
                r = await model.train(groups, train_config)
                print(f"  {label} step {r.step}: reward {r.metrics['reward_mean']:.2f}",
                      flush=True)
            times[label] = time.perf_counter() - t

        base = models["rl"]
        await held_out_success("base (student prompt)", base)
        await held_out_success("base (teacher prompt)", base, examples=True)

        async def teacher_rollout(teacher: Any, q: Any) -> Any:
            graph = graph_of(teacher)  # a Model: the name on the student's gateway
            return student_format(await demo.episode(graph, q, True))

        t = time.perf_counter()
        sft = models["sft"]
        result = await distill(sft, f"{base.name}@0", teacher_rollout, train_q,
                               rollouts_per_group=args.teacher_rollouts, min_reward=1.0,
                               config=SFTConfig(epochs=args.sft_epochs,
                                                learning_rate=args.sft_learning_rate))
        times["distill (teacher rollouts + SFT)"] = time.perf_counter() - t
        m = result.metrics
        print(f"SFT on {int(m['distilled_trajectories'])} teacher trajectories (teacher reward "
              f"{m['teacher_reward_mean']:.2f}): loss {m['loss_first_epoch']:.3f} -> "
              f"{m['loss']:.3f}, {m['seconds']:.0f} s", flush=True)
        await held_out_success("SFT", sft)
        await rl_steps(f"SFT + {args.steps} RL", sft)
        await held_out_success(f"SFT + {args.steps} RL", sft)
        await rl_steps(f"{args.steps} RL", base)
        await held_out_success(f"{args.steps} RL", base)

        try:
            from art_core.distill import distill_on_policy
        except ImportError:
            distill_on_policy = None
        if distill_on_policy is not None and not args.skip_on_policy:
            from art_core.model import Model

            opd = models["opd"]
            teacher = Model(name=f"{sft.name}@{await sft.get_step()}", base_url=opd.base_url,
                            api_key=opd.api_key)
            graph = graph_of(opd)
            t = time.perf_counter()
            await distill_on_policy(opd, teacher, lambda q: demo.episode(graph, q, False),
                                    train_q, steps=args.steps,
                                    groups_per_step=args.groups_per_step,
                                    rollouts_per_group=args.rollouts_per_group,
                                    config=train_config)
            times[f"on-policy distill {args.steps}"] = time.perf_counter() - t
            await held_out_success(f"on-policy distill {args.steps}", opd)

    print()
    print(f"held-out success, student prompt unless said ({len(held_out)} questions x "
          f"{args.eval_samples}); K = {args.steps} steps of {args.groups_per_step} x "
          f"{args.rollouts_per_group}")
    print(f"{'':24} {'success':>14} {'95% interval':>14} {'reward':>7}")
    for label, stats in rows:
        rate = stats.rate("success")
        lo, hi = rate.ci
        print(f"{label:24} {rate.k:>5}/{rate.n:<3} {100 * rate.value:5.1f}% "
              f"{f'[{100 * lo:.0f}%, {100 * hi:.0f}%]':>14} {stats.reward:7.2f}")
    print()
    for k, v in times.items():
        print(f"  {k:40} {v:7.1f} s")
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="K: RL / distillation steps")
    p.add_argument("--groups-per-step", type=int, default=6)
    p.add_argument("--rollouts-per-group", type=int, default=4)
    p.add_argument("--teacher-rollouts", type=int, default=2,
                   help="teacher episodes per training question (the best is kept)")
    p.add_argument("--sft-epochs", type=int, default=3)
    p.add_argument("--sft-learning-rate", type=float, default=2e-4,
                   help="SFTConfig's default; the 135M model takes 1e-3, as its RL does")
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=1e-3, help="RL (the demo's)")
    p.add_argument("--skip-on-policy", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--path", default="", help="run directory (default: a temp dir)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
