"""AutoRL: train an agent from one paragraph, with no data and no reward code.

    python examples/autorl.py --cpu-smoke          # laptop: SmolLM2 is policy, writer and judge
    python examples/autorl.py --tools              # the same, with a Python function as a tool
    python examples/autorl.py --generator openai/gpt-4.1-mini --judge openai/o4-mini --steps 10

What happens (`art_mcp.autorl`): a generator model writes support emails for the task below
(validated, de-duplicated, split into train and held-out sets, saved), derives the policy's
system prompt and a RULER rubric from the description (printed and saved: edit and pass back),
then each step runs groups of answers, RULER ranks each group with that rubric and GRPO trains a
LoRA. The table at the end compares the held-out emails before and after, with the judge's
explanation for a few. The same from the command line:

    art autorl "Triage support emails ..." --steps 4 --tools examples/autorl.py:lookup_account

Run it again with the same --path to continue from the last step on the same scenarios.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

from art_core import TrainableModel, TrainConfig
from art_mcp import AgentConfig
from art_mcp.autorl import AutoRLResult, autorl

TASK = ("Triage a customer support email for a software company into one category: billing, "
        "bug or feature request. Start the answer with the category, then draft a short, polite "
        "reply to the customer that addresses their message.")

ACCOUNTS = {"ana@example.com": "plan Pro, paid until 2026-03-01, no open invoices",
            "li@example.com": "plan Free, one failed card payment on 2025-11-02"}


def lookup_account(email: str) -> str:
    """Look up a customer's account: plan and billing status.

    Args:
        email: The customer's email address.
    """
    return ACCOUNTS.get(email.strip().lower(), f"no account for {email}")


@dataclass
class Config:
    n_scenarios: int
    held_out: int
    steps: int
    groups_per_step: int
    rollouts_per_group: int
    eval_rollouts: int
    max_tokens: int
    learning_rate: float


DEFAULT = Config(n_scenarios=24, held_out=6, steps=4, groups_per_step=4, rollouts_per_group=4,
                 eval_rollouts=2, max_tokens=200, learning_rate=1e-3)
CPU_SMOKE = Config(n_scenarios=6, held_out=2, steps=1, groups_per_step=2, rollouts_per_group=2,
                   eval_rollouts=2, max_tokens=64, learning_rate=1e-3)


async def run(cfg: Config, *, path: str = ".art", tools: bool = False, model: Any = None,
              backend: Any = None, generator: Any = "embedded", judge: str = "embedded",
              **kwargs: Any) -> AutoRLResult:
    """One AutoRL run of `TASK` in setting `cfg` (`kwargs` go to `autorl`)."""
    return await autorl(
        TASK, model=model or TrainableModel(name="triage-agent", project="autorl"),
        backend=backend, path=path, generator=generator, judge=judge,
        tools=[lookup_account] if tools else (), n_scenarios=cfg.n_scenarios,
        held_out=cfg.held_out, steps=cfg.steps, groups_per_step=cfg.groups_per_step,
        rollouts_per_group=cfg.rollouts_per_group, eval_rollouts=cfg.eval_rollouts,
        agent=AgentConfig(max_tokens=cfg.max_tokens, max_turns=4),
        train_config=TrainConfig(learning_rate=cfg.learning_rate), **kwargs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="the smallest run (one step)")
    p.add_argument("--tools", action="store_true", help="offer lookup_account as a tool")
    p.add_argument("--generator", default="embedded", help="litellm model, or 'embedded'")
    p.add_argument("--judge", default="embedded", help="litellm model, or 'embedded'")
    p.add_argument("--steps", type=int, help="training steps (default: the setting's)")
    p.add_argument("--path", default=".art")
    a = p.parse_args()
    cfg = CPU_SMOKE if a.cpu_smoke else DEFAULT
    if a.steps is not None:
        cfg = dataclasses.replace(cfg, steps=a.steps)
    asyncio.run(run(cfg, path=a.path, tools=a.tools, generator=a.generator, judge=a.judge))


if __name__ == "__main__":
    main()
