"""The `art` command line.

Each command is a small function that imports what it needs inside its body, so `art --help`
and `import art_core.cli` stay fast and need no torch, vLLM or litellm.

Core commands are written here. Any package adds its own through the entry-point group
`art.commands` (this project's integrations do: `art demo` from art_langgraph, `art mcp-train`
and `art autorl` from art_mcp; see pyproject.toml): the entry point's name is the command and
its object a function `main(argv: list[str]) -> int | None` (or a coroutine function), whose
docstring is the help line. It gets every argument after the command's name, `--` included,
and parses them itself; art_core knows nothing of it beyond the entry point.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from art_core.config import SFTConfig

COMMAND_GROUP = "art.commands"


def plugin_commands() -> dict[str, EntryPoint]:
    """The commands packages declare in the `art.commands` entry-point group, by name."""
    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


def _plugin(ep: EntryPoint) -> Any:
    """A pass-through command for a plugin's `main(argv)`: its arguments are its own."""
    try:
        fn: Callable[[list[str]], Any] | None = ep.load()
        doc = inspect.getdoc(fn) or ""
    except Exception as e:  # noqa: BLE001 - a broken plugin must not break `art --help`
        fn, doc = None, f"(cannot be loaded: {type(e).__name__}: {e})"
    one = typer.Typer(add_completion=False)

    @one.command(ep.name, help=doc, add_help_option=False,  # --help: the command's own parser
                 context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def run(ctx: typer.Context) -> None:
        if fn is None:
            typer.echo(f"error: the command {ep.name!r} ({ep.value}) {doc[1:-1]}", err=True)
            raise typer.Exit(code=1)
        argv = list(ctx.args)
        raw = sys.argv[1:]  # click drops "--", which may separate a program's options from ours
        if ep.name in raw and "--" in raw[raw.index(ep.name):]:
            argv = raw[raw.index(ep.name) + 1:]
        _run(fn(argv))

    return typer.main.get_command(one)


class _Commands(TyperGroup):
    """Typer's group, plus the plugin commands (loaded only when listed or run)."""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*super().list_commands(ctx),
                *sorted(set(plugin_commands()) - set(self.commands))]

    def get_command(self, ctx: Any, name: str) -> Any:
        command = super().get_command(ctx, name)
        if command is None and name in plugin_commands():
            command = _plugin(plugin_commands()[name])
        return command


app = typer.Typer(
    cls=_Commands,
    name="art",
    help="Train LLM agents with reinforcement learning (GRPO on LoRA).",
    no_args_is_help=True,
    add_completion=False,
    # plain tracebacks: rich's framed ones are slower to import and hide long lines
    pretty_exceptions_enable=False,
)


def _version() -> str:
    from art_core import __version__

    return __version__


def _print_version(value: bool) -> None:
    if value:
        typer.echo(_version())
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """Train LLM agents with reinforcement learning (GRPO on LoRA)."""


@app.command()
def version() -> None:
    """Print the installed art-agents version."""
    typer.echo(_version())


def import_or_exit(module: str, extra: str) -> Any:
    """Import `module`, or exit with a message naming what is missing and how to install it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            typer.echo(f"error: {module} is not part of this install of art-agents", err=True)
        else:
            typer.echo(
                f"error: this command needs the package {e.name!r}; "
                f"install it with: pip install 'art-agents[{extra}]'",
                err=True,
            )
        raise typer.Exit(code=1) from None


def _run(result: object) -> None:
    """Finish a command entry point: run it if it is async, and exit with its int status."""
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    if isinstance(result, int) and not isinstance(result, bool) and result != 0:
        raise typer.Exit(code=result)


@app.command()
def plot(
    path: str = typer.Option(".art", "--path", help="Run directory to read."),
    metric: Annotated[list[str] | None, typer.Option(
        "--metric", "-m", show_default=False,
        help="Metric of history.jsonl to draw (repeatable). Default: reward_mean and loss.",
    )] = None,
    out: str = typer.Option("", "--out", show_default=False,
                            help="PNG to write. Default: <path>/curves.png."),
) -> None:
    """Draw every model's training curves from a run directory and print a summary."""
    from art_core.observe.plot import PlotError, plot_curves, read_curves, summary

    metrics = metric or ["reward_mean", "loss"]
    try:
        curves = read_curves(path, metrics)
        for line in summary(curves):
            typer.echo(line)
        written = plot_curves(curves, out or f"{path}/curves.png", title=f"art: {path}")
    except PlotError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"plot: {written}")


