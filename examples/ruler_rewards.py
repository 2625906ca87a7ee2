"""RULER instead of a reward function: an LLM judge ranks each group of attempts, GRPO learns
from the ranking.

    python examples/ruler_rewards.py --judge openai/o4-mini   # GPU policy, hosted judge
    python examples/ruler_rewards.py --cpu-smoke              # laptop: SmolLM2 judges itself

The task (answer customer emails for a bike shop) has no checkable answer, which is where RULER
helps: `ruler.hook(judge)` passed as `after_each` to `gather_trajectory_groups` scores every
group as soon as its rollouts finish, so judging overlaps with the next rollouts. The judge is
any litellm model string; in the smoke setting it is the embedded base model served by our own
gateway (`openai/<base model>` with `api_base` = the gateway), so nothing leaves the machine.
A group the judge cannot score is dropped (`swallow_exceptions=True`), not trained on.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import art_core as art
import ruler

SYSTEM = "You answer customer emails for a small bike shop. Be helpful, correct and brief."
EMAILS = [
    "My chain keeps slipping when I pedal hard. What should I do?",
    "Do you repair electric bikes, and how long does a service take?",
    "I bought a helmet last week and it is too small. Can I exchange it?",
    "What tyre pressure should I use for a city bike?",
    "Are you open on Sundays?",
    "My brakes squeal when it rains. Is that dangerous?",
    "Can you recommend a bike for a 7 year old?",
    "How often should I oil my chain?",
]


@dataclass
class Config:
    base_model: str
    judge: str | None  # None: the base model itself, through the gateway
    steps: int
    groups_per_step: int
    rollouts_per_group: int
    max_tokens: int
    learning_rate: float


GPU = Config("Qwen/Qwen2.5-3B-Instruct", judge="openai/o4-mini", steps=30, groups_per_step=4,
             rollouts_per_group=6, max_tokens=200, learning_rate=1e-5)
CPU_SMOKE = Config(art.DEFAULT_BASE_MODEL, judge=None, steps=2, groups_per_step=1,
                   rollouts_per_group=3, max_tokens=24, learning_rate=1e-3)


async def rollout(model: art.TrainableModel, email: str, cfg: Config) -> art.Trajectory:
    traj = art.Trajectory(messages=[{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": email}])
    response = await model.openai_client().chat.completions.create(
        model=model.name, messages=traj.messages, max_tokens=cfg.max_tokens, temperature=1.0)
    traj.add_completion(response)  # no reward here: RULER sets it
    return traj


def judge_hook(model: art.TrainableModel, cfg: Config
               ) -> Callable[[art.TrajectoryGroup], Awaitable[art.TrajectoryGroup | None]]:
    """RULER as an `after_each` hook. Without a named judge, the frozen base model judges,
    reached like any OpenAI-compatible server: litellm's "openai/<name>" plus the gateway URL."""
    if cfg.judge is None:
        return ruler.hook(f"openai/{model.base_model}", api_base=model.base_url, api_key="none",
                          swallow_exceptions=True, timeout=300)
    return ruler.hook(cfg.judge, swallow_exceptions=True)


async def train(model: art.TrainableModel, cfg: Config) -> list[float]:
    """The RL loop; returns the mean RULER score of each step that had a scored group."""
    means = []
    start = await model.get_step()
    for step in range(start, start + cfg.steps):
        batch = [EMAILS[(step * cfg.groups_per_step + g) % len(EMAILS)]
                 for g in range(cfg.groups_per_step)]
        groups = await art.gather_trajectory_groups(
            ([rollout(model, e, cfg) for _ in range(cfg.rollouts_per_group)] for e in batch),
            after_each=judge_hook(model, cfg))
        if not groups:
            print(f"step {step}: the judge scored no group; nothing to train on")
            continue
        result = await model.train(groups, art.TrainConfig(learning_rate=cfg.learning_rate))
        means.append(result.metrics["reward_mean"])
        print(f"step {result.step}: mean RULER score {means[-1]:.3f}")
    return means


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny run on the embedded model")
    parser.add_argument("--judge", help="litellm model string of the judge (GPU setting)")
    parser.add_argument("--path", default=".art", help="where runs and checkpoints are stored")
    args = parser.parse_args()
    cfg = CPU_SMOKE if args.cpu_smoke else GPU
    if args.judge:
        cfg.judge = args.judge
    async with art.LocalBackend(args.path) as backend:
        model = art.TrainableModel(name="ruler-smoke" if args.cpu_smoke else "ruler-agent",
                                   project="examples", base_model=cfg.base_model)
        await model.register(backend)
        await train(model, cfg)


if __name__ == "__main__":
    asyncio.run(main())
