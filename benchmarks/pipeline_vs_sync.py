"""Pipelined against synchronous RL on the same agent, the same scenarios, the same steps.

The agent is the demo's (art_langgraph/demo.py): a LangGraph graph, model -> ToolNode -> model,
answering questions about made-up countries with `lookup_country`, two worked examples in the
prompt, recorded by `TrajectoryRecorder`. `--task single`: the demo's questions (one lookup, an
answer); `--task multi`: benchmarks/vs_trl_agent.py's two-country questions (two lookups, an
answer; its reward). Here the tool waits like a real service: each call sleeps a random
0.2-3.0 s (uniform, seeded; `--delay LO HI`) before it answers, as a web API or a database
would; `--delays none` runs the same tool without the wait.

- sync: each step gathers `--groups-per-step` questions x `--rollouts-per-group` episodes,
  waits for the slowest, then trains one GRPO step (art_core.loop.train_loop's body).
- pipelined: `art_core.PipelineTrainer` with the same groups per step, rollouts per group and
  training settings; groups keep running while a step trains, `--max-steps-off-policy` bounds
  staleness (default 1), `--mode` picks the device mode (default auto: collocated here).

Each (system, delay) runs in a process of its own with a fresh model and its own engine
(benchmarks/workers.py), one after the other; engine start and the evaluations are not counted
in the wall time. Before and after training each evaluates the held-out questions (8 countries
never trained on x 3 fields x `--eval-samples` episodes, the tool without its wait).

Printed per run: training wall time, seconds per step (median, min-max), trained groups per
minute, held-out success before and after with 95% intervals, staleness (mean and max steps
off policy over the trained turns, share of turns from an older adapter, groups dropped as
stale / running groups cancelled because they could only finish stale). Last line: `speedup: X` = sync wall time / pipelined wall time with the waiting tool.

    .venv/bin/python benchmarks/pipeline_vs_sync.py [--steps 4] [--groups-per-step 6]
        [--rollouts-per-group 4] [--systems sync pipelined] [--delays slow none]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.workers import RESULT_TAG, TreeRSS, WorkerResult, run_subprocess  # noqa: E402

SYSTEMS = ("sync", "pipelined")
DELAYS = ("slow", "none")


def slow_tool(lo: float, hi: float, seed: int) -> Any:
    """The demo's `lookup_country`, same name and schema, answering after a random wait."""
    from langchain_core.tools import StructuredTool

    from art_langgraph.demo import lookup_country

    rng = random.Random(seed)

    async def lookup(country: str) -> str:
        await asyncio.sleep(rng.uniform(lo, hi))
        return lookup_country.invoke({"country": country})

    return StructuredTool.from_function(coroutine=lookup, name=lookup_country.name,
                                        description=lookup_country.description,
                                        args_schema=lookup_country.args_schema)


def agent(task: str, llm: Any, tool: Any) -> tuple[Any, list[Any], list[Any]]:
    """(episode function, training questions, held-out questions) of `--task`."""
    from art_langgraph import demo

    if task == "single":
        graph = demo.build_agent(llm, tool)
        return (lambda q: demo.episode(graph, q), demo.questions(demo.TRAIN_COUNTRIES),
                demo.questions(demo.HELD_OUT_COUNTRIES))
    from art_langgraph.messages import to_openai_message
    from art_langgraph.recorder import TrajectoryRecorder
    from benchmarks import agent_task as race

    graph = race.build_agent(llm, race.LOOKUPS["multi"], tool)

    async def episode(q: Any) -> Any:
        parts: dict[str, Any] = {}

        def reward(state: dict[str, Any]) -> float:
            turns = [to_openai_message(m) for m in demo.this_question(state["messages"])]
            looked_up, answer, calls = race.episode(turns)
            parts.update(reward=race.score(q, looked_up, answer), calls=calls)
            return parts["reward"]

        recorder = TrajectoryRecorder(reward=reward)
        await graph.ainvoke({"messages": demo.prompt(q)}, config={"callbacks": [recorder]})
        traj = await recorder.afinish()
        traj.metrics.update(success=parts["reward"] >= 0.8, tool_calls=parts["calls"] - 1)
        return traj

    return (episode, race.all_tasks("multi"),
            race.all_tasks("multi", demo.HELD_OUT_COUNTRIES))


