"""What a multi-turn agent costs to train, with the gateway's token-in splicing on and off.

Two agents, both the real user path through the gateway on the embedded SmolLM2-135M:

- mcp: `art_mcp.run_agent` on the example inventory server (examples/mcp_rl.py's setting: two
  worked examples, strict tool calls, up to 4 model calls);
- langgraph: the demo's agent (art_langgraph/demo.py: model -> ToolNode -> model, worked
  examples, one forced lookup then an answer), recorded by its TrajectoryRecorder.

For each mode (splicing on, then off: `EngineConfig.splice_turns`, one engine at a time, each
mode in a fresh LocalBackend and run directory), each agent runs `--groups` groups of
`--rollouts` rollouts and `--steps` GRPO steps on them. Rewards are the rollout's index in its
group (every group has variance, so every trajectory trains in both modes: this measures the
token cost of a step, not learning). Printed per agent and mode: sequences_per_history,
redundant_token_ratio (tokens in the step's sequences / unique tokens), tokens and sampled
(trained) tokens per step, train seconds per step (median), the split reasons; then
`redundant_token_ratio: X` last, the largest over the agents with splicing on (goal: 1.00).

    .venv/bin/python benchmarks/multiturn_tokens.py [--groups 2 --rollouts 4 --steps 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from art_core import (  # noqa: E402
    EngineConfig,
    LocalBackend,
    ModelConfig,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
)

TASKS = [json.loads(line)["task"] for line in
         (ROOT / "examples/data/inventory_scenarios.jsonl").read_text().splitlines()[:8]]


async def mcp_rollouts(model: TrainableModel, workdir: Path, group: int, n: int
                       ) -> list[Trajectory]:
    from art_mcp import AgentConfig, ServerSpec, WorkedExample, connect, run_agent

    spec = ServerSpec(command=[sys.executable, str(ROOT / "examples/mcp_server_inventory.py")])
    config = AgentConfig(max_turns=4, examples=WorkedExample.load(
        ROOT / "examples/data/inventory_examples.json"))

    async def one(i: int) -> Trajectory:
        async with connect(spec, workdir=workdir / f"{group}-{i}") as session:
            return await run_agent(model, session, TASKS[group % len(TASKS)], config=config)

    return list(await asyncio.gather(*[one(i) for i in range(n)]))


async def langgraph_rollouts(model: TrainableModel, group: int, n: int) -> list[Trajectory]:
    from art_langgraph import demo, init_chat_model

    graph = demo.build_agent(init_chat_model(model, max_tokens=demo.MAX_TOKENS,
                                             temperature=demo.TEMPERATURE))
    questions = demo.questions(demo.TRAIN_COUNTRIES)
    q = questions[group % len(questions)]
    return list(await asyncio.gather(*[demo.episode(graph, q) for _ in range(n)]))


async def run_mode(splice: bool, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="art-multiturn-") as tmp:
        async with LocalBackend(Path(tmp) / "runs") as backend:
            for agent in ("mcp", "langgraph"):
                model = TrainableModel(name=f"mt-{agent}", project="multiturn", config=ModelConfig(
                    engine=EngineConfig(splice_turns=splice)))
                t0 = time.perf_counter()
                await model.register(backend)
                print(f"  [{'on' if splice else 'off'}] {agent}: registered in "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
                steps = []
                for step in range(args.steps):
                    t0 = time.perf_counter()
                    groups = []
                    for g in range(args.groups):
                        k = step * args.groups + g
                        trajs = (await mcp_rollouts(model, Path(tmp) / "mcp", k, args.rollouts)
                                 if agent == "mcp" else
                                 await langgraph_rollouts(model, k, args.rollouts))
                        for i, t in enumerate(trajs):
                            t.reward = float(i)  # variance in every group: all of them train
                        groups.append(TrajectoryGroup(trajectories=trajs))
                    rollout_s = time.perf_counter() - t0
                    m = (await model.train(groups, TrainConfig(learning_rate=1e-4))).metrics
                    calls = [len(t.turns) for g in groups for t in g]
                    steps.append({**m, "rollout_s": rollout_s,
                                  "calls_per_episode": statistics.mean(calls)})
                    print(f"  [{'on' if splice else 'off'}] {agent} step {step}: "
                          f"{m['sequences_per_history']:.2f} seq/history, redundant "
                          f"{m['redundant_token_ratio']:.2f}, {m['tokens']:.0f} tokens "
                          f"({m['trained_tokens']:.0f} sampled), {m['seconds']:.1f} s train, "
                          f"{rollout_s:.1f} s rollouts", flush=True)
                results[agent] = summarize(steps)
            await backend.close()
    return results


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(float(s.get(key, 0.0)) for s in steps)

    splits: dict[str, float] = {}
    for s in steps:
        for k, v in s.items():
            if k.startswith("splits_"):
                splits[k.removeprefix("splits_")] = splits.get(k.removeprefix("splits_"), 0) + v
    return {"sequences_per_history": med("sequences_per_history"),
            "redundant_token_ratio": max(float(s["redundant_token_ratio"]) for s in steps),
            "tokens": med("tokens"), "sampled": med("trained_tokens"),
            "train_s": med("seconds"), "train_s_range": (min(s["seconds"] for s in steps),
                                                         max(s["seconds"] for s in steps)),
            "rollout_s": med("rollout_s"), "calls": med("calls_per_episode"), "splits": splits}


def cpu_flags() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    bf16 = "amx_bf16" in flags or "avx512_bf16" in flags
    return f"{platform.machine()}, {'native bf16' if bf16 else 'no native bf16 (AVX2-class)'}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    print(f"machine: {cpu_flags()}; {args.groups} groups x {args.rollouts} rollouts, "
          f"{args.steps} steps per agent and mode", flush=True)
    modes = {}
    for splice in (True, False):
        modes[splice] = asyncio.run(run_mode(splice, args))
    print(f"\n{'agent':10} {'splicing':8} {'calls':>5} {'seq/hist':>8} {'redundant':>9} "
          f"{'tokens':>7} {'sampled':>7} {'train s':>8} {'range':>11} {'rollout s':>9}  splits")
    for agent in ("mcp", "langgraph"):
        for splice in (True, False):
            r = modes[splice][agent]
            lo, hi = r["train_s_range"]
            print(f"{agent:10} {'on' if splice else 'off':8} {r['calls']:5.1f} "
                  f"{r['sequences_per_history']:8.2f} {r['redundant_token_ratio']:9.2f} "
                  f"{r['tokens']:7.0f} {r['sampled']:7.0f} {r['train_s']:8.1f} "
                  f"{lo:5.1f}-{hi:<5.1f} {r['rollout_s']:9.1f}  "
                  f"{json.dumps(r['splits']) if r['splits'] else '-'}")
    worst = max(modes[True][a]["redundant_token_ratio"] for a in ("mcp", "langgraph"))
    print(f"redundant_token_ratio: {worst:.2f}")


if __name__ == "__main__":
    main()
