"""Arithmetic with a calculator: a reasoning-gym task, trained as a TRL-style tool environment.

    python examples/calculator_env.py              # the embedded SmolLM2 on a 2-core CPU
    python examples/calculator_env.py --cpu-smoke  # one tiny step

The environment is a plain class written as TRL's `environment_factory` docs write one:
`reset(**row)` poses a question of reasoning-gym's `chain_sum` dataset ("23 - 60 + 8 = ?"),
its public methods `calculate` and `answer` are the tools (schemas from their type hints and
docstrings, by transformers' `get_json_schema`, as TRL makes them), and `get_reward()` is
reasoning-gym's own `score_answer` of the answer given. `art.env.tool_rollout` runs it
unchanged. Every turn's call is forced (`tool_choice="required"`: a 135M model makes no
unforced call), so what the model learns is which call to make and with what: the base model
often answers before it calculates, or answers something other than what the calculator said.

Held-out accuracy (one answer to each of 128 questions never trained on, sampled at the
training temperature: the policy being trained, as it acts) is printed before and after
training with 95% intervals; `--eval-temperature 0` asks greedily instead. Each step trains on
groups whose rewards differ (dynamic sampling: `art.gather_signal_groups`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Any

import art_core as art
from art_core.env import tool_rollout

SYSTEM = ("Solve the arithmetic problem with the tools: first call calculate with the "
          "expression, then call answer with the number the calculator gave. For example, "
          "for 12 + 5 - 3 call calculate with \"12 + 5 - 3\"; it says 14; call answer with 14.")
PROMPT = [{"role": "user", "content": "Solve:"}]


@dataclass
class Config:
    base_model: str = art.DEFAULT_BASE_MODEL
    steps: int = 8  # ~2.5 min each here: with the evaluations, ~27 min on a 2-core CPU
    groups_per_step: int = 4
    rollouts_per_group: int = 8
    train_questions: int = 200
    # One sample per question, so the 95% interval's independence holds.
    eval_questions: int = 128
    max_turns: int = 2  # calculate, then answer
    max_tokens: int = 48
    learning_rate: float = 2e-3
    # 0.7, not 1.0: at 1.0 the 135M model's calls were mostly noise (3/80 -> 3/80 in 2 steps).
    temperature: float = 0.7
    # Greedy answers lag: the base model greedily answers before it calculates (62 of 64),
    # and that flips only once calculating first is the likelier choice.
    eval_temperature: float = 0.7
    seed: int = 0


CPU_SMOKE = Config(steps=1, groups_per_step=1, rollouts_per_group=3, train_questions=4,
                   eval_questions=2)


class Questions:
    """reasoning-gym's chain_sum (2-3 terms of 1-2 digits, + and -), without the questions whose
    answer is one of their own numbers ("2 - 0 - 0 = ?", 1 in 8): on those, answering the
    first number without calculating scores, and one step on such groups taught a run to
    answer without calculating (seed 1: sampled reward 0.17 at step 2, 0.01 after it)."""

    def __init__(self, size: int, seed: int) -> None:
        import reasoning_gym

        data = reasoning_gym.create_dataset("chain_sum", size=2 * size + 16, seed=seed,
                                            min_terms=2, max_terms=3, min_digits=1, max_digits=2)
        self.entries = [e for e in data
                        if e["answer"] not in re.findall(r"\d+", e["question"].split(":")[-1])]
        if len(self.entries) < size:
            raise ValueError(f"{len(self.entries)} usable questions of {len(data)}, asked {size}")
        self.entries = self.entries[:size]
        self.score_answer = data.score_answer  # reasoning-gym's own scoring

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.entries[index]


class CalculatorEnv:
    """One question per episode; the reward is reasoning-gym's score of the answer given."""

    def __init__(self, questions: Any) -> None:
        self.questions = questions

    def reset(self, index: int = 0, **_: Any) -> str:
        self.entry = self.questions[index]
        self.given: str | None = None
        return " " + self.entry["question"].split(":", 1)[-1].strip()

    def calculate(self, expression: str) -> str:
        """Evaluate an expression of integers joined by + and -.

        Args:
            expression: The expression, e.g. "23 - 60 + 8".
        """
        if not re.fullmatch(r"\s*-?\d+(\s*[-+]\s*-?\d+)*\s*=?\s*", expression):
            raise ValueError(f"not an expression of integers with + and -: {expression!r}")
        terms = re.findall(r"([-+]?)\s*(-?\d+)", expression.replace("=", ""))
        return str(sum(-int(n) if sign == "-" else int(n) for sign, n in terms))

    def answer(self, value: int) -> str:
        """Give the final answer.

        Args:
            value: The result.
        """
        self.given = str(value)
        return "Answer recorded."

    def get_reward(self) -> float:
        if self.given is None:
            return 0.0
        return float(self.questions.score_answer(answer=self.given, entry=self.entry))


