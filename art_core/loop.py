"""Evaluate, train, evaluate: the loop the demos, MCP·RL and AutoRL all run.

1. `evaluate` the held-out scenarios at the current step: rollouts that are never trained on,
   summarised as `EvalStats` (rates with 95% Wilson intervals, means of trajectory metrics).
   `train_loop` caches each step's stats in `<run_dir>/eval.jsonl` and its groups in
   `<run_dir>/eval-<step>.jsonl`, so a resumed run does not pay for an evaluation twice.
2. Each step: `groups_per_step` groups *with signal* (dynamic sampling, art_core/sampling.py:
   groups whose rewards are all equal are set aside and more scenarios drawn, up to
   `oversample` x groups_per_step groups) of `rollouts_per_group` rollouts each, scored as each
   group completes (`after_each`, e.g. RULER), then one GRPO step (`model.train`). Scenarios
   come from a stream of shuffled passes over `train` seeded by the step, so a resumed run
   draws what an uninterrupted one would have. What sampling cost is in the step's metrics
   (`sampling_*`) and in `<run_dir>/sampling.jsonl`. `oversample=None` turns it off: the first
   groups_per_step scenarios are trained whatever their rewards. `stratify(scenario)` (e.g. a
   benchmark's category) shares each step's groups out over the strata, each drawn from its own
   stream (sampling.py, step 5), `stratum_weights` (e.g. {"parallel": 2}) giving a stratum
   more of each step than the others; the odd places go round with the step.
3. `evaluate` again (and after every `eval_every` steps, for a curve).

A rollout here is a plain `async (scenario) -> Trajectory`: the caller binds model and tools.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Awaitable, Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from art_core.gather import gather_trajectory_groups
from art_core.model import TrainableModel, TrainResult
from art_core.observe.base import wilson
from art_core.sampling import (
    DEFAULT_BUDGET,
    gather_signal_groups,
    shares,
    shuffled_passes,
    signal_rule,
    weigh,
)
from art_core.storage import append_jsonl, read_jsonl
from art_core.trajectory import Trajectory, TrajectoryGroup, write_groups_jsonl

RolloutFn = Callable[[Any], Awaitable[Trajectory]]
"""One rollout of one scenario, with the model and tools already bound."""

SOLVED = 1.0 - 1e-9
"""A trajectory with a reward at least this high counts as solved."""


@dataclass
class Rate:
    """k successes out of n rollouts, with its 95% Wilson interval."""

    k: int
    n: int

    @property
    def value(self) -> float:
        return self.k / self.n if self.n else 0.0

    @property
    def ci(self) -> tuple[float, float]:
        return wilson(self.k, self.n)

    def text(self, percent: bool = False) -> str:
        lo, hi = self.ci
        if percent:
            return f"{self.k}/{self.n} {100 * self.value:.1f}% [{100 * lo:.0f}%, {100 * hi:.0f}%]"
        return f"{self.value:.2f} [{lo:.2f}, {hi:.2f}]"


@dataclass
class EvalStats:
    """Held-out results at one step: `rates` of boolean outcomes (`solved`: reward = 1, and
    every boolean trajectory metric, e.g. `success`, `completed`) and `means` of the numeric
    trajectory metrics (e.g. `tool_calls`, `turns`)."""

    step: int
    scenarios: int
    rollouts: int
    failed: int
    reward: float
    rates: dict[str, Rate] = field(default_factory=dict)
    means: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_groups(cls, step: int, groups: Sequence[TrajectoryGroup]) -> EvalStats:
        trajs = [t for g in groups for t in g]
        n = len(trajs)
        rates = {"solved": Rate(sum(t.reward >= SOLVED for t in trajs), n)}
        values: dict[str, list[float]] = {}
        for t in trajs:
            for k, v in t.metrics.items():
                values.setdefault(k, []).append(v)
        means = {}
        for k, vs in values.items():
            if all(isinstance(v, bool) for v in vs):
                rates[k] = Rate(sum(vs), n)  # absent counts as False
            else:
                means[k] = sum(float(v) for v in vs) / n
        return cls(step=step, scenarios=len(groups), rollouts=n,
                   failed=sum(len(g.exceptions) for g in groups),
                   reward=sum(t.reward for t in trajs) / n if n else 0.0,
                   rates=rates, means=means)

    def rate(self, name: str) -> Rate:
        """The rate `name`, or 0 of n when no trajectory reported it."""
        return self.rates.get(name, Rate(0, self.rollouts))

    def row(self) -> dict[str, Any]:
        """As a JSON row of `eval.jsonl`."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> EvalStats:
        row = dict(row)
        row["rates"] = {k: Rate(**v) for k, v in (row.get("rates") or {}).items()}
        return cls(**row)


