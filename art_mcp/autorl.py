"""AutoRL: train an agent from a one-paragraph task description, with no data and no reward code.

    result = await autorl("Triage support emails into billing / bug / feature request and "
                          "draft a reply.", steps=4)

The pipeline, one function per stage (the loop itself is `art_mcp.loop`, shared with MCP·RL):

1. `derive_prompts`: the generator model turns the description into the policy's system prompt
   and a RULER rubric (strict JSON, validated; a template when it gives nothing usable). Both
   are printed and saved in `prompts.json`; edit them and pass them back (`system_prompt=`,
   `rubric=`; `--system-prompt`, `--rubric` on the command line) or edit the file and resume.
2. Scenarios: `art_mcp.scenarios.generate_scenarios(description=...)` (the same generator
   MCP·RL uses with a tool list) writes the inputs; they are validated, de-duplicated, split into
   train and held-out sets that never share a task, and saved. A resumed run reuses them.
3. Rollouts: with `tools` (Python functions; schemas from their signatures and docstrings, see
   `art_mcp.functions`) the agent loop `run_agent` runs; without, one chat answer per scenario.
4. `art_core.loop.train_loop`: held-out evaluation, then per step groups of rollouts scored by
   RULER with the derived rubric, one GRPO step; held-out evaluation again.
5. The before/after table: the RULER score of each step's held-out rollouts, the two steps
   judged side by side (RULER is relative: judged in one group per scenario, the scores of the
   two steps are comparable), and for a few scenarios the answers with the judge's explanation.

Defaults run on CPU: the embedded SmolLM2 is the policy, and an untrained copy of it on the same
engine ("embedded") writes the scenarios and judges. Any litellm model string works for
`generator` and `judge` (`generator_kwargs` / `judge_kwargs` carry api_base, api_key...).

Kept in `<path>/<project>/models/<name>/autorl/`: `task.json` (the description), `prompts.json`,
the scenario files, `eval.jsonl`, `eval-<step>.jsonl` and `side-by-side-<a>-<b>.jsonl`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from art_core import Model, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_core.loop import EvalStats, load_eval_groups, train_loop
from art_core.sampling import DEFAULT_BUDGET
from art_core.trajectory import write_groups_jsonl
from art_mcp.agent import COMPLETE_TASK, AgentConfig, _append, run_agent
from art_mcp.functions import FunctionSession
from art_mcp.loop import format_table, open_run, ruler_hook, scenario_split, untrained_copy
from art_mcp.scenarios import Scenario, ScenarioError, ask_json, generate_scenarios

TOOLS_HINT = ("Call one tool at a time and read its result. When you are done, call "
              f"{COMPLETE_TASK} with your final answer as the summary.")


class Prompts(BaseModel):
    """The policy's system prompt and the judge's rubric, derived from the description."""

    system_prompt: str = Field(min_length=20, max_length=4000)
    rubric: str = Field(min_length=20, max_length=4000)
    source: str = "given"
    """Where they came from: "generator", "template" (the generator gave nothing usable) or
    "given" (passed in by the user)."""


DERIVE_SYSTEM = (
    "You set up the training of an AI assistant from a description of its job. Write two "
    "texts. system_prompt: the instructions the assistant gets before every request, in the "
    "second person ('You ...'), saying what to do and how to answer. rubric: 3 to 6 short "
    "bullet points a judge uses to tell a good answer to one request from a bad one (correct, "
    "does what was asked, the right format, no invented facts). Answer with JSON only."
)

_PROMPTS_SCHEMA = {"type": "object", "additionalProperties": False,
                   "required": ["system_prompt", "rubric"],
                   "properties": {"system_prompt": {"type": "string", "maxLength": 600},
                                  "rubric": {"type": "string", "maxLength": 600}}}


def template_prompts(description: str, tools: bool = False) -> Prompts:
    """Prompts that need no model: the description as the job, a generic rubric around it."""
    job = " ".join(description.split())
    system = (f"You are an assistant. Your job: {job}\nAnswer the user's request directly, "
              "correctly and completely, without inventing facts.")
    rubric = (f"The assistant's job: {job}\n"
              "- A good answer does exactly what the request asks, as the job describes.\n"
              "- It is correct and specific to the request; it invents no facts.\n"
              "- It is complete, in the expected format, and no longer than needed.")
    if tools:
        system += "\n" + TOOLS_HINT
    return Prompts(system_prompt=system, rubric=rubric, source="template")


async def derive_prompts(description: str, generator: Any, *, tools: Sequence[dict[str, Any]] = (),
                         api_base: str | None = None, api_key: str | None = None,
                         max_attempts: int = 3, temperature: float = 0.7,
                         timeout: float = 300.0) -> tuple[Prompts, list[str]]:
    """(prompts, why earlier answers were rejected): the generator's system prompt and rubric
    for `description`, else `template_prompts` after `max_attempts` unusable answers. With
    `tools` the system prompt is told how to finish (`TOOLS_HINT`)."""
    user = f"The assistant's job:\n{description.strip()}"
    if tools:
        user += "\n\nIts tools:\n" + "\n".join(
            json.dumps({"name": t["function"]["name"],
                        "description": t["function"].get("description", "")}) for t in tools)
    user += '\n\nAnswer as {"system_prompt": "...", "rubric": "- ...\\n- ..."}.'
    messages = [{"role": "system", "content": DERIVE_SYSTEM}, {"role": "user", "content": user}]
    problems: list[str] = []
    for _ in range(max_attempts):
        try:
            content = await ask_json(generator, messages, "autorl_prompts", _PROMPTS_SCHEMA,
                                     max_tokens=500, api_base=api_base, api_key=api_key,
                                     temperature=temperature, timeout=timeout)
            data = json.loads(_json_object(content))
            prompts = Prompts(system_prompt=str(data["system_prompt"]).strip(),
                              rubric=str(data["rubric"]).strip(), source="generator")
            check_usable(prompts, description)
        except (ValueError, KeyError, TypeError, ValidationError) as e:
            problems.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        if tools and COMPLETE_TASK not in prompts.system_prompt:
            prompts.system_prompt += "\n" + TOOLS_HINT
        return prompts, problems
    return template_prompts(description, bool(tools)), problems


def check_usable(prompts: Prompts, description: str) -> None:
    """Raise ValueError when a derived text is not usable although it is valid JSON: one that
    repeats itself (small generators loop) or shares no word with the task description."""
    task_words = {w for w in _words(description) if len(w) > 3}
    for name, text in (("system_prompt", prompts.system_prompt), ("rubric", prompts.rubric)):
        words = _words(text)
        trigrams = list(zip(words, words[1:], words[2:], strict=False))
        if len(trigrams) >= 10 and len(set(trigrams)) < 0.6 * len(trigrams):
            raise ValueError(f"{name} repeats itself ({len(set(trigrams))} distinct of "
                             f"{len(trigrams)} word triples)")
        if task_words and not task_words & set(words):
            raise ValueError(f"{name} shares no word with the task description")


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _json_object(content: str) -> str:
    """The JSON object in an answer (prose or a code fence around it is tolerated)."""
    i, j = content.find("{"), content.rfind("}")
    if not 0 <= i < j:
        raise ValueError("no JSON object in the answer")
    return content[i:j + 1]


async def chat_rollout(model: Model, scenario: Scenario, system_prompt: str,
                       config: AgentConfig | None = None) -> Trajectory:
    """One answer to `scenario` (no tools): system prompt, task, the model's reply. `completed`
    means the reply ended on its own (not cut at `max_tokens`)."""
    cfg = config or AgentConfig()
    traj = Trajectory(messages=[{"role": "system", "content": system_prompt},
                                {"role": "user", "content": scenario.task}],
                      metadata={"scenario_id": scenario.id, "difficulty": scenario.difficulty})
    response = await model.openai_client().chat.completions.create(
        model=model.name, messages=traj.messages, max_tokens=cfg.max_tokens,
        temperature=cfg.temperature)
    message = _append(traj, response)
    finish = response.choices[0].finish_reason
    traj.metrics.update(turns=1, completed=bool((message.get("content") or "").strip())
                        and finish != "length")
    return traj


async def tool_rollout(model: Model, scenario: Scenario, system_prompt: str,
                       session: FunctionSession, config: AgentConfig | None = None) -> Trajectory:
    """One `run_agent` rollout of `scenario` with Python-function tools."""
    cfg = dataclasses.replace(config or AgentConfig(), system_prompt=system_prompt)
    traj = Trajectory(metadata={"scenario_id": scenario.id, "difficulty": scenario.difficulty})
    return await run_agent(model, session, scenario.task, config=cfg, trajectory=traj)


@dataclass
class AutoRLResult:
    """What an `autorl` run did."""

    run_dir: Path
    description: str
    prompts: Prompts
    before: EvalStats
    after: EvalStats
    steps: list[dict[str, Any]]
    train_scenarios: int
    held_out_scenarios: int
    side_by_side: tuple[float, float] | None
    """Mean RULER score of the before and after rollouts judged together, per scenario."""
    table: str


def _read_prompts(path: Path) -> Prompts | None:
    return Prompts.model_validate_json(path.read_text(encoding="utf-8")) if path.exists() else None


def _check_task(run_dir: Path, description: str) -> None:
    """Save the description; a run directory made for another description is an error."""
    path = run_dir / "task.json"
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8")).get("description", "")
        if " ".join(saved.split()) != " ".join(description.split()):
            raise ValueError(f"{run_dir} was made for another task description ({saved[:80]!r}); "
                             "its scenarios and prompts belong to that task: use another model "
                             "name or path")
        return
    path.write_text(json.dumps({"description": description}, indent=1) + "\n", encoding="utf-8")


async def autorl(
    description: str, *, model: TrainableModel | None = None, backend: Any = None,
    path: str | Path = ".art", generator: Any = "embedded",
    generator_kwargs: dict[str, Any] | None = None, judge: str = "embedded",
    judge_kwargs: dict[str, Any] | None = None, tools: Sequence[Callable[..., Any]] = (),
    system_prompt: str | None = None, rubric: str | None = None, n_scenarios: int = 24,
    held_out: int | float = 0.25, steps: int = 4, groups_per_step: int = 4,
    rollouts_per_group: int = 4, eval_rollouts: int = 2, agent: AgentConfig | None = None,
    train_config: TrainConfig | None = None, seed: int = 0, max_concurrency: int | None = 8,
    oversample: float | None = DEFAULT_BUDGET,
    examples: int = 3, print_fn: Callable[[str], None] = print,
) -> AutoRLResult:
    """Train `model` (default: the embedded model as "autorl-agent") for `description` for
    `steps` GRPO steps and print held-out results before and after (see the module docstring).

    `generator` writes the scenarios and derives the prompts; `judge` is RULER's judge: a
    litellm model string, an `art_core.Model` (generator only), or "embedded" (an untrained
    copy of the model's base on the same backend). `system_prompt` / `rubric` replace the
    derived ones (and are saved). `tools`: Python functions the agent may call. `agent`:
    turns, tokens and action format of a rollout (its system prompt is the derived one)."""
    if len(description.split()) < 3:
        raise ValueError("describe the task in a few sentences: what the agent gets and what "
                         "it should do")
    model = model or TrainableModel(name="autorl-agent", project="autorl")
    agent = agent or AgentConfig(max_tokens=200)
    session = FunctionSession(tools, timeout_s=agent.tool_timeout_s,
                              max_result_chars=agent.max_result_chars) if tools else None
    tool_schemas = session.tools if session else []
    async with open_run(model, backend, path, "autorl") as (backend, run_dir):
        _check_task(run_dir, description)
        gen_kw = dict(generator_kwargs or {})
        writer: Any = None

        async def the_generator() -> Any:
            nonlocal writer
            if writer is None:
                writer = generator
                if generator == "embedded":
                    writer = await untrained_copy(model, backend, "base")
            return writer

        prompts = await _prompts(run_dir, description, system_prompt, rubric, the_generator,
                                 gen_kw, tool_schemas, print_fn)

        async def pool() -> list[Scenario]:
            made = await generate_scenarios(
                n_scenarios, description=description, tools=tool_schemas or None,
                generator=await the_generator(), out=run_dir / "scenarios.generated.jsonl",
                allow_fewer=True, id_prefix="autorl", **{"max_attempts": 6, **gen_kw})
            if len(made) < min(n_scenarios, 4):
                raise ScenarioError(f"the generator wrote only {len(made)} usable scenarios of "
                                    f"{n_scenarios}; try a stronger --generator")
            return made

        train, held = await scenario_split(run_dir, pool, held_out, seed)
        print_fn(f"scenarios: {len(train)} train, {len(held)} held-out (saved in {run_dir})")
        for s in held[:3]:
            print_fn(f"  e.g. [{s.difficulty}] {s.task}")
        if session is not None:
            print_fn(f"tools: {', '.join(t['function']['name'] for t in tool_schemas)}")
        hook = await ruler_hook(judge, judge_kwargs or {}, model, backend, rubric=prompts.rubric,
                                suffix="base")

        async def rollout(s: Scenario) -> Trajectory:
            if session is not None:
                return await tool_rollout(model, s, prompts.system_prompt, session, agent)
            return await chat_rollout(model, s, prompts.system_prompt, agent)

        loop = await train_loop(
            model, rollout, train, held, run_dir, steps=steps, groups_per_step=groups_per_step,
            rollouts_per_group=rollouts_per_group, eval_rollouts=eval_rollouts, after_each=hook,
            train_config=train_config, seed=seed, max_concurrency=max_concurrency,
            oversample=oversample, print_fn=print_fn)
        before_groups, after_groups = (load_eval_groups(run_dir, loop.before.step),
                                       load_eval_groups(run_dir, loop.after.step))
        side = None
        if loop.before.step != loop.after.step:
            side, before_groups, after_groups = await side_by_side(
                before_groups, after_groups, hook,
                run_dir / f"side-by-side-{loop.before.step:04d}-{loop.after.step:04d}.jsonl")
        extra = [("RULER, judged side by side", f"{side[0]:.3f}", f"{side[1]:.3f}")] if side else []
        table = format_table(loop.before, loop.after, verifiable=False,
                             reward_label="RULER score (mean)", tools=session is not None,
                             extra_rows=extra)
        table += "\n" + format_examples(before_groups, after_groups, held, loop.before.step,
                                        loop.after.step, examples)
        print_fn(table)
        print_fn(f"run directory: {run_dir.parent}")
        return AutoRLResult(run_dir=run_dir.parent, description=description, prompts=prompts,
                            before=loop.before, after=loop.after, steps=loop.steps,
                            train_scenarios=len(train), held_out_scenarios=len(held),
                            side_by_side=side, table=table)


async def _prompts(run_dir: Path, description: str, system_prompt: str | None,
                   rubric: str | None, the_generator: Callable[[], Any], gen_kw: dict[str, Any],
                   tools: list[dict[str, Any]], print_fn: Callable[[str], None]) -> Prompts:
    """Given prompts, else the saved ones (resume), else derived; saved and shown."""
    path = run_dir / "prompts.json"
    saved = _read_prompts(path)
    if saved is None and (system_prompt is None or rubric is None):
        kw = {k: gen_kw[k] for k in ("api_base", "api_key", "timeout") if k in gen_kw}
        saved, problems = await derive_prompts(description, await the_generator(), tools=tools,
                                               **kw)
        if saved.source == "template":
            print_fn("the generator gave no usable prompts ("
                     + "; ".join(problems[-2:]) + "): using the template")
    assert saved is not None
    prompts = Prompts(system_prompt=system_prompt or saved.system_prompt,
                      rubric=rubric or saved.rubric,
                      source="given" if system_prompt or rubric else saved.source)
    if prompts != saved or not path.exists():
        path.write_text(prompts.model_dump_json(indent=1) + "\n", encoding="utf-8")
    print_fn(f"system prompt ({prompts.source}):\n{_indent(prompts.system_prompt)}")
    print_fn(f"RULER rubric ({prompts.source}):\n{_indent(prompts.rubric)}")
    print_fn(f"(saved in {path}: edit it and run again, or pass --system-prompt / --rubric)")
    return prompts


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def _scenario_id(group: TrajectoryGroup) -> str | None:
    return next((str(t.metadata.get("scenario_id")) for t in group), None)


async def side_by_side(before: list[TrajectoryGroup], after: list[TrajectoryGroup], hook: Any,
                       save_to: Path | None = None
                       ) -> tuple[tuple[float, float] | None, list[TrajectoryGroup],
                                  list[TrajectoryGroup]]:
    """Judge each scenario's before and after rollouts in one RULER group, so that their scores
    are comparable (a relative judge's scores are not, across groups). Returns (mean before,
    mean after) or None when no group could be judged, and the re-scored groups."""
    by_id = {_scenario_id(g): g for g in after}
    scored_before, scored_after, b_scores, a_scores, joint = [], [], [], [], []
    for g in before:
        other = by_id.get(_scenario_id(g))
        if other is None or not len(g) or not len(other):
            continue
        n = len(g)
        tagged = [t.model_copy(deep=True) for t in [*g, *other]]
        scored = await hook(TrajectoryGroup(trajectories=tagged))
        if scored is None:  # the judge failed on this scenario (logged by ruler)
            continue
        joint.append(scored)
        scored_before.append(TrajectoryGroup(trajectories=scored.trajectories[:n]))
        scored_after.append(TrajectoryGroup(trajectories=scored.trajectories[n:]))
        b_scores += [t.reward for t in scored.trajectories[:n]]
        a_scores += [t.reward for t in scored.trajectories[n:]]
    if not joint:
        return None, before, after
    if save_to is not None:
        write_groups_jsonl(joint, save_to)
    return ((sum(b_scores) / len(b_scores), sum(a_scores) / len(a_scores)), scored_before,
            scored_after)


def _answer(traj: Trajectory) -> str:
    """What the agent answered: the summary it finished with, else its last text."""
    if traj.metadata.get("summary"):
        return str(traj.metadata["summary"])
    for m in reversed(traj.messages):
        if m.get("role") == "assistant":
            if m.get("content"):
                return str(m["content"])
            calls = m.get("tool_calls") or []
            if calls:
                f = calls[0]["function"]
                return f"[calls {f['name']}({f.get('arguments', '')})]"
    return "(no answer)"


def _explanation(traj: Trajectory) -> str:
    notes = [line for line in traj.logs if line.startswith("RULER")]
    return notes[-1].split(": ", 2)[-1] if notes else "(not judged)"


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def format_examples(before: list[TrajectoryGroup], after: list[TrajectoryGroup],
                    held: Sequence[Scenario], step_before: int, step_after: int,
                    k: int = 3) -> str:
    """For the first `k` held-out scenarios: one answer per step, its score and the judge's
    explanation."""
    b_by, a_by = ({_scenario_id(g): g for g in before}, {_scenario_id(g): g for g in after})
    lines: list[str] = []
    shown = 0
    for s in held:
        b, a = b_by.get(s.id), a_by.get(s.id)
        if shown >= k or not b or not a or not len(b) or not len(a):
            continue
        shown += 1
        lines += [f"example {s.id}: {_short(s.task)}"]
        for step, t in ((step_before, b.trajectories[0]), (step_after, a.trajectories[0])):
            lines += [f"  step {step}: {_short(_answer(t))}",
                      f"    RULER {t.reward:.3f}: {_short(_explanation(t), 240)}"]
        lines.append("")
    return "\n".join(lines).rstrip()


__all__ = ["AutoRLResult", "Prompts", "autorl", "chat_rollout", "derive_prompts",
           "format_examples", "side_by_side", "template_prompts", "tool_rollout"]
