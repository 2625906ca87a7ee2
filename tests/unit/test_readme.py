"""The README stays true: its code parses, names only public API, and its quick start is CI's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import art_core
import ruler

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
PUBLIC = {"art": set(art_core.__all__), "ruler": set(ruler.__all__)}


def test_readme_has_code():
    assert PYTHON_BLOCKS, "README.md lost its python examples"


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=lambda c: c.splitlines()[0][:40])
def test_python_block_parses_and_uses_public_names(code):
    tree = ast.parse(code)
    used = {(node.value.id, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id in PUBLIC}
    unknown = sorted(f"{pkg}.{name}" for pkg, name in used if name not in PUBLIC[pkg])
    assert not unknown, f"README uses names that are not public API: {unknown}"


def test_every_call_in_the_text_names_public_api():
    # prose included: "`after_each=ruler.hook(...)`" must name a real function
    refs = set(re.findall(r"\b(art|ruler)\.([A-Za-z_]+)\(", README))
    assert ("ruler", "hook") in refs
    unknown = sorted(f"{pkg}.{name}" for pkg, name in refs if name not in PUBLIC[pkg])
    assert not unknown, f"README mentions names that are not public API: {unknown}"


def test_quick_start_is_what_ci_runs():
    quick = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in quick.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    # each installs what it needs: the demo the training stack, the tests also the dev extras
    assert re.search(r"^demo: setup$", makefile, flags=re.M), "make demo must set up"
    assert re.search(r"^test:\n\t@bash scripts/setup.sh --dev$", makefile, flags=re.M), \
        "make test must set up with the dev extras"
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == ["make test"]
