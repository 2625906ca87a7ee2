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

Steps 2-4 are `art_core.loop.train_loop`, the loop AutoRL (`art_mcp.autorl`) and the demos
run too.

Everything is kept in `<path>/<project>/models/<name>/mcp/`: scenarios (train/held-out JSONL),
`eval.jsonl` (one row per evaluated step) and `eval-<step>.jsonl` (those rollouts' groups). The model's checkpoints carry the step, so a
second run continues where the first stopped, on the same scenarios.
"""

from __future__ import annotations

import inspect
import logging
import shlex
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_core import Model, TrainableModel, TrainConfig, Trajectory
from art_core.loop import EvalStats, train_loop
from art_core.loop import evaluate as evaluate_rollouts
from art_core.sampling import DEFAULT_BUDGET
from art_mcp.agent import AgentConfig, run_agent
from art_mcp.loop import format_table, open_run, ruler_hook, scenario_split, untrained_copy
from art_mcp.scenarios import Scenario, generate_scenarios, load_scenarios
from art_mcp.session import RecordingSession, ServerSpec, connect

log = logging.getLogger(__name__)

__all__ = ["EvalStats", "McpTrainResult", "RolloutContext", "TurnReward", "as_server",
           "evaluate", "format_table", "rollout", "train_mcp"]


@dataclass
class RolloutContext:
    """What a reward function may look at besides the trajectory: the scenario, the live
    session (to query the server's state) and the rollout's own working directory (where a
    stdio server started by `art_mcp` keeps its state, `$ART_MCP_ROLLOUT_DIR`)."""

    scenario: Scenario
    session: RecordingSession
    workdir: Path


Reward = Callable[[Trajectory, RolloutContext], float | Awaitable[float]]

TurnReward = Callable[[Trajectory, RolloutContext, int], float | Awaitable[float]]
"""`turn_reward(trajectory, context, k)`: sampled turn k's own reward, read after its tool
calls ran (e.g. the progress the turn made on the server's state); with
`TrainConfig(advantage="turn")` each turn is credited with what followed it
(art_core/train/credit.py). The episode's `reward` stays the return: what the turns' rewards
do not account for of it goes to the last turn."""


async def _value(fn: Callable[..., Any], *args: Any) -> float:
    value = fn(*args)
    return float(await value if inspect.isawaitable(value) else value)


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
                  model_name: str | None = None,
                  turn_reward: TurnReward | None = None) -> Trajectory:
    """One rollout of `scenario` on its own connection (its own server process for a
    command); the reward, if given, is computed before the server stops, and `turn_reward`
    after each sampled turn's tool calls (`TurnReward`)."""
    agent = agent or AgentConfig()
    workdir = Path(tempfile.mkdtemp(prefix="art-mcp-"))
    try:
        async with connect(server, workdir=workdir, timeout_s=agent.tool_timeout_s,
                           max_result_chars=agent.max_result_chars) as session:
            context = RolloutContext(scenario, session, workdir)
            traj = Trajectory(metadata={"scenario_id": scenario.id,
                                        "difficulty": scenario.difficulty})

            async def after_turn(t: Trajectory, turn: int) -> None:
                t.set_turn_reward(turn, await _value(turn_reward, t, context, turn))

            await run_agent(model, session, scenario.task, config=agent, trajectory=traj,
                            model_name=model_name,
                            after_turn=after_turn if turn_reward is not None else None)
            if reward is not None:
                traj.reward = await _value(reward, traj, context)
        return traj
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def evaluate(model: Model, server: ServerSpec, scenarios: Sequence[Scenario], step: int, *,
                   rollouts: int = 2, agent: AgentConfig | None = None,
                   reward: Reward | None = None, after_each: Any = None,
                   max_concurrency: int | None = None, save_to: Path | None = None) -> EvalStats:
    """Held-out rollouts at the current step (not trained on); failures are counted, not fatal.
    `save_to`: a JSONL file for the groups, to read what the agent did."""
    return await evaluate_rollouts(
        lambda s: rollout(model, server, s, agent=agent, reward=reward), scenarios, step,
        rollouts=rollouts, after_each=after_each, max_concurrency=max_concurrency,
        save_to=save_to)


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
                     seed: int, model: TrainableModel, backend: Any
                     ) -> tuple[list[Scenario], list[Scenario]]:
    """Saved split (resume), else load or generate, split and save. `generator="embedded"` is
    an untrained copy of the model's base on the same engine (offline, as AutoRL does)."""
    async def pool() -> list[Scenario]:
        nonlocal generator
        if generator == "embedded" and scenarios is None:
            generator = await untrained_copy(model, backend, "base")
        if isinstance(scenarios, str | Path):
            return load_scenarios(scenarios)
        if scenarios is not None:
            return [s if isinstance(s, Scenario) else Scenario.model_validate(s)
                    for s in scenarios]
        if generator is not None:
            return await generate_scenarios(
                n_scenarios, tools=await session.openai_tools(), generator=generator,
                out=run_dir / "scenarios.generated.jsonl", **generator_kwargs)
        raise ValueError("give scenarios (a JSONL file or a list) or a generator model to write them")

    return await scenario_split(run_dir, pool, held_out, seed)


def credit_config(train_config: TrainConfig | None,
                  turn_reward: TurnReward | None) -> TrainConfig | None:
    """The step's config: with a `turn_reward` and no config, per-turn credit (what the turn
    rewards are for); a config that credits episodes anyway is kept, with a warning, since its
    steps train on the episode reward alone and the turn rewards are only recorded."""
    if turn_reward is None:
        return train_config
    if train_config is None:
        return TrainConfig(advantage="turn")
    if train_config.advantage != "turn":
        log.warning("train_mcp: a turn_reward is given but TrainConfig.advantage is %r: the "
                    "steps train on the episode reward and the turn rewards are only recorded "
                    "(advantage='turn' trains on them)", train_config.advantage)
    return train_config


async def train_mcp(
    server: ServerSpec | str | Sequence[str], *, model: TrainableModel | None = None,
    backend: Any = None, path: str | Path = ".art", scenarios: Any = None,
    generator: Any = None, generator_kwargs: dict[str, Any] | None = None,
    n_scenarios: int = 40, held_out: int | float = 0.25, reward: Reward | None = None,
    judge: str | None = None, judge_kwargs: dict[str, Any] | None = None, steps: int = 4,
    groups_per_step: int = 4, rollouts_per_group: int = 4, eval_rollouts: int = 2,
    agent: AgentConfig | None = None, train_config: TrainConfig | None = None, seed: int = 0,
    max_concurrency: int | None = 8, oversample: float | None = DEFAULT_BUDGET,
    turn_reward: TurnReward | None = None, print_fn: Callable[[str], None] = print,
) -> McpTrainResult:
    """Train `model` (default: the embedded model as "mcp-agent") on `server`'s tools for
    `steps` GRPO steps and compare held-out results before and after (see module docstring).

    Scenarios: a JSONL file or a list, else written by `generator` from the tools (a litellm
    model, an `art_core.Model`, or "embedded": an untrained copy of the base on this engine).
    Reward: `reward(trajectory, context)` when given (verifiable), else RULER with `judge`
    (a litellm model; "embedded" uses an untrained copy of the model's base on the same
    backend). `judge_kwargs` go to `ruler.score_group` (api_base, api_key, timeout...).
    `max_concurrency` caps rollouts (and so server processes) running at once. `oversample`:
    dynamic sampling's budget, groups drawn per group trained at most (None: off;
    art_core/sampling.py). `turn_reward`: a reward per turn (`TurnReward`), trained on with
    `TrainConfig(advantage="turn")`, the config when none is given (`credit_config`)."""
    spec = as_server(server)
    train_config = credit_config(train_config, turn_reward)
    model = model or TrainableModel(name="mcp-agent", project="mcp")
    async with open_run(model, backend, path, "mcp") as (backend, run_dir):
        after_each = None
        if reward is None:
            after_each = await ruler_hook(judge, judge_kwargs or {}, model, backend)
        with tempfile.TemporaryDirectory(prefix="art-mcp-") as tmp:
            async with connect(spec, workdir=tmp) as session:
                train, held = await _scenarios(run_dir, session, scenarios, generator,
                                               generator_kwargs or {}, n_scenarios, held_out, seed,
                                               model, backend)
                tools = [t["function"]["name"] for t in await session.openai_tools()]
        print_fn(f"server {spec.describe()}: tools {', '.join(tools)}")
        print_fn(f"scenarios: {len(train)} train, {len(held)} held-out (saved in {run_dir})")
        loop = await train_loop(
            model, lambda s: rollout(model, spec, s, agent=agent, reward=reward,
                                     turn_reward=turn_reward), train, held,
            run_dir, steps=steps, groups_per_step=groups_per_step,
            rollouts_per_group=rollouts_per_group, eval_rollouts=eval_rollouts,
            after_each=after_each, train_config=train_config, seed=seed,
            max_concurrency=max_concurrency, oversample=oversample, print_fn=print_fn)
        table = format_table(loop.before, loop.after, verifiable=reward is not None)
        print_fn(table)
        print_fn(f"run directory: {run_dir.parent}")
        return McpTrainResult(run_dir=run_dir.parent, before=loop.before, after=loop.after,
                              steps=loop.steps, train_scenarios=len(train),
                              held_out_scenarios=len(held), table=table)
