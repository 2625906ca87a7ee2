"""The train / evaluate loop shared by MCP·RL (`art_mcp.train`) and AutoRL (`art_mcp.autorl`).

Both pipelines are the same loop around a different rollout:

1. `open_run` registers the model (the embedded one by default) and names the run directory.
2. `scenario_split` reuses the train / held-out split saved there (resume), or builds the pool
   (load or generate), splits it so no task is in both, and saves both files.
3. `train_loop`: `evaluate` the held-out scenarios at the current step (cached in `eval.jsonl`,
   so a resumed run does not pay for it twice), then each step `groups_per_step` scenarios x
   `rollouts_per_group` rollouts, scored as each group completes (`after_each`: RULER, from
   `ruler_hook`), one GRPO step; then `evaluate` again.
4. `format_table` prints the before/after comparison.

A rollout here is a plain `async (scenario) -> Trajectory`: the caller binds model and tools.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from art_core import (
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    gather_trajectory_groups,
    write_groups_jsonl,
)
from art_core.storage import ModelDir, append_jsonl, read_jsonl
from art_mcp.scenarios import Scenario, load_scenarios, save_scenarios, split_scenarios

RolloutFn = Callable[[Scenario], Awaitable[Trajectory]]
"""One rollout of one scenario, with the model and tools already bound."""


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a rate (rollouts treated as independent draws)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass
class EvalStats:
    """Held-out results at one step."""

    step: int
    scenarios: int
    rollouts: int
    failed: int
    completed: float
    completed_ci: tuple[float, float]
    solved: float
    solved_ci: tuple[float, float]
    reward: float
    tool_errors: float
    turns: float
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_groups(cls, step: int, groups: list[TrajectoryGroup]) -> EvalStats:
        trajs = [t for g in groups for t in g]
        n = len(trajs)

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        done = sum(bool(t.metrics.get("completed")) for t in trajs)
        solved = sum(t.reward >= 1.0 - 1e-9 for t in trajs)
        return cls(step=step, scenarios=len(groups), rollouts=n,
                   failed=sum(len(g.exceptions) for g in groups),
                   completed=done / n if n else 0.0, completed_ci=wilson(done, n),
                   solved=solved / n if n else 0.0, solved_ci=wilson(solved, n),
                   reward=mean([t.reward for t in trajs]),
                   tool_errors=mean([float(t.metrics.get("tool_errors", 0)) for t in trajs]),
                   turns=mean([float(t.metrics.get("turns", 0)) for t in trajs]))

    def row(self) -> dict[str, Any]:
        """As a JSON row of `eval.jsonl`."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> EvalStats:
        row = dict(row)
        for k in ("completed_ci", "solved_ci"):
            row[k] = tuple(row[k])
        return cls(**row)


async def evaluate_rollouts(rollout: RolloutFn, scenarios: Sequence[Scenario], step: int, *,
                            rollouts: int = 2, after_each: Any = None,
                            max_concurrency: int | None = None,
                            save_to: Path | None = None) -> EvalStats:
    """Held-out rollouts at the current step (not trained on); failures are counted, not fatal.
    `save_to`: a JSONL file for the groups, to read what the agent did."""
    groups = await gather_trajectory_groups(
        ([rollout(s) for _ in range(rollouts)] for s in scenarios),
        max_exceptions=float("inf"), after_each=after_each, max_concurrency=max_concurrency,
        description=f"eval step {step}")
    if save_to is not None:
        write_groups_jsonl(groups, save_to)
    return EvalStats.from_groups(step, groups)


def format_table(before: EvalStats, after: EvalStats, verifiable: bool, *,
                 reward_label: str = "mean reward", tools: bool = True,
                 extra_rows: Sequence[tuple[str, str, str]] = ()) -> str:
    """The before/after table printed at the end of a run. `tools=False` leaves out the tool
    rows (an agent without tools); `extra_rows` are (name, before, after) added at the end."""
    def rate(v: float, ci: tuple[float, float]) -> str:
        return f"{v:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"

    rows = [("completion rate (95% CI)", rate(before.completed, before.completed_ci),
             rate(after.completed, after.completed_ci))]
    if verifiable:
        rows.append(("solved, reward = 1 (95% CI)", rate(before.solved, before.solved_ci),
                     rate(after.solved, after.solved_ci)))
    rows.append((reward_label, f"{before.reward:.3f}", f"{after.reward:.3f}"))
    if tools:
        rows += [("tool errors / rollout", f"{before.tool_errors:.2f}", f"{after.tool_errors:.2f}"),
                 ("turns / rollout", f"{before.turns:.2f}", f"{after.turns:.2f}")]
    rows += [("failed rollouts", str(before.failed), str(after.failed)), *extra_rows]
    head = (f"held-out: {after.scenarios} scenarios x {after.rollouts // max(after.scenarios, 1)} "
            f"rollouts")
    lines = [head, f"{'':30}{'step ' + str(before.step):>22}{'step ' + str(after.step):>22}"]
    lines += [f"{name:30}{b:>22}{a:>22}" for name, b, a in rows]
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def open_run(model: TrainableModel, backend: Any, path: str | Path,
                   subdir: str) -> AsyncIterator[tuple[Any, Path]]:
    """(backend, run directory `<root>/<project>/models/<name>/<subdir>`), with `model`
    registered. A backend made here (a `LocalBackend` on `path`) is closed at the end."""
    from art_core import LocalBackend

    own = backend is None
    backend = backend or LocalBackend(path)
    try:
        if model.base_url is None:
            await model.register(backend)
        run_dir = ModelDir(getattr(backend, "root", path), model.project, model.name).path / subdir
        run_dir.mkdir(parents=True, exist_ok=True)
        yield backend, run_dir
    finally:
        if own:
            await backend.close()


