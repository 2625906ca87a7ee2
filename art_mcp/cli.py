"""`art mcp-train`: train the embedded model (or another base) on an MCP server's tools.

    art mcp-train --scenarios tasks.jsonl --reward my_reward.py:reward -- python server.py
    art mcp-train --url http://127.0.0.1:8765/mcp --generator openai/gpt-4.1-mini --judge openai/o4-mini

Without `--reward`, RULER scores each group (`--judge`: a litellm model, or `embedded` for an
untrained copy of the base model on the same engine). Without `--scenarios`, `--generator`
writes them from the tool list. A second run on the same `--path` and `--name` continues.
(`art autorl` is here too: `autorl_main`, below.)

A failure the user can fix (a bad file, a server that does not start, a model out of reach, a
generator that cannot write the scenarios, a missing package or engine) is one line on stderr,
`art mcp-train: error: ...`, exit status 2 as for argparse's errors; files, models and server
are checked before the engine starts. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from art_core.sampling import DEFAULT_BUDGET


class CommandError(Exception):
    """A failure the user can fix: printed as one line, `<prog>: error: <message>`, exit 2."""


def expected_error(e: BaseException) -> str | None:
    """The one-line message for a failure the user can fix, or None (a bug: the traceback is
    worth more than a line)."""
    from art_mcp.scenarios import ScenarioError

    if isinstance(e, CommandError | ScenarioError):
        return str(e)
    # the error can only be one of these if its module is loaded: import none of them here
    openai = sys.modules.get("openai")  # litellm's errors subclass openai's
    if openai is not None and isinstance(e, openai.APIError):
        url = getattr(getattr(e, "request", None), "url", None)
        at = f" at {url}" if url and type(e).__module__.startswith("openai") else ""
        return (f"a model request failed{at}: {type(e).__name__}: {e}; check --generator, "
                "--judge and their --*-api-base")
    vllm_args = sys.modules.get("art_core.inference.vllm_args")
    if vllm_args is not None and isinstance(e, vllm_args.EngineError):
        head, *log = [line for line in str(e).splitlines() if line.strip()]
        return f"the inference engine failed: {head}" + (f" (its log ends: {log[-1].strip()})"
                                                          if log else "")
    if isinstance(e, ModuleNotFoundError) and e.name:
        return (f"this command needs the package {e.name!r}; install it with: pip install "
                "'art-agents[backend,mcp,ruler]'")
    return None


def finish(prog: str, run: Callable[[], int]) -> int:
    """`run()`'s status, or the one line of an expected failure (`expected_error`) and 2."""
    try:
        return run()
    except Exception as e:
        message = expected_error(e)
        if message is None:
            raise
        print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2


def check_model(option: str, model: str | None, api_base: str | None) -> None:
    """CommandError when `model` (a litellm model string) cannot work: no provider litellm
    knows, its `api_base` refuses connections, or its provider's key is not set. No request
    is sent (a probe would cost tokens); "embedded" needs no check."""
    if model is None or model == "embedded":
        return
    from ruler.calls import import_litellm

    litellm = import_litellm()
    try:
        litellm.get_llm_provider(model, api_base=api_base)
    except Exception:  # noqa: BLE001 - litellm raises several kinds for an unknown provider
        raise CommandError(f"{option} {model}: not a model litellm can route; write "
                           "PROVIDER/MODEL (e.g. openai/gpt-4.1-mini), or 'embedded'") from None
    if api_base:
        url = urlsplit(api_base)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname or "", port), timeout=10).close()
        except OSError as e:
            raise CommandError(f"{option}-api-base {api_base}: cannot connect "
                               f"({e.strerror or e})") from None
        return
    missing = litellm.validate_environment(model).get("missing_keys") or []
    if missing:
        raise CommandError(f"{option} {model}: set {', '.join(missing)} in the environment "
                           f"(or give {option}-api-base URL of an OpenAI-compatible endpoint)")


async def check_server(server: Any) -> list[str]:
    """The names of the server's tools, or CommandError saying why it cannot be started or
    reached, with the last line it wrote to stderr: in seconds, before the engine starts."""
    from art_mcp.session import connect, is_connection_closed

    with tempfile.TemporaryDirectory(prefix="art-mcp-check-") as tmp:
        try:
            async with connect(server, workdir=tmp) as session:
                tools = [t["function"]["name"] for t in await session.openai_tools()]
        except Exception as e:  # noqa: BLE001 - connecting is all this does: any failure is one
            if isinstance(e, FileNotFoundError) and server.command:
                why = f"{server.command[0]}: command not found"
            elif is_connection_closed(e):
                why = "it exited before answering"
            elif isinstance(e, TimeoutError):
                why = "no MCP handshake within 60 s"
            else:
                why = f"{type(e).__name__}: {e}"
            log = Path(tmp) / "server.log"
            lines = log.read_text(errors="replace").splitlines() if log.exists() else []
            said = [line.strip() for line in lines if line.strip()][-1:]
            raise CommandError(f"cannot start or connect to the MCP server "
                               f"{server.describe()!r}: {why}"
                               + (f"; its last line on stderr: {said[0]}" if said else "")
                               ) from None
    if not tools:
        raise CommandError(f"the MCP server {server.describe()!r} offers no tools")
    return tools


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
    p.add_argument("--turn-reward", help="FILE.py:FUNCTION or MODULE:FUNCTION, "
                   "turn_reward(trajectory, context, turn) -> float, read after each turn's "
                   "calls; trains with per-turn credit (TrainConfig advantage='turn')")
    p.add_argument("--judge", help="RULER judge: a litellm model, or 'embedded'")
    p.add_argument("--judge-api-base", help="OpenAI-compatible endpoint for --judge")
    p.add_argument("--steps", type=int, default=4, help="training steps to add (default: %(default)s)")
    p.add_argument("--oversample", type=float, default=DEFAULT_BUDGET,
                   help="dynamic sampling: groups drawn per step, at most, per group trained "
                        "(1: off; default: %(default)s)")
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
                        ("eval_rollouts", 1), ("max_turns", 1), ("max_concurrency", 1),
                        ("n_scenarios", 2)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}")
    if args.oversample < 1:
        p.error("--oversample must be at least 1")
    if args.env and args.url:
        p.error("--env applies to a stdio server (a command after --), not to --url")
    return finish(p.prog, lambda: _checked_run(args))


