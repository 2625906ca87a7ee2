"""Made-up rollouts for pipeline tests without an engine: each records the step it read from
the model as the step that sampled it, as the gateway's `art_step` would."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from art_core import TrainableModel, Trajectory

Hold = Callable[[str, int], Awaitable[None]]


def made_up_rollout(model: TrainableModel, tok: Any, hold: Hold | None = None
                    ) -> Callable[[str], Awaitable[Trajectory]]:
    """`rollout(scenario)`: one sampled turn at the model's current step, rewards 0 and 1 in
    turn (every group of two has variance). `hold(scenario, step)`, if given, is awaited
    after sampling: a slow tool or a straggler."""
    counter = itertools.count()

    async def rollout(scenario: str) -> Trajectory:
        step = await model.get_step()
        reward = float(next(counter) % 2)
        if hold is not None:
            await hold(scenario, step)
        await asyncio.sleep(0.01)
        prompt = tok.encode(f"Question about {scenario}?")
        completion = tok.encode(f" Answer {int(reward)}.")
        return Trajectory(
            messages=[{"role": "user", "content": f"Question about {scenario}?"},
                      {"role": "assistant", "content": f"Answer {int(reward)}."}],
            turns=[{"message_index": 1, "prompt_token_ids": prompt,
                    "completion_token_ids": completion,
                    "logprobs": [-1.0 - 0.1 * step] * len(completion), "step": step}],
            reward=reward)

    return rollout
