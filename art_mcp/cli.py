"""`art mcp-train`: train the embedded model (or another base) on an MCP server's tools.

    art mcp-train --scenarios tasks.jsonl --reward my_reward.py:reward -- python server.py
    art mcp-train --url http://127.0.0.1:8765/mcp --generator openai/gpt-4.1-mini --judge openai/o4-mini

Without `--reward`, RULER scores each group (`--judge`: a litellm model, or `embedded` for an
untrained copy of the base model on the same engine). Without `--scenarios`, `--generator`
writes them from the tool list. A second run on the same `--path` and `--name` continues.
(`art autorl` is here too: `autorl_main`, below.)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any


def load_function(ref: str) -> Any:
    """`path/to/file.py:name` or `package.module:name` -> the object."""
    target, _, name = ref.rpartition(":")
    if not target or not name:
        raise ValueError(f"expected FILE.py:FUNCTION or MODULE:FUNCTION, got {ref!r}")
    if target.endswith(".py"):
        path = Path(target).resolve()
        key = f"_art_loaded_{path.stem}_{abs(hash(str(path)))}"
        module = sys.modules.get(key)
        if module is None:
            spec = importlib.util.spec_from_file_location(key, path)
            if spec is None or spec.loader is None:
                raise ValueError(f"cannot load {target}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module  # dataclasses (and pickling) look their module up
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[key]
                raise
    else:
        module = importlib.import_module(target)
    if not hasattr(module, name):
        raise ValueError(f"{target} has no {name!r}")
    return getattr(module, name)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="art mcp-train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="streamable HTTP server URL (instead of a command after --)")
    p.add_argument("--path", default=".art", help="run directory (default: %(default)s)")
    p.add_argument("--name", default="mcp-agent", help="model name (default: %(default)s)")
    p.add_argument("--project", default="mcp", help="project (default: %(default)s)")
    p.add_argument("--base-model", default=None, help="base model (default: the embedded one)")
    p.add_argument("--scenarios", help="JSONL file of scenarios ({'task', 'difficulty', ...})")
    p.add_argument("--generator", help="model that writes scenarios from the tools: a litellm "
                   "model, or 'embedded' (an untrained copy of the base model, offline)")
    p.add_argument("--generator-api-base", help="OpenAI-compatible endpoint for --generator")
    p.add_argument("--n-scenarios", type=int, default=40, help="scenarios to generate")
    p.add_argument("--held-out", type=float, default=0.25,
                   help="held-out share (<1) or count (>=1) (default: %(default)s)")
    p.add_argument("--reward", help="FILE.py:FUNCTION or MODULE:FUNCTION, "
                   "reward(trajectory, context) -> float; default: RULER")
    p.add_argument("--judge", help="RULER judge: a litellm model, or 'embedded'")
    p.add_argument("--judge-api-base", help="OpenAI-compatible endpoint for --judge")
    p.add_argument("--steps", type=int, default=4, help="training steps to add (default: %(default)s)")
    p.add_argument("--groups-per-step", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--rollouts-per-group", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--eval-rollouts", type=int, default=2,
                   help="rollouts per held-out scenario (default: %(default)s)")
    p.add_argument("--max-turns", type=int, default=6, help="(default: %(default)s)")
    p.add_argument("--examples", help="JSON or JSONL file of worked examples shown before each "
                   'task: {"task", "calls": [{"name", "arguments", "result"}], "summary"}')
    p.add_argument("--action-format", choices=["strict_tools", "json", "tools"],
                   default="strict_tools",
                   help="strict_tools: native calls held to the schemas (our gateway enforces "
                   "them); json: a strict JSON action per turn; tools: free native calls "
                   "(default: %(default)s)")
    p.add_argument("--learning-rate", type=float, default=1e-3,
                   help="(default: %(default)s, for the 135M model; less for larger ones)")
    p.add_argument("--max-concurrency", type=int, default=8,
                   help="rollouts (and stdio server processes) at once (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]",
                   help="environment variable for the stdio server (repeatable): KEY passes "
                   "this shell's value, KEY=VALUE sets one. The server gets only these and a "
                   "safe default (PATH, HOME, ...), never the trainer's keys")
    p.add_argument("command", nargs="*", help="the command that starts a stdio server (after --)")
    return p


def server_env(items: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """`--env` items as a mapping; ValueError names a bad item or a KEY this shell lacks."""
    environ = dict(os.environ) if environ is None else environ
    env: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise ValueError(f"--env {item!r}: expected KEY or KEY=VALUE with a variable name")
        if not eq:
            if key not in environ:
                raise ValueError(f"--env {key}: not set in this environment")
            value = environ[key]
        env[key] = value
    return env


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv or [])
    if bool(args.url) == bool(args.command):
        p.error("give the server: either --url URL or -- COMMAND ARGS...")
    if not args.reward and not args.judge:
        p.error("give --reward FILE.py:FUNCTION (verifiable) or --judge MODEL (RULER)")
    if not args.scenarios and not args.generator:
        p.error("give --scenarios FILE.jsonl or --generator MODEL")
    for name, least in (("steps", 0), ("groups_per_step", 1), ("rollouts_per_group", 2),
                        ("eval_rollouts", 1), ("max_turns", 1), ("max_concurrency", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}")
    try:
        args.server_env = server_env(args.env)
    except ValueError as e:
        p.error(str(e))
    if args.server_env and args.url:
        p.error("--env applies to a stdio server (a command after --), not to --url")
    args.worked_examples = []
    if args.examples:  # read once, here: a bad file is an error before anything starts
        from art_mcp.agent import WorkedExample

        try:
            args.worked_examples = WorkedExample.load(args.examples)
        except (OSError, ValueError) as e:
            p.error(f"--examples: {e}")
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from art_core import TrainableModel, TrainConfig
    from art_mcp.agent import AgentConfig
    from art_mcp.session import ServerSpec
    from art_mcp.train import train_mcp

    model = TrainableModel(name=args.name, project=args.project,
                           **({"base_model": args.base_model} if args.base_model else {}))
    server = ServerSpec(url=args.url) if args.url else ServerSpec(command=args.command,
                                                                    env=args.server_env)
    held_out: int | float = int(args.held_out) if args.held_out >= 1 else args.held_out
    judge_kwargs = {"api_base": args.judge_api_base} if args.judge_api_base else {}
    gen_kwargs = {"api_base": args.generator_api_base} if args.generator_api_base else {}
    await train_mcp(
        server, model=model, path=args.path, scenarios=args.scenarios, generator=args.generator,
        generator_kwargs=gen_kwargs, n_scenarios=args.n_scenarios, held_out=held_out,
        reward=load_function(args.reward) if args.reward else None, judge=args.judge,
        judge_kwargs=judge_kwargs, steps=args.steps, groups_per_step=args.groups_per_step,
        rollouts_per_group=args.rollouts_per_group, eval_rollouts=args.eval_rollouts,
        agent=AgentConfig(max_turns=args.max_turns, action_format=args.action_format,
                          examples=args.worked_examples),
        train_config=TrainConfig(learning_rate=args.learning_rate), seed=args.seed,
        max_concurrency=args.max_concurrency)
    return 0


AUTORL_DOC = """`art autorl`: train a model from a task description, with no data and no reward code.

    art autorl "Triage support emails into billing / bug / feature request and draft a reply."
    art autorl "..." --generator openai/gpt-4.1-mini --judge openai/o4-mini --steps 10
    art autorl "..." --tools my_tools.py:lookup_order my_tools.py:refund

