"""Shared fixtures. Tests against the real vLLM engine share ONE LocalBackend per session (one
gateway; one engine per base model, started on first use), because an engine takes ~20-30 s to
start on CPU and two running at once on two cores crawl."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

# Keep the user's cache out of tests unless the developer points ART_HOME somewhere on purpose
# (the converted SmolLM2 is reused across runs from there).
os.environ.setdefault("ART_HOME", str(Path(__file__).resolve().parents[1] / ".art" / "home"))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
async def backend(run_root: Path) -> AsyncIterator[object]:
    """The session's LocalBackend; each test registers its own model names."""
    from art_core import LocalBackend

    b = LocalBackend(run_root)
    yield b
    await b.close()


async def release_engine(backend, base_model: str) -> None:
    """Stop the session backend's engine of a base model that no later test uses (a module's
    own tiny model), with the models it serves: each engine holds 2-4 GB, and the suite's
    peak, with `art serve`'s engines beside the session's, came within 1 GB of the 24 GB."""
    import asyncio

    engine = backend._engines.pop(base_model)
    backend.gateway.engines.pop(engine.served_name, None)
    for name in [n for n, m in backend.gateway.models.items() if m.engine is engine]:
        del backend.gateway.models[name]
    await asyncio.to_thread(engine.stop)


def tiny_config(max_model_len: int = 1024):
    """Engine settings for tiny models: short context, fast start."""
    from art_core import EngineConfig, ModelConfig

    return ModelConfig(engine=EngineConfig(max_model_len=max_model_len, max_num_seqs=16))
