"""Shared fixtures. Tests against the real vLLM engine share ONE LocalBackend per session (one
gateway; one engine per base model, started on first use), because an engine takes ~20-30 s to
start on CPU and two running at once on two cores crawl."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

# Keep the user's cache out of tests unless the developer points ART_HOME somewhere on purpose
# (the converted SmolLM2 is reused across runs from there).
os.environ.setdefault("ART_HOME", str(Path(__file__).resolve().parents[1] / ".art" / "home"))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.hookimpl(tryfirst=True)  # before `-m "not nightly"` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test module's `NIGHTLY` names tests it inherits (LangChain's standard tests) that only
    `make test-all` runs: by name (every parameter) or with its parameter id."""
    for item in items:
        names = getattr(getattr(item, "module", None), "NIGHTLY", ())
        if item.name in names or getattr(item, "originalname", item.name) in names:
            item.add_marker(pytest.mark.nightly)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random models of each family in art_core.testing.tiny.ARCHS (~1 s each)."""
    from art_core.testing.tiny import ARCHS, build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny_model(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The embedded default model, converted once into ART_HOME (~30 s the first time)."""
    from art_core.base_models import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """The embedded model's tokenizer: from the converted model if there, else from its GGUF."""
    from transformers import AutoTokenizer

    from art_core.base_models import _smollm2_gguf, art_home, tools_chat_template

    converted = art_home() / "models" / "SmolLM2-135M-Instruct"
    if (converted / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(converted)
    gguf = _smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.chat_template = tools_chat_template()
    return tok


@pytest.fixture(scope="session")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
async def backend(run_root: Path) -> AsyncIterator[object]:
    """The session's LocalBackend; each test registers its own model names."""
    from art_core import LocalBackend

    b = LocalBackend(run_root)
    yield b
    await b.close()