async def scenario_split(run_dir: Path, make_pool: Callable[[], Awaitable[list[Scenario]]],
                         held_out: int | float, seed: int
                         ) -> tuple[list[Scenario], list[Scenario]]:
    """The split saved in `run_dir` (resume: `make_pool` is not called), else `make_pool()`
    split (no task in both) and saved as scenarios.train.jsonl / scenarios.heldout.jsonl."""
    train_file, held_file = run_dir / "scenarios.train.jsonl", run_dir / "scenarios.heldout.jsonl"
    if train_file.exists() and held_file.exists():
        return load_scenarios(train_file), load_scenarios(held_file)
    train, held = split_scenarios(await make_pool(), held_out, seed=seed)
    save_scenarios(train, train_file)
    save_scenarios(held, held_file)
    return train, held


async def untrained_copy(model: TrainableModel, backend: Any, suffix: str) -> TrainableModel:
    """An untrained copy of `model`'s base on the same backend (one engine per base), registered
    as `<name>-<suffix>`: the embedded judge or scenario writer."""
    copy = TrainableModel(name=f"{model.name}-{suffix}", project=model.project,
                          base_model=model.base_model, config=model.config)
    await copy.register(backend)
    return copy


async def ruler_hook(judge: str | None, kwargs: dict[str, Any], model: TrainableModel,
                     backend: Any, rubric: str | None = None, suffix: str = "judge") -> Any:
    """An `after_each` hook scoring each group with RULER (`rubric`: default `DEFAULT_RUBRIC`).
    `judge` is a litellm model, or "embedded" for `untrained_copy(model, ...)`."""
    import ruler

    if judge is None:
        raise ValueError("no reward: give reward=<function> or a RULER judge "
                         "(a litellm model, or 'embedded')")
    kwargs = {"swallow_exceptions": True, **kwargs}
    if judge == "embedded":  # the base model, untrained, on the same engine
        judge_model = await untrained_copy(model, backend, suffix)
        judge = f"openai/{judge_model.name}"
        kwargs = {"api_base": judge_model.base_url, "api_key": "none", "temperature": 0.0,
                  "max_tokens": 600, "timeout": 300, **kwargs}
    return ruler.hook(judge, rubric or ruler.DEFAULT_RUBRIC, **kwargs)


@dataclass
class LoopResult:
    """What `train_loop` did: held-out stats before and after, and one row per step."""

    before: EvalStats
    after: EvalStats
    steps: list[dict[str, Any]]


async def train_loop(model: TrainableModel, rollout: RolloutFn, train: Sequence[Scenario],
                     held: Sequence[Scenario], run_dir: Path, *, steps: int,
                     groups_per_step: int, rollouts_per_group: int, eval_rollouts: int,
                     after_each: Any, train_config: TrainConfig | None, seed: int,
                     max_concurrency: int | None,
                     print_fn: Callable[[str], None] = print) -> LoopResult:
    """Evaluate, train `steps` GRPO steps, evaluate again (see the module docstring).

    The held-out groups of step s are kept in `run_dir/eval-<s>.jsonl` and their stats in
    `run_dir/eval.jsonl`; a step evaluated before is read back, not run again."""
    evals = {int(r["step"]): r for r in read_jsonl(run_dir / "eval.jsonl")}

    async def held_out_at(step: int) -> EvalStats:
        if step in evals:
            return EvalStats.from_row(evals[step])
        stats = await evaluate_rollouts(rollout, held, step, rollouts=eval_rollouts,
                                        after_each=after_each, max_concurrency=max_concurrency,
                                        save_to=run_dir / f"eval-{step:04d}.jsonl")
        append_jsonl(run_dir / "eval.jsonl", stats.row())
        return stats

    start = await model.get_step()
    before = await held_out_at(start)
    print_fn(f"step {start}: held-out completion {before.completed:.2f}, "
             f"reward {before.reward:.3f}")
    history = []
    for step in range(start, start + steps):
        picked = random.Random(f"{seed}-{step}").sample(list(train),
                                                        min(groups_per_step, len(train)))
        groups = await gather_trajectory_groups(
            ([rollout(s) for _ in range(rollouts_per_group)] for s in picked),
            max_exceptions=0.5, after_each=after_each, max_concurrency=max_concurrency,
            description=f"step {step} rollouts")
        result = await model.train(groups, train_config)
        m = result.metrics
        row = {"step": result.step, "train_reward": m.get("reward_mean"),
               "loss": m.get("loss"), "groups": len(groups),
               "seconds": round(float(m.get("seconds", 0.0)), 1)}
        history.append(row)
        print_fn(f"step {result.step}: train reward {_num(row['train_reward'], '.3f')}  "
                 f"loss {_num(row['loss'], '+.4f')}  {row['seconds']} s train")
    after = await held_out_at(await model.get_step())
    return LoopResult(before=before, after=after, steps=history)


def _num(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(float(value), spec)
