"""The LangGraph recorder's cost: the same rollouts of a tool-calling agent with and without it.

Rollouts alternate (plain, recorded, recorded, plain, ...) so drift in machine load hits both
alike, and decoding is greedy so both do the same work. Two measures:

- direct: time spent inside the recorder (its callbacks, timed by a subclass, plus `afinish()`,
  which converts the messages and reads the ledger in one batch), per model call and as a share
  of the recorded rollout's wall time;
- end to end: mean rollout time recorded minus plain (noisier: it includes the engine's jitter).

The last line is `overhead: X% of rollout time`.

    .venv/bin/python benchmarks/recorder_overhead.py [--rollouts 16] [--tiny]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from art_core import LocalBackend, TrainableModel  # noqa: E402
from art_core.config import EngineConfig, ModelConfig  # noqa: E402
from art_langgraph import TrajectoryRecorder, init_chat_model  # noqa: E402


class TimedRecorder(TrajectoryRecorder):
    """The recorder, with the time spent in each callback added up."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = 0.0

    def _timed(name: str):  # noqa: N805 - a decorator factory used in the class body
        def method(self: TimedRecorder, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return getattr(TrajectoryRecorder, name)(self, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return method

    on_chat_model_start = _timed("on_chat_model_start")
    on_llm_end = _timed("on_llm_end")
    on_tool_end = _timed("on_tool_end")
    on_chain_end = _timed("on_chain_end")


async def main(args: argparse.Namespace) -> None:
    from tests.test_langgraph import tool_agent  # the agent the tests use: model -> tools -> model

    with tempfile.TemporaryDirectory() as root:
        base: dict[str, Any] = {}
        if args.tiny:
            from art_core.testing.tiny import build_tiny_model

            base = {"base_model": str(build_tiny_model(f"{root}/tiny", "llama"))}
        backend = LocalBackend(f"{root}/run")
        model = TrainableModel(name="overhead", project="bench", **base,
                               config=ModelConfig(engine=EngineConfig(max_model_len=2048)))
        await model.register(backend)
        graph = tool_agent(init_chat_model(model, max_tokens=args.max_tokens, temperature=0.0))
        inputs = {"messages": [("system", "Use the tools."),
                               ("user", "What is the capital of France?")]}
        await graph.ainvoke(inputs)  # warm-up

        plain: list[float] = []
        recorded: list[float] = []
        inside: list[float] = []
        calls = 0
        for i in range(args.rollouts):
            for with_recorder in ((False, True) if i % 2 == 0 else (True, False)):
                t0 = time.perf_counter()
                if with_recorder:
                    rec = TimedRecorder(model)
                    await graph.ainvoke(inputs, config={"callbacks": [rec]})
                    t1 = time.perf_counter()
                    traj = await rec.afinish()
                    elapsed = time.perf_counter() - t0
                    inside.append(rec.seconds + time.perf_counter() - t1)
                    recorded.append(elapsed)
                    calls += sum(len(h.turns) for h in traj.histories())
                else:
                    await graph.ainvoke(inputs)
                    plain.append(time.perf_counter() - t0)
        await backend.close()

    per_call_ms = 1000 * sum(inside) / calls
    share = sum(inside) / sum(recorded)
    e2e = statistics.mean(recorded) - statistics.mean(plain)
    print(f"rollouts: {args.rollouts} plain + {args.rollouts} recorded, "
          f"{calls / args.rollouts:.1f} model calls each, greedy, max_tokens={args.max_tokens}")
    print(f"rollout wall time: plain {statistics.mean(plain):.3f} s "
          f"(median {statistics.median(plain):.3f}), recorded {statistics.mean(recorded):.3f} s "
          f"(median {statistics.median(recorded):.3f})")
    print(f"inside the recorder: {per_call_ms:.2f} ms per model call "
          f"({1000 * statistics.mean(inside):.1f} ms per rollout, callbacks + ledger batch)")
    print(f"end to end (recorded - plain mean): {1000 * e2e:+.1f} ms per rollout")
    print(f"overhead: {100 * share:.2f}% of rollout time")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="tiny random model (fast start; the "
                   "agent's calls are then still enforced by the gateway)")
    asyncio.run(main(p.parse_args()))
