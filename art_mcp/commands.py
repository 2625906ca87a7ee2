"""The `art` subcommands this package adds, through the `art.commands` entry-point group
(pyproject.toml). Light: each imports its module when it runs."""

from __future__ import annotations

from typing import Any


def mcp_train(argv: list[str]) -> Any:
    """Train a model on an MCP server's tools (art mcp-train --help; server after --)."""
    from art_core.cli import import_or_exit

    return import_or_exit("art_mcp.cli", extra="mcp").main(argv)


def autorl(argv: list[str]) -> Any:
    """Train from a task description alone: generated scenarios, RULER rewards (art autorl --help)."""
    from art_core.cli import import_or_exit

    return import_or_exit("art_mcp.cli", extra="backend,ruler").autorl_main(argv)
