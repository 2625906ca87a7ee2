"""Imports run one way (CONTRIBUTING.md): a walk over the module-level imports of the five
packages fails on an import cycle, on the light core reaching a heavy room, and on art_core
naming an integration.

- Cycles count every import, lazy ones inside functions and `if TYPE_CHECKING` ones included:
  a circle of lazy imports is still two modules that each need the other. `from a.b import c`
  is an edge to `a.b.c` when that is a module, else to `a.b`; the parent packages a submodule
  import runs are not edges (every submodule would form a circle with its package's
  `__init__`), except that `from p import x` inside package p is an edge to p's `__init__`.
- The light core (what a client imports) must not reach `art_core.inference`, `serve`,
  `train` or `observe` through module-level imports (lazy ones inside functions are how a
  light module uses a heavy part).
- art_core never imports art_langgraph, art_mcp, ruler or art_bfcl, nor names them in a string
  such as "art_mcp.cli" (they add their `art` commands through entry points).
- The server sits on top: nothing in `art_core.backend` or `art_core.inference` imports
  `art_core.serve`, not even lazily (what both need, such as the HTTP guard, lives below).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("art_core", "art_langgraph", "art_mcp", "ruler", "art_bfcl")
LIGHT = ("art_core", "art_core.trajectory", "art_core.model", "art_core.config",
         "art_core.gather", "art_core.recording", "art_core.storage", "art_core.protocol",
         "art_core.host", "art_core.cli", "art_core.backend.remote",
         "art_core.pipeline", "art_core.sft", "art_core.sft.render",
         "art_core.distill", "art_core.sampling", "art_core.env")
HEAVY = ("art_core.inference", "art_core.serve", "art_core.train", "art_core.observe")
INTEGRATIONS = ("art_langgraph", "art_mcp", "ruler", "art_bfcl")
BELOW_SERVE = ("art_core.backend", "art_core.inference")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def all_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If) and not _type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
    visit(tree.body)
    return found


def edges(name: str, imports=module_level_imports) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    is_package = MODULES[name].name == "__init__.py"
    out: set[str] = set()
    for node in imports(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
            if name.startswith(base + "."):  # `from p import x` inside p runs p's __init__
                targets.append(base)
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: edges(name) for name in MODULES}  # module level: what an import runs
ALL = {name: edges(name, all_imports) for name in MODULES}  # and what a call imports later


def cycles(graph: dict[str, set[str]] = ALL) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def reachable(start: str) -> dict[str, str]:
    """Every module reachable from `start`, with the module that imports it first."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(GRAPH[v]):
            if w not in seen and w != start:
                seen[w] = v
                todo.append(w)
    return seen


def test_the_walk_sees_the_packages():
    assert {"art_core.inference.gateway", "art_core.serve.app", "art_mcp.loop",
            "ruler.scoring"} <= set(MODULES)
    assert "art_core.inference.engine" in GRAPH["art_core.inference.gateway"]
    assert "art_core.train.trainer" in ALL["art_core.backend.trainers"]  # a lazy import
    assert "art_core.train.trainer" not in GRAPH["art_core.backend.trainers"]


def test_no_import_cycles():
    assert cycles() == []


@pytest.mark.parametrize("light", LIGHT)
def test_the_light_core_never_reaches_a_heavy_room(light):
    via = reachable(light)
    heavy = sorted(m for m in via if m.startswith(HEAVY))
    chains = []
    for m in heavy[:3]:
        chain = [m]
        while chain[-1] != light and chain[-1] in via:
            chain.append(via[chain[-1]])
        chains.append(" <- ".join(chain))
    assert not heavy, f"{light} imports heavy modules at module level: {chains}"


def upward_into_serve(graph: dict[str, set[str]] = ALL) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in graph.items() if m.startswith(BELOW_SERVE)
                  for t in targets if t.startswith("art_core.serve"))


def test_backend_and_inference_never_import_the_server():
    assert upward_into_serve() == []


MODULE_PATH = re.compile(r"\b(art_langgraph|art_mcp|ruler)[.:]\w")


def test_art_core_knows_no_integration_by_import_or_name():
    bad = []
    for name, path in MODULES.items():
        if not name.startswith("art_core"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef
                                    | ast.AsyncFunctionDef)
                      and n.body and isinstance(n.body[0], ast.Expr)
                      and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad += [f"{name} imports {a.name}" for a in node.names
                        if a.name.split(".")[0] in INTEGRATIONS]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.split(".")[0] in INTEGRATIONS:
                bad.append(f"{name} imports from {node.module}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and id(node) not in docstrings and MODULE_PATH.search(node.value):
                bad.append(f"{name} names {node.value!r}")
    assert not bad, bad


def test_the_checks_catch_what_they_are_for(monkeypatch):
    """The walk finds a planted cycle and a planted upward arrow (so a green run means
    something)."""
    monkeypatch.setitem(ALL, "art_core.protocol", ALL["art_core.protocol"] | {"art_core.model"})
    assert any({"art_core.protocol", "art_core.model"} <= set(c) for c in cycles())
    monkeypatch.setitem(GRAPH, "art_core.protocol", GRAPH["art_core.protocol"]
                        | {"art_core.inference.gateway"})
    assert "art_core.inference.gateway" in reachable("art_core.trajectory")
    monkeypatch.setitem(ALL, "art_core.backend.local", ALL["art_core.backend.local"]
                        | {"art_core.serve.errors"})
    assert upward_into_serve() == ["art_core.backend.local imports art_core.serve.errors"]