def _checked_run(args: argparse.Namespace) -> int:
    """Check what the run needs from this machine (the server's environment, the files, the
    models), then run; the server itself is checked in `_run`. Each file is read once, here."""
    from art_mcp.agent import WorkedExample
    from art_mcp.scenarios import dedupe, load_scenarios

    try:
        args.server_env = server_env(args.env)
    except ValueError as e:
        raise CommandError(str(e)) from None
    args.worked_examples = []
    if args.examples:
        try:
            args.worked_examples = WorkedExample.load(args.examples)
        except (OSError, ValueError) as e:
            raise CommandError(f"--examples: {e}") from None
    args.scenario_list = None
    if args.scenarios:  # read once, here: passed on as a list
        try:
            args.scenario_list = load_scenarios(args.scenarios)
        except OSError as e:
            raise CommandError(f"--scenarios: {e.strerror or e}: {args.scenarios}") from None
        except ValueError as e:
            raise CommandError(f"--scenarios: {e}") from None
        if (distinct := len(dedupe(args.scenario_list))) < 2:
            raise CommandError(f"--scenarios {args.scenarios}: {distinct} distinct tasks; at "
                               "least 2 are needed (some to train on, some held out)")
    else:
        check_model("--generator", args.generator, args.generator_api_base)
    args.reward_fn = user_function("--reward", args.reward)
    if not args.reward:
        check_model("--judge", args.judge, args.judge_api_base)
    args.turn_reward_fn = user_function("--turn-reward", args.turn_reward)
    return asyncio.run(_run(args))


def user_function(option: str, ref: str | None) -> Any:
    """The function `ref` names (None when not given); one that cannot be loaded is a
    `CommandError` naming the option."""
    if not ref:
        return None
    try:
        return load_function(ref)
    except (ValueError, OSError, ImportError, AttributeError) as e:
        raise CommandError(f"{option} {ref}: {e}") from None


async def _run(args: argparse.Namespace) -> int:
    from art_core import TrainableModel, TrainConfig
    from art_mcp.agent import AgentConfig
    from art_mcp.session import ServerSpec
    from art_mcp.train import train_mcp

    model = TrainableModel(name=args.name, project=args.project,
                           **({"base_model": args.base_model} if args.base_model else {}))
    server = ServerSpec(url=args.url) if args.url else ServerSpec(command=args.command,
                                                                    env=args.server_env)
    await check_server(server)
    held_out: int | float = int(args.held_out) if args.held_out >= 1 else args.held_out
    judge_kwargs = {"api_base": args.judge_api_base} if args.judge_api_base else {}
    gen_kwargs = {"api_base": args.generator_api_base} if args.generator_api_base else {}
    await train_mcp(
        server, model=model, path=args.path, scenarios=args.scenario_list,
        generator=args.generator, generator_kwargs=gen_kwargs, n_scenarios=args.n_scenarios,
        held_out=held_out, reward=args.reward_fn, judge=args.judge,
        judge_kwargs=judge_kwargs, steps=args.steps, groups_per_step=args.groups_per_step,
        rollouts_per_group=args.rollouts_per_group, eval_rollouts=args.eval_rollouts,
        agent=AgentConfig(max_turns=args.max_turns, action_format=args.action_format,
                          examples=args.worked_examples),
        train_config=TrainConfig(learning_rate=args.learning_rate,
                                 advantage="turn" if args.turn_reward_fn else "group"),
        seed=args.seed, max_concurrency=args.max_concurrency, oversample=args.oversample,
        turn_reward=args.turn_reward_fn)
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
    p.add_argument("--oversample", type=float, default=DEFAULT_BUDGET,
                   help="dynamic sampling: groups drawn per step, at most, per group trained "
                        "(1: off; default: %(default)s)")
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
    if args.oversample < 1:
        p.error("--oversample must be at least 1")
    if len(args.description.split()) < 3:
        p.error("describe the task in a few sentences: what the agent gets and what it should do")
    try:
        tools = [load_function(ref) for ref in args.tools]
        system_prompt, rubric = _text(args.system_prompt), _text(args.rubric)
    except (ValueError, OSError, ImportError, AttributeError) as e:
        p.error(str(e))

    def run() -> int:
        check_model("--generator", args.generator, args.generator_api_base)
        check_model("--judge", args.judge, args.judge_api_base)
        return asyncio.run(_autorl(args, tools, system_prompt, rubric))

    return finish(p.prog, run)


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
        max_concurrency=args.max_concurrency, oversample=args.oversample, examples=args.examples)
    return 0