@app.command()
def view(
    path: str = typer.Argument(".art", help="Run directory (a backend's path) to browse."),
    port: int = typer.Option(8090, min=0, max=65535, help="Port on 127.0.0.1 (0: any free)."),
) -> None:
    """Browse a run in a local web page: models, steps, rewards, groups and their trajectories
    side by side. Read-only; follows a run that is still training."""
    from art_core.observe.viewer import serve as serve_view

    try:
        serve_view(path, port)
    except (FileNotFoundError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=1) from None


@app.command()
def sft(
    data: str = typer.Argument(..., help="JSONL file in the OpenAI fine-tuning chat format."),
    model: str = typer.Option(..., "--model", help="Name of the model to train (created if new)."),
    project: str = typer.Option("default", "--project"),
    base_model: str = typer.Option("", "--base-model", show_default=False,
                                   help="Base of a new model. Default: the embedded SmolLM2."),
    path: str = typer.Option(".art", "--path", help="Run directory (in-process backend)."),
    url: str = typer.Option("", "--url", show_default=False,
                            help="An `art serve` server to train on instead of in-process."),
    epochs: int = typer.Option(3, min=1), learning_rate: float = typer.Option(2e-4, min=0.0),
    batch_size: int = typer.Option(8, min=1),
    assistant_turns: str = typer.Option("all", help="'all' or 'last'."),
) -> None:
    """Supervised fine-tuning on a chat JSONL file: one step of the model's LoRA (the same
    checkpoints RL continues from). Bad lines are refused with file and line."""
    from art_core.sft.data import SFTDataError, load_chat_jsonl

    try:
        examples = load_chat_jsonl(data)  # refused here, before an engine starts
        config = SFTConfig(epochs=epochs, learning_rate=learning_rate, batch_size=batch_size,
                           assistant_turns=assistant_turns)  # type: ignore[arg-type]
    except (SFTDataError, FileNotFoundError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=1) from None
    _run(_sft(examples, model, project, base_model, path, url, config))


async def _sft(examples: list[Any], name: str, project: str, base_model: str, path: str,
               url: str, config: SFTConfig) -> None:
    from art_core.model import TrainableModel

    backend: Any
    if url:
        from art_core.backend.remote import RemoteBackend

        backend = RemoteBackend(url)
    else:
        from art_core.backend.local import LocalBackend

        backend = LocalBackend(path)
    kwargs = {"base_model": base_model} if base_model else {}
    model = TrainableModel(name=name, project=project, **kwargs)
    try:
        await model.register(backend)
        result = await model.train_sft(examples, config)
    finally:
        await backend.close()
    m = result.metrics
    typer.echo(f"step {result.step} (sft): {int(m.get('examples', 0))} examples, loss "
               f"{m.get('loss_first_epoch', 0):.4f} -> {m.get('loss', 0):.4f}, "
               f"{int(m.get('skipped_over_long', 0))} skipped as too long, "
               f"{m.get('seconds', 0):.1f} s")


@app.command()
def serve(
    host: str = typer.Option(
        "127.0.0.1", help="Address to listen on. A non-loopback address needs an API key."),
    port: int = typer.Option(7999, min=1, max=65535, help="Port to listen on."),
    path: str = typer.Option(".art", "--path", help="Run directory: models, checkpoints, logs."),
    api_key: str = typer.Option(
        "", "--api-key", envvar="ART_API_KEY", show_default=False,
        help="Require 'Authorization: Bearer KEY' on every route but /health."),
    max_body_mb: float = typer.Option(
        64.0, min=0.001, help="Largest request body accepted (MiB); larger gets a 413."),
    shutdown_grace: float = typer.Option(
        60.0, min=0.0, help="Seconds a running training step gets to finish on SIGTERM."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
    allow_base_model: Annotated[list[str] | None, typer.Option(
        "--allow-base-model", metavar="PATTERN", show_default=False,
        help="Base models clients may register (glob, repeatable), e.g. 'Qwen/*'. "
        "None given: any.")] = None,
    allow_engine_args: bool = typer.Option(
        False, "--allow-engine-args",
        help="Let clients pass vLLM flags (engine.extra_args) and a chat-template path."),
    idle_exit_minutes: float = typer.Option(
        0.0, min=0.0, help="Exit after this many minutes without a request (0: never); "
        "`art launch` sets it so the cluster's auto-stop can fire."),
    train_processes: int = typer.Option(
        1, min=1, help="Data-parallel training processes per step (torchrun; on CUDA one per "
        "GPU). 1 trains in the server process and keeps the model loaded between steps."),
) -> None:
    """Run the backend (vLLM, gateway, trainer) as a server for RemoteBackend clients.

    It serves the OpenAI API for rollouts under /v1 and the training API under /art/v1.
    """
    from art_core.protocol import bind_refusal  # light: checked before anything heavy

    key = api_key.strip() or None
    refusal = bind_refusal(host, key)
    if refusal:
        typer.echo(f"error: {refusal}", err=True)
        raise typer.Exit(code=2)
    module = import_or_exit("art_core.serve.app", extra="backend")
    from art_core.backend.local import check_train_processes

    try:  # more processes than GPUs: a clear message now, not a failed first step
        check_train_processes(train_processes)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=2) from None
    try:
        _run(module.serve(path, host=host, port=port, api_key=key,  # type: ignore[attr-defined]
                          max_body_bytes=int(max_body_mb * 2**20),
                          shutdown_grace_s=shutdown_grace, log_level=log_level,
                          base_models=tuple(allow_base_model or ()),
                          allow_engine_args=allow_engine_args,
                          idle_exit_minutes=idle_exit_minutes,
                          train_processes=train_processes))
    except KeyboardInterrupt:  # Ctrl+C: uvicorn has shut down already; no traceback
        raise typer.Exit(code=130) from None