async def evaluate(rollout: RolloutFn, scenarios: Sequence[Any], step: int, *,
                   rollouts: int = 2, after_each: Any = None, max_concurrency: int | None = None,
                   save_to: Path | None = None, description: str | None = None) -> EvalStats:
    """Held-out rollouts at the current step (not trained on); failures are counted, not
    fatal. `save_to`: a JSONL file for the groups, to read what the agent did."""
    groups = await gather_trajectory_groups(
        ([rollout(s) for _ in range(rollouts)] for s in scenarios),
        max_exceptions=float("inf"), after_each=after_each, max_concurrency=max_concurrency,
        description=description or f"eval step {step} (held-out)")
    if save_to is not None:
        write_groups_jsonl(groups, save_to)
    return EvalStats.from_groups(step, groups)


@dataclass
class LoopResult:
    """What `train_loop` did: held-out stats before and after (and at every evaluated step),
    and one row per training step."""

    before: EvalStats
    after: EvalStats
    steps: list[dict[str, Any]]
    evals: dict[int, EvalStats] = field(default_factory=dict)


def step_line(result: TrainResult, groups: list[TrajectoryGroup]) -> str:
    """The default line printed after each step."""
    m = result.metrics
    return (f"step {result.step}: train reward {_num(m.get('reward_mean'), '.3f')}  "
            f"loss {_num(m.get('loss'), '+.4f')}  {float(m.get('seconds', 0.0)):.1f} s train"
            f"{sampling_text(m)}")


def sampling_text(metrics: dict[str, float]) -> str:
    """'  signal 6/6 of 11 drawn' from a step's `sampling_*` metrics ('' without them)."""
    if "sampling_groups_drawn" not in metrics:
        return ""
    found = min(metrics["sampling_groups_with_signal"], metrics["sampling_groups_asked"])
    return (f"  signal {found:.0f}/{metrics['sampling_groups_asked']:.0f} of "
            f"{metrics['sampling_groups_drawn']:.0f} drawn")