A generator model writes the scenarios and derives the system prompt and the RULER rubric
(shown, and saved in the run directory: edit them and pass them back with --system-prompt /
--rubric, as text or @FILE). RULER judges each group of rollouts; the table at the end compares
the held-out scenarios before and after. By default the embedded model is the policy, the
generator and the judge, on CPU. A second run on the same --path and --name continues, on the
same scenarios.
"""


def autorl_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="art autorl", description=AUTORL_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("description", help="what the agent should do, in a paragraph")
    p.add_argument("--model", default=None, help="base model to train (default: the embedded one)")
    p.add_argument("--name", default="autorl-agent", help="model name (default: %(default)s)")
    p.add_argument("--project", default="autorl", help="project (default: %(default)s)")
    p.add_argument("--path", default=".art", help="run directory (default: %(default)s)")
    p.add_argument("--generator", default="embedded",
                   help="litellm model that writes scenarios and prompts, or 'embedded' "
                   "(default: %(default)s)")
    p.add_argument("--generator-api-base", help="OpenAI-compatible endpoint for --generator")
    p.add_argument("--judge", default="embedded",
                   help="RULER judge: a litellm model, or 'embedded' (default: %(default)s)")
    p.add_argument("--judge-api-base", help="OpenAI-compatible endpoint for --judge")
    p.add_argument("--judge-mode", choices=["auto", "listwise", "yesno", "digits", "pairwise"],
                   default="auto", help="how RULER asks the judge (default: %(default)s)")
    p.add_argument("--tools", nargs="+", action="extend", default=[], metavar="MODULE:FUNCTION",
                   help="Python functions the agent may call (FILE.py:NAME or MODULE:NAME)")
    p.add_argument("--system-prompt", help="the policy's system prompt (text or @FILE) "
                   "instead of the derived one")
    p.add_argument("--rubric", help="RULER rubric (text or @FILE) instead of the derived one")
    p.add_argument("--n-scenarios", type=int, default=24, help="(default: %(default)s)")
    p.add_argument("--held-out", type=float, default=0.25,
                   help="held-out share (<1) or count (>=1) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="training steps to add (default: %(default)s)")
    p.add_argument("--groups-per-step", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--rollouts-per-group", type=int, default=4, help="(default: %(default)s)")
    p.add_argument("--eval-rollouts", type=int, default=2,
                   help="rollouts per held-out scenario (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=200,
                   help="tokens per model call (default: %(default)s)")
    p.add_argument("--max-turns", type=int, default=6, help="with --tools (default: %(default)s)")
    p.add_argument("--learning-rate", type=float, default=1e-3,
                   help="(default: %(default)s, for the 135M model; less for larger ones)")
    p.add_argument("--max-concurrency", type=int, default=8, help="(default: %(default)s)")
    p.add_argument("--examples", type=int, default=3,
                   help="held-out examples shown with the judge's explanation (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _text(value: str | None) -> str | None:
    """A text option: as given, or the contents of @FILE."""
    if value and value.startswith("@"):
        return Path(value[1:]).read_text(encoding="utf-8").strip()
    return value


def autorl_main(argv: list[str] | None = None) -> int:
    p = autorl_parser()
    args = p.parse_args(argv or [])
    for name, least in (("steps", 0), ("groups_per_step", 1), ("rollouts_per_group", 2),
                        ("eval_rollouts", 1), ("n_scenarios", 2), ("max_tokens", 1),
                        ("max_turns", 1), ("max_concurrency", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}")
    try:
        tools = [load_function(ref) for ref in args.tools]
        system_prompt, rubric = _text(args.system_prompt), _text(args.rubric)
    except (ValueError, OSError, ImportError, AttributeError) as e:
        p.error(str(e))
    return asyncio.run(_autorl(args, tools, system_prompt, rubric))


async def _autorl(args: argparse.Namespace, tools: list[Any], system_prompt: str | None,
                  rubric: str | None) -> int:
    from art_core import TrainableModel, TrainConfig
    from art_mcp.agent import AgentConfig
    from art_mcp.autorl import autorl

    model = TrainableModel(name=args.name, project=args.project,
                           **({"base_model": args.model} if args.model else {}))
    held_out: int | float = int(args.held_out) if args.held_out >= 1 else args.held_out
    judge_kwargs: dict[str, Any] = {"mode": args.judge_mode}
    if args.judge_api_base:
        judge_kwargs["api_base"] = args.judge_api_base
    gen_kwargs = {"api_base": args.generator_api_base} if args.generator_api_base else {}
    await autorl(
        args.description, model=model, path=args.path, generator=args.generator,
        generator_kwargs=gen_kwargs, judge=args.judge, judge_kwargs=judge_kwargs, tools=tools,
        system_prompt=system_prompt, rubric=rubric, n_scenarios=args.n_scenarios,
        held_out=held_out, steps=args.steps, groups_per_step=args.groups_per_step,
        rollouts_per_group=args.rollouts_per_group, eval_rollouts=args.eval_rollouts,
        agent=AgentConfig(max_tokens=args.max_tokens, max_turns=args.max_turns),
        train_config=TrainConfig(learning_rate=args.learning_rate), seed=args.seed,
        max_concurrency=args.max_concurrency, examples=args.examples)
    return 0