async def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One (system, delay) run in this process; returns its measurements."""
    from art_core import LocalBackend, PipelineTrainer, TrainableModel, TrainConfig
    from art_core.gather import gather_trajectory_groups
    from art_core.loop import EvalStats, evaluate
    from art_langgraph import demo
    from art_langgraph.chat_model import init_chat_model

    demo._quiet()
    run_dir = Path(tempfile.mkdtemp(prefix=f"pipe-{args.system}-{args.delay_mode}-"))
    config = TrainConfig(learning_rate=args.learning_rate)
    with TreeRSS() as rss:
        async with LocalBackend(run_dir) as backend:
            model = TrainableModel(name="agent", project="bench")
            await model.register(backend)
            llm = init_chat_model(model, max_tokens=demo.MAX_TOKENS, temperature=demo.TEMPERATURE)
            tool = slow_tool(*args.delay, seed=args.seed) if args.delay_mode == "slow" \
                else demo.lookup_country
            episode, train_q, _ = agent(args.task, llm, tool)
            eval_episode, _, held = agent(args.task, llm, demo.lookup_country)

            async def held_out(step: int) -> EvalStats:
                return await evaluate(eval_episode, held, step, rollouts=args.eval_samples,
                                      description=f"eval {step}")

            before = await held_out(0)
            rows: list[dict[str, Any]] = []
            t0 = time.perf_counter()
            if args.system == "sync":
                last = t0
                for i in range(args.steps):
                    picked = random.Random(f"{args.seed}-{i}").sample(train_q,
                                                                      args.groups_per_step)
                    groups = await gather_trajectory_groups(
                        ([episode(q) for _ in range(args.rollouts_per_group)]
                         for q in picked), max_exceptions=0.5, show_progress=False)
                    result = await model.train(groups, config)
                    now = time.perf_counter()
                    m = result.metrics
                    rows.append({"step": result.step, "seconds": now - last,
                                 "groups": len(groups), "dropped_stale": 0,
                                 "train_seconds": m.get("seconds"),
                                 **{k: m.get(k) for k in ("off_policy_steps_mean",
                                                          "off_policy_steps_max",
                                                          "frac_turns_off_policy",
                                                          "reward_mean")}})
                    last = now
                    print(f"sync step {result.step}: {rows[-1]['seconds']:.1f} s", flush=True)
            else:
                trainer = PipelineTrainer(
                    model, episode, train_q,
                    run_dir=run_dir / "pipeline", groups_per_step=args.groups_per_step,
                    rollouts_per_group=args.rollouts_per_group,
                    max_steps_off_policy=args.max_steps_off_policy,
                    max_groups_in_flight=args.in_flight, train_config=config,
                    mode=args.mode, seed=args.seed, show_progress=False)
                rows = (await trainer.run(args.steps)).steps
            wall = time.perf_counter() - t0
            after = await held_out(await model.get_step())
    return {"system": args.system, "delay": args.delay_mode, "wall_s": wall, "steps": rows,
            "before": [before.rate("success").k, before.rate("success").n],
            "after": [after.rate("success").k, after.rate("success").n],
            "peak_rss_gib": rss.gib}


def worker_main(args: argparse.Namespace) -> None:
    try:
        result = asyncio.run(run_one(args))
    except Exception as e:  # reported, not raised: the parent prints every run
        result = {"system": args.system, "delay": args.delay_mode, "error": repr(e)[:300]}
    print(RESULT_TAG + json.dumps(result), flush=True)


def rate(kn: list[int]) -> str:
    from art_core.observe.base import wilson

    k, n = kn
    lo, hi = wilson(k, n)
    return f"{k}/{n} {100 * k / n:.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]"


def report(results: list[dict[str, Any]]) -> str:
    head = (f"{'system':<10} {'tool':<5} {'wall s':>7} {'s/step (min-max)':>22} {'train s':>7} "
            f"{'groups/min':>10} {'held-out before':>19} {'held-out after':>19} "
            f"{'off-pol mean/max':>16} {'old turns':>9} {'stale d/c':>9} {'RSS GiB':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['system']:<10} {r['delay']:<5} failed: {r['error']}")
            continue
        secs = [s["seconds"] for s in r["steps"]]
        groups = sum(s["groups"] for s in r["steps"])
        mean = statistics.mean(s.get("off_policy_steps_mean") or 0.0 for s in r["steps"])
        top = max(s.get("off_policy_steps_max") or 0.0 for s in r["steps"])
        old = statistics.mean(s.get("frac_turns_off_policy") or 0.0 for s in r["steps"])
        stale = (f"{sum(s.get('dropped_stale', 0) for s in r['steps'])}/"
                 f"{sum(s.get('cancelled_stale', 0) for s in r['steps'])}")
        lines.append(
            f"{r['system']:<10} {r['delay']:<5} {r['wall_s']:7.1f} "
            f"{f'{statistics.median(secs):.1f} ({min(secs):.1f}-{max(secs):.1f})':>22} "
            f"{statistics.median(s.get('train_seconds') or 0.0 for s in r['steps']):7.1f} "
            f"{60 * groups / r['wall_s']:10.1f} {rate(r['before']):>19} {rate(r['after']):>19} "
            f"{f'{mean:.2f} / {top:.0f}':>16} {old:9.2f} "
            f"{stale:>9} {r['peak_rss_gib']:7.2f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=("single", "multi"), default="single")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=6)
    p.add_argument("--rollouts-per-group", type=int, default=4)
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--delay", type=float, nargs=2, default=(0.2, 3.0), metavar=("LO", "HI"))
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--delays", nargs="+", choices=DELAYS, default=list(DELAYS))
    p.add_argument("--max-steps-off-policy", type=int, default=1)
    p.add_argument("--in-flight", type=int, default=None,
                   help="PipelineTrainer.max_groups_in_flight (default: 2 x groups per step)")
    p.add_argument("--mode", default="auto", choices=("auto", "collocated", "dedicated"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--worker", nargs=2, metavar=("SYSTEM", "DELAY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.system, args.delay_mode = args.worker
        worker_main(args)
        return
    args.threads = 2  # the machine's; each run splits it between vLLM and the trainer itself
    results = []
    for delay in args.delays:
        for system in args.systems:
            cmd = [sys.executable, __file__, "--worker", system, delay,
                   *(a for a in sys.argv[1:])]
            failed = WorkerResult(system=system, model="smollm2", max_tokens=0)
            result, seconds = run_subprocess(cmd, args, failed)
            if "error" in result and result.get("error"):
                result = {"system": system, "delay": delay, "error": result["error"]}
            results.append(result)
            print(f"[{system}, tool {delay}] done in {seconds:.0f} s", flush=True)
    print()
    print(report(results))
    by = {(r["system"], r["delay"]): r for r in results if "error" not in r}
    for delay in args.delays:
        if ("sync", delay) in by and ("pipelined", delay) in by:
            x = by[("sync", delay)]["wall_s"] / by[("pipelined", delay)]["wall_s"]
            print(f"sync / pipelined wall time, tool {delay}: {x:.2f}")
    if ("sync", "slow") in by and ("pipelined", "slow") in by:
        print(f"speedup: {by[('sync', 'slow')]['wall_s'] / by[('pipelined', 'slow')]['wall_s']:.2f}")


if __name__ == "__main__":
    main()
