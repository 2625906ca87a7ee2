"""The `art` subcommands this package adds, through the `art.commands` entry-point group
(pyproject.toml). Light: each imports its module when it runs."""

from __future__ import annotations

import sys
from typing import Any

DEMOS = {"agent": ("art_langgraph.demo", "backend,langgraph"),
         "brevity": ("art_core.demos.brevity", "backend")}


def demo(argv: list[str]) -> Any:
    """Train a tool-using LangGraph agent on the embedded model, end to end, on CPU
    (`--task brevity`: the older, faster brevity demo; options: art demo [--task T] --help)."""
    from art_core.cli import import_or_exit

    argv, task = list(argv), "agent"
    if "--task" in argv:
        i = argv.index("--task")
        task = argv[i + 1] if i + 1 < len(argv) else ""
        del argv[i:i + 2]
    if task not in DEMOS:
        print(f"error: --task must be one of {', '.join(DEMOS)}; got {task!r}", file=sys.stderr)
        return 2
    return import_or_exit(*DEMOS[task]).main(argv)
