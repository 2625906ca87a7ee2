"""What MCP·RL (`art_mcp.train`) and AutoRL (`art_mcp.autorl`) share around the one
evaluate-train-evaluate loop (`art_core.loop.train_loop`):

1. `open_run` registers the model (the embedded one by default) and names the run directory.
2. `scenario_split` reuses the train / held-out split saved there (resume), or builds the pool
   (load or generate), splits it so no task is in both, and saves both files.
3. `ruler_hook` scores each group with RULER (a litellm judge, or the embedded base model).
4. `format_table` prints the before/after comparison.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from art_core import TrainableModel
from art_core.loop import EvalStats, LoopResult, RolloutFn, evaluate, train_loop
from art_core.storage import ModelDir
from art_mcp.scenarios import Scenario, load_scenarios, save_scenarios, split_scenarios

__all__ = ["EvalStats", "LoopResult", "RolloutFn", "evaluate", "format_table", "open_run",
           "ruler_hook", "scenario_split", "train_loop", "untrained_copy"]


def format_table(before: EvalStats, after: EvalStats, verifiable: bool, *,
                 reward_label: str = "mean reward", tools: bool = True,
                 extra_rows: Sequence[tuple[str, str, str]] = ()) -> str:
    """The before/after table printed at the end of a run. `tools=False` leaves out the tool
    rows (an agent without tools); `extra_rows` are (name, before, after) added at the end."""
    def mean(stats: EvalStats, name: str) -> str:
        return f"{stats.means.get(name, 0.0):.2f}"

    rows = [("completion rate (95% CI)", before.rate("completed").text(),
             after.rate("completed").text())]
    if verifiable:
        rows.append(("solved, reward = 1 (95% CI)", before.rate("solved").text(),
                     after.rate("solved").text()))
    rows.append((reward_label, f"{before.reward:.3f}", f"{after.reward:.3f}"))
    if tools:
        rows += [("tool errors / rollout", mean(before, "tool_errors"), mean(after, "tool_errors")),
                 ("turns / rollout", mean(before, "turns"), mean(after, "turns"))]
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
