"""`RemoteBackend` works from a BASE install: a fresh venv (no system site-packages) with the
project installed `--no-deps` plus only its base dependencies (pydantic, openai, httpx, tqdm,
typer): no torch, vLLM, transformers, FastAPI or uvicorn. The client in that venv talks to a
real `art serve` (from the full environment) over a run directory with a model on disk, so no
engine is needed. Building the venv takes ~10-15 s here (pip resolves from the local index).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import KEY, Server, make_fake_run, start_server

REPO = Path(__file__).resolve().parents[2]
HEAVY = ["torch", "vllm", "transformers", "fastapi", "uvicorn", "starlette", "litellm", "peft",
         "safetensors", "numpy"]
BASE_DEPENDENCIES = ["pydantic", "openai", "httpx", "tqdm", "typer"]

CLIENT = """
import asyncio, importlib.util, json, sys
from pathlib import Path

url, key, dest, heavy = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
missing = [m for m in heavy if importlib.util.find_spec(m) is not None]
assert not missing, f"the base venv can import {missing}"

import art_core
from art_core import Model, RemoteBackend, TrainableModel, Trajectory, TrajectoryGroup
from art_core.backend.remote import RemoteBackendError


async def main():
    out = {}
    model = TrainableModel(name="fake", project="proj")
    async with RemoteBackend(url, api_key=key, progress_bar=False) as backend:
        out["health"] = (await backend.health())["status"]
        out["step"] = await backend.get_step(model)
        out["checkpoints"] = [c.step for c in await backend.list_checkpoints(model)]
        d = await backend.download_checkpoint(model, 1, dest)
        out["files"] = sorted(p.name for p in d.iterdir())
        group = TrajectoryGroup(trajectories=[Trajectory(
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])])
        try:
            await backend.train(model, [group])
        except RemoteBackendError as e:
            out["train_error"] = [e.status, e.message]
        out["deleted"] = await backend.delete_checkpoints(model)
    try:
        await RemoteBackend(url, api_key="wrong").get_step(model)
    except RemoteBackendError as e:
        out["wrong_key"] = [e.status, e.message]
    openai_model = Model(name="fake", base_url=url + "/v1", api_key=key)
    out["openai_models"] = [m.id for m in (await openai_model.openai_client().models.list()).data]
    out["heavy_loaded"] = sorted({m.split(".")[0] for m in sys.modules} & set(heavy))
    print(json.dumps(out))


asyncio.run(main())
"""


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv with only the base install (about 10-15 s)."""
    root = tmp_path_factory.mktemp("basevenv") / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(root)
    py = root / "bin" / "python"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    for args in (["--no-deps", "-e", str(REPO)], BASE_DEPENDENCIES):
        proc = subprocess.run([str(py), "-m", "pip", "install", "-q", *args],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, f"pip install {args} failed:\n{proc.stderr[-3000:]}"
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("clientenv") / "run"
    make_fake_run(root)
    s = start_server(root)
    yield s
    s.stop()


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ART_API_KEY")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.mark.slow  # starts processes: make test runs it, make unit does not
def test_remote_backend_from_a_base_install(base_venv, server, tmp_path):
    py = base_venv / "bin" / "python"
    proc = subprocess.run(
        [str(py), "-c", CLIENT, server.url, KEY, str(tmp_path / "adapter"), json.dumps(HEAVY)],
        capture_output=True, text=True, timeout=120, env=_clean_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["health"] == "ok"
    assert out["step"] == 2 and out["checkpoints"] == [0, 1, 2]
    assert out["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert out["train_error"][0] == 400 and "no sampled turn" in out["train_error"][1]
    assert out["deleted"] == [1]  # best (checkpoint 0, reward 0.9) and latest (2) stay
    assert out["wrong_key"][0] == 401 and "invalid API key" in out["wrong_key"][1]
    assert out["openai_models"] == []
    assert out["heavy_loaded"] == []


@pytest.mark.slow  # starts processes: make test runs it, make unit does not
def test_cli_in_a_base_install(base_venv, tmp_path):
    art = base_venv / "bin" / "art"
    proc = subprocess.run([str(art), "--help"], capture_output=True, text=True, timeout=60,
                          env=_clean_env())
    assert proc.returncode == 0 and "serve" in proc.stdout, proc.stderr
    # serving needs the backend extra: a clear message, not a traceback
    proc = subprocess.run([str(art), "serve", "--path", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=60, env=_clean_env())
    assert proc.returncode == 1
    assert "pip install 'art-agents[backend]'" in proc.stderr and "Traceback" not in proc.stderr
    assert sys.executable not in proc.stderr