async def rollout(model: art.TrainableModel, questions: Any, index: int, cfg: Config,
                  temperature: float = 1.0) -> art.Trajectory:
    return await tool_rollout(
        model, lambda: CalculatorEnv(questions), {"prompt": PROMPT, "index": index},
        system_prompt=SYSTEM, tool_choice="required", max_turns=cfg.max_turns,
        max_tokens=cfg.max_tokens, temperature=temperature)


async def evaluate(model: art.TrainableModel, questions: Any, cfg: Config) -> tuple[int, int]:
    """One answer to every held-out question, at `cfg.eval_temperature`: (solved, asked)."""
    groups = await art.gather_trajectory_groups(
        [[rollout(model, questions, i, cfg, temperature=cfg.eval_temperature)]
         for i in range(len(questions))],
        description="held-out")
    return sum(int(t.reward == 1.0) for g in groups for t in g), len(questions)


def interval(solved: int, asked: int) -> str:
    from art_core.observe.base import wilson

    lo, hi = wilson(solved, asked)
    return f"{solved}/{asked} [{lo:.0%}, {hi:.0%}]"


async def train(model: art.TrainableModel, cfg: Config) -> tuple[str, str]:
    """Evaluate, train `cfg.steps` steps, evaluate again; returns both evaluations."""
    train_set = Questions(cfg.train_questions, cfg.seed)
    held_out = Questions(cfg.eval_questions, cfg.seed + 10_000)
    before = interval(*await evaluate(model, held_out, cfg))
    print(f"held-out before: {before}")
    start = await model.get_step()
    for step in range(start, start + cfg.steps):
        drawn = await art.gather_signal_groups(
            lambda i: [rollout(model, train_set, i, cfg, cfg.temperature)
                       for _ in range(cfg.rollouts_per_group)],
            art.shuffled_passes(range(len(train_set)), cfg.seed, offset=step * cfg.groups_per_step),
            cfg.groups_per_step)
        rewards = drawn.sampled_rewards
        mean = sum(rewards) / max(1, len(rewards))
        if not drawn.groups:
            print(f"step {await model.get_step() + 1}: no group with signal in {drawn.drawn} "
                  "drawn; nothing trained")
            continue
        result = await model.train(drawn.groups,
                                   art.TrainConfig(learning_rate=cfg.learning_rate))
        print(f"step {result.step}: reward {mean:.2f} over {len(rewards)} rollouts, "
              f"{len(drawn.groups)} of {drawn.drawn} groups trained")
    after = interval(*await evaluate(model, held_out, cfg))
    print(f"held-out before: {before}\nheld-out after:  {after}")
    return before, after


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="one tiny step")
    parser.add_argument("--steps", type=int, help="training steps")
    parser.add_argument("--seed", type=int, help="the question order's seed")
    parser.add_argument("--temperature", type=float, help="of the training rollouts")
    parser.add_argument("--eval-temperature", type=float, help="of the held-out answers")
    parser.add_argument("--path", default=".art", help="where runs and checkpoints are stored")
    args = parser.parse_args()
    cfg = CPU_SMOKE if args.cpu_smoke else Config()
    given = {k: getattr(args, k) for k in ("steps", "seed", "temperature", "eval_temperature")}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in given.items() if v is not None})
    started = time.monotonic()
    async with art.LocalBackend(args.path) as backend:
        model = art.TrainableModel(name=f"calculator-{cfg.seed}", project="examples",
                                   base_model=cfg.base_model)
        await model.register(backend)
        await train(model, cfg)
    print(f"took {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    asyncio.run(main())
