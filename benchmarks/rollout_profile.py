"""Where a rollout phase's time goes: the agent race's episodes (benchmarks/vs_trl_agent.py,
`ours`, its task in agent_task.py) through our gateway, profiled from vLLM's own counters.

For `--rounds` rounds, `--groups` x 8 episodes of the race's task run at once (no training in
between: the rollout phase alone). Before and after each round the engine's Prometheus
`/metrics` are read; the differences give, per model call (one request to vLLM):

- prefill: prompt tokens, the share served from vLLM's prefix cache (hit rate), prefill seconds;
- decode: generated tokens, decode seconds, time to first token;
- queue: seconds waiting to be scheduled;
- vLLM end to end, against the gateway's latency of the same calls (the ledger's `latency_s`):
  the difference is the gateway (splicing, strict-call grammar, ledger, HTTP);
- the episode's wall time against the calls' gateway latency: what remains is LangGraph, the
  recorder and the tool.
Printed with sampled tok/s over the round against the decode limit (`benchmarks/limits.py`) when
`--limit` is given. No bound is asserted: these are measurements.

    .venv/bin/python benchmarks/rollout_profile.py [--groups 1] [--rounds 2] [--task multi]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

# vLLM v1 metric names (sum/count pairs for histograms; counters end in _total)
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens")
HISTOGRAMS = ("e2e_request_latency_seconds", "time_to_first_token_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_queue_time_seconds")
LINE = re.compile(r"^vllm:([a-z0-9_]+?)(_total|_sum|_count)?(\{[^}]*\})?\s+([0-9.eE+-]+)$")


def read_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus text as {name[_sum|_count]: value}, summed over label sets."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = LINE.match(line.strip())
        if not m:
            continue
        name, suffix, _, value = m.groups()
        key = name + ("" if suffix in (None, "_total") else suffix)
        out[key] = out.get(key, 0.0) + float(value)
    return out


def profile(before: dict[str, float], after: dict[str, float], calls: int) -> dict[str, float]:
    """Per-call figures from two readings of the counters (`calls`: requests in between)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    n = max(1, calls)
    out = {"calls": calls,
           "prompt tok/call": d.get("prompt_tokens", 0.0) / n,
           "gen tok/call": d.get("generation_tokens", 0.0) / n,
           "prefix hit rate": (d.get("prefix_cache_hits", 0.0) / d["prefix_cache_queries"]
                               if d.get("prefix_cache_queries") else float("nan"))}
    for h in HISTOGRAMS:
        count = d.get(h + "_count", 0.0)
        out[h.replace("_seconds", " s")] = d.get(h + "_sum", 0.0) / count if count else float("nan")
    return out


async def run(args: argparse.Namespace) -> list[dict[str, float]]:
    import agent_task as race
    import vs_trl

    from art_core import LocalBackend, TrainableModel
    from art_langgraph import demo
    from art_langgraph.chat_model import init_chat_model
    from art_langgraph.messages import to_openai_message
    from art_langgraph.recorder import TrajectoryRecorder

    rounds = []
    with tempfile.TemporaryDirectory() as root:
        async with LocalBackend(root) as backend:
            model = TrainableModel(name="agent", project="bench",
                                   base_model=vs_trl.model_path("smollm2"))
            await model.register(backend)
            (engine,) = backend.gateway.engines.values()
            graph = race.build_agent(init_chat_model(model, max_tokens=args.max_tokens,
                                                     temperature=0.7, top_p=1.0),
                                     race.LOOKUPS[args.task])

            async def rollout(task: Any) -> tuple[Any, float]:
                def reward(state: dict[str, Any]) -> float:
                    turns = [to_openai_message(m) for m in demo.this_question(state["messages"])]
                    return race.score(task, *race.episode(turns)[:2])

                t0 = time.perf_counter()
                recorder = TrajectoryRecorder(reward=reward)
                await graph.ainvoke({"messages": demo.prompt(task)},
                                    config={"callbacks": [recorder]})
                return await recorder.afinish(), time.perf_counter() - t0

            async with httpx.AsyncClient(timeout=30) as http:
                for r in range(args.rounds):
                    tasks = race.step_tasks(args.task, r, args.groups)
                    before = read_metrics((await http.get(f"{engine.base_url}/metrics")).text)
                    t0 = time.perf_counter()
                    done = await asyncio.gather(*[rollout(t) for t in tasks
                                                  for _ in range(vs_trl.GROUP_SIZE)])
                    wall = time.perf_counter() - t0
                    after = read_metrics((await http.get(f"{engine.base_url}/metrics")).text)
                    turns = [turn for traj, _ in done for turn in traj.turns]
                    row = profile(before, after, len(turns))
                    gateway = statistics.mean(t.latency_s or 0.0 for t in turns)
                    row.update({
                        "round s": wall, "episode s": statistics.mean(s for _, s in done),
                        "gateway s/call": gateway,
                        "gateway - vLLM s/call": gateway - row["e2e_request_latency s"],
                        "episode - calls s": statistics.mean(
                            s - sum(t.latency_s or 0.0 for t in traj.turns) for traj, s in done),
                        "sampled tok/s": sum(len(t.completion_token_ids) for t in turns) / wall,
                    })
                    rounds.append(row)
    return rounds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=1, help="groups of 8 episodes per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--task", choices=("multi", "single"), default="multi")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--limit", type=float, default=None,
                   help="the decode limit in tok/s (benchmarks/limits.py) to print a share of")
    args = p.parse_args(argv)
    rows = asyncio.run(run(args))
    for k in rows[0]:
        values = [row[k] for row in rows]
        print(f"{k:24s} " + "  ".join(f"{v:9.3f}" for v in values))
    if args.limit:
        share = statistics.median(row["sampled tok/s"] for row in rows) / args.limit
        print(f"sampled tok/s = {share:.0%} of the decode limit ({args.limit:g} tok/s)")


if __name__ == "__main__":
    main()
