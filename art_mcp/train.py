"""MCP·RL: train a model to use an MCP server's tools, with no labelled data.

The pipeline, one function per stage:

1. `train_mcp` lists the server's tools and gets scenarios: the ones saved in the run directory
   by an earlier run (resume), else a JSONL file, else `generate_scenarios` from the tool list.
   They are split into train and held-out sets that never share a task, and saved.
2. `evaluate` runs the held-out scenarios at the current step (the "before" column).
3. Each step: `groups_per_step` train scenarios x `rollouts_per_group` rollouts (`rollout`: a
   fresh server per rollout for a command, so rollouts never see each other's state), scored
   by the user's reward (a function of the trajectory and the rollout's server, called while
   the server still runs) or by RULER (`ruler.score_group`, relative, the default), then one
   GRPO step (`model.train`).
4. `evaluate` again and print the before/after table with the run directory.

Everything is kept in `<path>/<project>/models/<name>/mcp/`: scenarios (train/held-out JSONL),
`eval.jsonl` (one row per evaluated step) and `eval-<step>.jsonl` (those rollouts' groups). The model's checkpoints carry the step, so a
second run continues where the first stopped, on the same scenarios.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import shlex
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from art_core import (
    Model,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    gather_trajectory_groups,
    write_groups_jsonl,
)
from art_core.storage import ModelDir, append_jsonl, read_jsonl
from art_mcp.agent import AgentConfig, run_agent
from art_mcp.scenarios import (
    Scenario,
    generate_scenarios,
    load_scenarios,
    save_scenarios,
    split_scenarios,
)
from art_mcp.session import RecordingSession, ServerSpec, connect


@dataclass
class RolloutContext:
    """What a reward function may look at besides the trajectory: the scenario, the live
    session (to query the server's state) and the rollout's own working directory (where a
    stdio server started by `art_mcp` keeps its state, `$ART_MCP_ROLLOUT_DIR`)."""

    scenario: Scenario
    session: RecordingSession
    workdir: Path


Reward = Callable[[Trajectory, RolloutContext], float | Awaitable[float]]


def as_server(server: ServerSpec | str | Sequence[str]) -> ServerSpec:
    """A `ServerSpec` from a spec, a URL, a command line or a command list."""
    if isinstance(server, ServerSpec):
        return server
    if isinstance(server, str):
        if server.startswith(("http://", "https://")):
            return ServerSpec(url=server)
        return ServerSpec(command=shlex.split(server))
    return ServerSpec(command=list(server))


async def rollout(model: Model, server: ServerSpec, scenario: Scenario, *,
                  agent: AgentConfig | None = None, reward: Reward | None = None,
                  model_name: str | None = None) -> Trajectory:
    """One rollout of `scenario` on its own connection (its own server process for a
    command); the reward, if given, is computed before the server stops."""
    agent = agent or AgentConfig()
    workdir = Path(tempfile.mkdtemp(prefix="art-mcp-"))
    try:
        async with connect(server, workdir=workdir, timeout_s=agent.tool_timeout_s,
                           max_result_chars=agent.max_result_chars) as session:
            traj = Trajectory(metadata={"scenario_id": scenario.id,
                                        "difficulty": scenario.difficulty})
            await run_agent(model, session, scenario.task, config=agent, trajectory=traj,
                            model_name=model_name)
            if reward is not None:
                value = reward(traj, RolloutContext(scenario, session, workdir))
                traj.reward = float(await value if inspect.isawaitable(value) else value)
        return traj
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


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


async def evaluate(model: Model, server: ServerSpec, scenarios: Sequence[Scenario], step: int, *,
                   rollouts: int = 2, agent: AgentConfig | None = None,
                   reward: Reward | None = None, after_each: Any = None,
                   max_concurrency: int | None = None, save_to: Path | None = None) -> EvalStats:
    """Held-out rollouts at the current step (not trained on); failures are counted, not fatal.
    `save_to`: a JSONL file for the groups, to read what the agent did."""
    groups = await gather_trajectory_groups(
        ([rollout(model, server, s, agent=agent, reward=reward) for _ in range(rollouts)]
         for s in scenarios),
        max_exceptions=float("inf"), after_each=after_each, max_concurrency=max_concurrency,
        description=f"eval step {step}")
    if save_to is not None:
        write_groups_jsonl(groups, save_to)
    return EvalStats.from_groups(step, groups)


def format_table(before: EvalStats, after: EvalStats, verifiable: bool) -> str:
    """The before/after table printed at the end of a run."""
    def rate(v: float, ci: tuple[float, float]) -> str:
        return f"{v:.2f} [{ci[0]:.2f}, {ci[1]:.2f}]"

    rows = [("completion rate (95% CI)", rate(before.completed, before.completed_ci),
             rate(after.completed, after.completed_ci))]
    if verifiable:
        rows.append(("solved, reward = 1 (95% CI)", rate(before.solved, before.solved_ci),
                     rate(after.solved, after.solved_ci)))
    rows += [("mean reward", f"{before.reward:.3f}", f"{after.reward:.3f}"),
             ("tool errors / rollout", f"{before.tool_errors:.2f}", f"{after.tool_errors:.2f}"),
             ("turns / rollout", f"{before.turns:.2f}", f"{after.turns:.2f}"),
             ("failed rollouts", str(before.failed), str(after.failed))]
    head = (f"held-out: {after.scenarios} scenarios x {after.rollouts // max(after.scenarios, 1)} "
            f"rollouts")
    lines = [head, f"{'':30}{'step ' + str(before.step):>22}{'step ' + str(after.step):>22}"]
    lines += [f"{name:30}{b:>22}{a:>22}" for name, b, a in rows]
    return "\n".join(lines)


@dataclass
class McpTrainResult:
    """What a `train_mcp` run did."""

    run_dir: Path
    before: EvalStats
    after: EvalStats
    steps: list[dict[str, Any]]
    train_scenarios: int
    held_out_scenarios: int
    table: str


async def _scenarios(run_dir: Path, session: RecordingSession, scenarios: Any, generator: Any,
                     generator_kwargs: dict[str, Any], n_scenarios: int, held_out: int | float,
                     seed: int) -> tuple[list[Scenario], list[Scenario]]:
    """Saved split (resume), else load or generate, split and save."""
    train_file, held_file = run_dir / "scenarios.train.jsonl", run_dir / "scenarios.heldout.jsonl"
    if train_file.exists() and held_file.exists():
        return load_scenarios(train_file), load_scenarios(held_file)
    if isinstance(scenarios, str | Path):
        pool = load_scenarios(scenarios)
    elif scenarios is not None:
        pool = [s if isinstance(s, Scenario) else Scenario.model_validate(s) for s in scenarios]
    elif generator is not None:
        pool = await generate_scenarios(n_scenarios, tools=await session.openai_tools(),
                                        generator=generator, out=run_dir / "scenarios.generated.jsonl",
                                        **generator_kwargs)
    else:
        raise ValueError("give scenarios (a JSONL file or a list) or a generator model to write them")
    train, held = split_scenarios(pool, held_out, seed=seed)
    save_scenarios(train, train_file)
    save_scenarios(held, held_file)
    return train, held


async def train_mcp(
    server: ServerSpec | str | Sequence[str], *, model: TrainableModel | None = None,
    backend: Any = None, path: str | Path = ".art", scenarios: Any = None,
    generator: Any = None, generator_kwargs: dict[str, Any] | None = None,
    n_scenarios: int = 40, held_out: int | float = 0.25, reward: Reward | None = None,
    judge: str | None = None, judge_kwargs: dict[str, Any] | None = None, steps: int = 4,
    groups_per_step: int = 4, rollouts_per_group: int = 4, eval_rollouts: int = 2,
    agent: AgentConfig | None = None, train_config: TrainConfig | None = None, seed: int = 0,
    max_concurrency: int | None = 8, print_fn: Callable[[str], None] = print,
) -> McpTrainResult:
    """Train `model` (default: the embedded model as "mcp-agent") on `server`'s tools for
    `steps` GRPO steps and compare held-out results before and after (see module docstring).

    Reward: `reward(trajectory, context)` when given (verifiable), else RULER with `judge`
    (a litellm model; "embedded" uses an untrained copy of the model's base on the same
    backend). `judge_kwargs` go to `ruler.score_group` (api_base, api_key, timeout...).
    `max_concurrency` caps rollouts (and so server processes) running at once."""
    from art_core import LocalBackend

    spec = as_server(server)
    model = model or TrainableModel(name="mcp-agent", project="mcp")
    own_backend = backend is None
    backend = backend or LocalBackend(path)
    try:
        if model.base_url is None:
            await model.register(backend)
        run_dir = ModelDir(getattr(backend, "root", path), model.project, model.name).path / "mcp"
        run_dir.mkdir(parents=True, exist_ok=True)
        after_each = None
        if reward is None:
            after_each = await _ruler_hook(judge, judge_kwargs or {}, model, backend)
        with tempfile.TemporaryDirectory(prefix="art-mcp-") as tmp:
            async with connect(spec, workdir=tmp) as session:
                train, held = await _scenarios(run_dir, session, scenarios, generator,
                                               generator_kwargs or {}, n_scenarios, held_out, seed)
                tools = [t["function"]["name"] for t in await session.openai_tools()]
        print_fn(f"server {spec.describe()}: tools {', '.join(tools)}")
        print_fn(f"scenarios: {len(train)} train, {len(held)} held-out (saved in {run_dir})")
        evals = {int(r["step"]): r for r in read_jsonl(run_dir / "eval.jsonl")}
        eval_kw = dict(rollouts=eval_rollouts, agent=agent, reward=reward, after_each=after_each,
                       max_concurrency=max_concurrency)
        start = await model.get_step()
        if start in evals:
            before = _stats(evals[start])
        else:
            before = await evaluate(model, spec, held, start, **eval_kw,
                                    save_to=run_dir / f"eval-{start:04d}.jsonl")
            append_jsonl(run_dir / "eval.jsonl", _row(before))
        print_fn(f"step {start}: held-out completion {before.completed:.2f}, "
                 f"reward {before.reward:.3f}")
        history = []
        for step in range(start, start + steps):
            picked = random.Random(f"{seed}-{step}").sample(train, min(groups_per_step, len(train)))
            groups = await gather_trajectory_groups(
                ([rollout(model, spec, s, agent=agent, reward=reward)
                  for _ in range(rollouts_per_group)] for s in picked),
                max_exceptions=0.5, after_each=after_each, max_concurrency=max_concurrency,
                description=f"step {step} rollouts")
            result = await model.train(groups, train_config)
            m = result.metrics
            row = {"step": result.step, "train_reward": m.get("reward_mean"),
                   "loss": m.get("loss"), "groups": len(groups),
                   "seconds": round(float(m.get("seconds", 0.0)), 1)}
            history.append(row)
            print_fn(f"step {result.step}: train reward {row['train_reward']:.3f}  "
                     f"loss {row['loss']:+.4f}  {row['seconds']} s train")
        end = await model.get_step()
        after = _stats(evals[end]) if end in evals else await evaluate(
            model, spec, held, end, **eval_kw, save_to=run_dir / f"eval-{end:04d}.jsonl")
        if end not in evals:
            append_jsonl(run_dir / "eval.jsonl", _row(after))
        table = format_table(before, after, verifiable=reward is not None)
        print_fn(table)
        print_fn(f"run directory: {run_dir.parent}")
        return McpTrainResult(run_dir=run_dir.parent, before=before, after=after, steps=history,
                              train_scenarios=len(train), held_out_scenarios=len(held),
                              table=table)
    finally:
        if own_backend:
            await backend.close()


async def _ruler_hook(judge: str | None, kwargs: dict[str, Any], model: TrainableModel,
                      backend: Any) -> Any:
    import ruler

    if judge is None:
        raise ValueError("no reward: give reward=<function> or a RULER judge "
                         "(a litellm model, or 'embedded')")
    kwargs = {"swallow_exceptions": True, **kwargs}
    if judge == "embedded":  # the base model, untrained, on the same engine
        judge_model = TrainableModel(name=f"{model.name}-judge", project=model.project,
                                     base_model=model.base_model, config=model.config)
        await judge_model.register(backend)
        judge = f"openai/{judge_model.name}"
        kwargs = {"api_base": judge_model.base_url, "api_key": "none", "temperature": 0.0,
                  "max_tokens": 600, "timeout": 300, **kwargs}
    return ruler.hook(judge, **kwargs)


def _row(stats: EvalStats) -> dict[str, Any]:
    return json.loads(json.dumps(asdict(stats)))


def _stats(row: dict[str, Any]) -> EvalStats:
    row = dict(row)
    for k in ("completed_ci", "solved_ci"):
        row[k] = tuple(row[k])
    return EvalStats(**row)
