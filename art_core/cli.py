"""The `art` command line.

Each command is a small function that imports what it needs inside its body, so `art --help`
and `import art_core.cli` stay fast and need no torch, vLLM or litellm. To add a command
(e.g. `art serve`), write one more `@app.command()` function here and import its module lazily.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect

import typer

app = typer.Typer(
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


def _import_or_exit(module: str, extra: str) -> object:
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
def demo() -> None:
    """Train the embedded small model on a toy task, end to end, on this machine."""
    module = _import_or_exit("art_core.demo", extra="backend")
    _run(module.main())  # type: ignore[attr-defined]


if __name__ == "__main__":
    app()