async def train_loop(model: TrainableModel, rollout: RolloutFn, train: Sequence[Any],
                     held: Sequence[Any], run_dir: Path, *, steps: int, groups_per_step: int,
                     rollouts_per_group: int, eval_rollouts: int, after_each: Any = None,
                     train_config: Any = None, seed: int = 0,
                     max_concurrency: int | None = None, eval_every: int | None = None,
                     max_exceptions: int | float = 0.5,
                     oversample: float | None = DEFAULT_BUDGET,
                     stratify: Callable[[Any], Hashable] | None = None,
                     stratum_weights: Mapping[Hashable, float] | None = None,
                     on_step: Callable[[TrainResult, list[TrajectoryGroup]], str] = step_line,
                     print_fn: Callable[[str], None] = print) -> LoopResult:
    """Evaluate, train `steps` GRPO steps, evaluate again (see the module docstring).
    `oversample`: groups drawn per group asked for, at most, while groups without signal are
    replaced (None: off). `stratify`: a scenario's stratum, to share each step's groups out
    over the strata, in proportion to `stratum_weights` where given (others: 1). `on_step`
    formats the line printed after each step."""
    if oversample is not None and (isinstance(oversample, bool)
                                   or not isinstance(oversample, int | float) or oversample < 1):
        raise ValueError(f"oversample must be None or a number >= 1, got {oversample!r}")
    train = list(train)
    if stratum_weights and stratify is None:
        raise ValueError("stratum_weights: needs stratify, the scenarios' strata")
    if stratify is not None:  # a bad weight is refused before any rollout
        weigh(sorted({stratify(s) for s in train}, key=str), stratum_weights)
    run_dir.mkdir(parents=True, exist_ok=True)
    evals: dict[int, EvalStats] = {}
    for r in read_jsonl(run_dir / "eval.jsonl"):
        try:
            evals[int(r["step"])] = EvalStats.from_row(r)
        except (KeyError, TypeError, ValueError):
            continue  # a row written by an older version: evaluated again if needed

    async def held_out_at(step: int) -> EvalStats:
        if step not in evals:
            evals[step] = await evaluate(rollout, held, step, rollouts=eval_rollouts,
                                         after_each=after_each, max_concurrency=max_concurrency,
                                         save_to=run_dir / f"eval-{step:04d}.jsonl")
            append_jsonl(run_dir / "eval.jsonl", evals[step].row())
        return evals[step]

    start = await model.get_step()
    before = await held_out_at(start)
    print_fn(f"step {start}: held-out reward {before.reward:.3f}, solved "
             f"{before.rate('solved').text()}")
    history = []
    for i in range(steps):
        # seeded by the step, so a resumed run draws what an uninterrupted one would have
        stream = draws(train, f"{seed}-{start + i}", stratify)
        description = f"step {start + i + 1} rollouts"
        sampling: dict[str, float] = {}
        if oversample is None:
            groups = await gather_trajectory_groups(
                ([rollout(s) for _ in range(rollouts_per_group)]
                 for s in first_draws(stream, min(groups_per_step, len(train)),
                                      stratum_weights, start + i)),
                max_exceptions=max_exceptions, after_each=after_each,
                max_concurrency=max_concurrency, description=description)
        else:
            found = await gather_signal_groups(
                lambda s: [rollout(s) for _ in range(rollouts_per_group)], stream,
                groups_per_step, max_groups=max(groups_per_step,
                                                round(oversample * groups_per_step)),
                max_exceptions=max_exceptions, after_each=after_each,
                max_concurrency=max_concurrency, description=description,
                signal=signal_rule(train_config), weights=stratum_weights, turn=start + i)
            # nothing with signal even within the budget: the step still advances (invariant 7)
            groups = found.groups or found.skipped[:groups_per_step]
            sampling = found.metrics()
        result = await model.train(groups, train_config)
        m = result.metrics
        if sampling:
            m.update(sampling)
            append_jsonl(run_dir / "sampling.jsonl", {"step": result.step, **sampling})
        history.append({"step": result.step, "train_reward": m.get("reward_mean"),
                        "loss": m.get("loss"), "groups": len(groups),
                        "seconds": round(float(m.get("seconds", 0.0)), 1), **sampling})
        print_fn(on_step(result, groups))
        if eval_every and (i + 1) % eval_every == 0 and i + 1 < steps:
            await held_out_at(result.step)
    after = await held_out_at(await model.get_step())
    return LoopResult(before=before, after=after, steps=history, evals=dict(sorted(evals.items())))


def draws(train: list[Any], seed: str,
          stratify: Callable[[Any], Hashable] | None) -> Iterator[Any] | dict[Hashable, Iterator]:
    """A step's stream of scenarios, or with `stratify` one per stratum (in their sorted order;
    the odd places of an uneven share go round by the step: `shares`)."""
    if stratify is None:
        return shuffled_passes(train, seed)
    strata: dict[Hashable, list[Any]] = {}
    for s in train:
        strata.setdefault(stratify(s), []).append(s)
    return {k: shuffled_passes(strata[k], f"{seed}-{k}") for k in sorted(strata, key=str)}


def first_draws(stream: Iterator[Any] | dict[Hashable, Iterator], n: int,
                weights: Mapping[Hashable, float] | None, turn: int) -> list[Any]:
    """The first `n` scenarios of a step's stream; of strata, each its share of `n` (`shares`
    at the step's `turn`)."""
    if not isinstance(stream, dict):
        return list(itertools.islice(stream, n))
    w = weigh(stream, weights)
    return [s for it, k in zip(stream.values(), shares(n, list(w.values()), turn), strict=True)
            for s in itertools.islice(it, k)]


def load_eval_groups(run_dir: Path, step: int) -> list[TrajectoryGroup]:
    """The held-out groups `train_loop` saved for `step` (none if it did not evaluate it)."""
    from art_core.trajectory import read_groups_jsonl

    path = run_dir / f"eval-{step:04d}.jsonl"
    return read_groups_jsonl(path) if path.exists() else []


def _num(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(float(value), spec)