@app.command()
def launch(
    cluster: str = typer.Option("art", "--cluster", "-c", help="SkyPilot cluster name (reused)."),
    gpus: str = typer.Option("L4:1", "--gpus", help="Accelerators, e.g. L4:1, A100:1, H100:8."),
    infra: str = typer.Option("", "--infra", show_default=False,
                              help="aws, gcp/us-central1, k8s, ... (default: cheapest enabled)."),
    port: int = typer.Option(7999, min=1, max=65535, help="Port `art serve` listens on."),
    idle_minutes: int = typer.Option(30, min=0, help="Auto-stop the cluster this long after "
                                     "the server exits."),
    serve_idle_minutes: float = typer.Option(60.0, min=0.0, help="The server exits after this "
                                             "long without a request (0: never)."),
    down_on_idle: bool = typer.Option(False, "--down", help="Auto-stop deletes the cluster."),
    spot: bool = typer.Option(False, "--spot", help="Use spot instances."),
    package: str = typer.Option("art-agents[backend]", help="pip requirement installed there."),
    train_processes: int | None = typer.Option(
        None, min=1, show_default=False, help="`art serve --train-processes` there "
        "(default: one per GPU of --gpus)."),
    dryrun: bool = typer.Option(False, "--dryrun", help="Let SkyPilot plan it; launch nothing."),
) -> None:
    """Start `art serve` on a GPU host with SkyPilot; print its URL and API key."""
    from pydantic import ValidationError

    from art_core.launch import LaunchConfig, LaunchError, launch_backend

    try:
        cfg = LaunchConfig(cluster=cluster, accelerators=gpus, infra=infra or None, port=port,
                           idle_minutes=idle_minutes, serve_idle_minutes=serve_idle_minutes,
                           down=down_on_idle, use_spot=spot, package=package,
                           train_processes=train_processes)
    except ValidationError as e:  # e.g. more training processes than GPUs, a bad cluster name
        err = e.errors()[0]
        where = ".".join(map(str, err["loc"]))
        typer.echo(f"error: {where + ': ' if where else ''}{err['msg']}", err=True)
        raise typer.Exit(code=2) from None
    try:
        backend = launch_backend(cfg, dryrun=dryrun)
    except LaunchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=1) from None
    if backend is None:
        typer.echo("dry run: SkyPilot accepted the task; nothing was launched")
        return
    typer.echo(f"ready: {backend.base_url}\n"
               f"  export ART_API_KEY={backend.api_key}\n"
               f"  backend = RemoteBackend({backend.base_url!r})\n"
               f"tear down with: art down -c {cluster}")


@app.command()
def down(
    cluster: str = typer.Option("art", "--cluster", "-c", help="SkyPilot cluster name."),
) -> None:
    """Tear down a cluster started by `art launch` (its disk and checkpoints go with it)."""
    from art_core.launch import LaunchError
    from art_core.launch import down as sky_down

    try:
        sky_down(cluster)
    except LaunchError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"cluster {cluster} is down")


if __name__ == "__main__":
    app()
