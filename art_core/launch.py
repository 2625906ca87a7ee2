"""`art launch` / `art down`: a GPU host for `art serve`, provisioned by SkyPilot.

    backend = launch_backend(LaunchConfig(accelerators="H100:1"))   # a ready RemoteBackend
    ... train as usual ...
    down("art")                                                      # or: art down

What `launch_backend` does, step by step (SkyPilot does the provisioning, on any cloud or
Kubernetes it supports; nothing here is a home-made cluster manager):

1. builds a SkyPilot task (`task_config`): setup installs `uv`, a Python 3.11 venv, the CUDA
   build of vLLM and this package; run starts `art serve` on 0.0.0.0 with a generated API key
   (passed as a SkyPilot *secret*, so it is redacted from SkyPilot's logs and dashboard) on a
   port SkyPilot opens, training with one process per GPU (`train_processes`); resources
   carry an auto-stop so a forgotten cluster stops costing money.
2. reuses the cluster named `cluster` if it is up and answers /health; if it is up but the
   server exited (idle exit, below), runs the serve job again without a new setup; otherwise
   `sky.launch` (which also restarts a stopped cluster of that name).
3. asks SkyPilot for the port's public endpoint and waits until /health answers.
4. returns `RemoteBackend(url, api_key)`. The key is kept in ~/.art/launch/<cluster>.json (mode
   0600) so a later `art launch` with the same name reuses cluster and key.

Auto-stop: SkyPilot counts a cluster as idle only when no job runs, and a server never ends by
itself, so `art serve` runs with `--idle-exit-minutes` (art_core/serve/idle.py): after that long
without a request it exits, and SkyPilot's auto-stop stops the cluster `idle_minutes` later.

SkyPilot (`pip install 'art-agents[launch]'`) is imported only inside the functions that need it.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from art_core.backend.remote import RemoteBackend

INSTALL_HINT = ("`art launch` needs SkyPilot, an optional extra: pip install 'art-agents[launch]' "
                "(then run `sky check` to enable a cloud or Kubernetes)")


class LaunchError(RuntimeError):
    """SkyPilot is missing, the launch failed, or the server never became healthy."""


class LaunchConfig(BaseModel):
    """Where and how `art serve` runs. Every field maps onto one SkyPilot task setting."""

    model_config = ConfigDict(extra="forbid")

    cluster: str = Field("art", pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", max_length=40,
                         description="SkyPilot cluster name; an existing one is reused.")
    accelerators: str = Field("L4:1", description=(
        "SkyPilot accelerators, e.g. 'L4:1', 'A100:1', 'H100:8'. One 24 GB GPU fits models up "
        "to ~3B with LoRA; several GPUs are used by vLLM's tensor/data parallelism and by "
        "data-parallel training (train_processes)."))
    infra: str | None = Field(None, description=(
        "SkyPilot infra: 'aws', 'gcp/us-central1', 'k8s', ... None lets SkyPilot pick the "
        "cheapest enabled one."))
    port: int = Field(7999, ge=1, le=65535, description="Port `art serve` listens on; opened.")
    use_spot: bool = Field(False, description="Spot instances: cheaper, may be preempted.")
    disk_size: int | None = Field(None, ge=50, description="Disk GB; None: SkyPilot's default.")
    idle_minutes: int = Field(30, ge=0, description=(
        "SkyPilot auto-stop: stop the cluster this long after the server has exited."))
    down: bool = Field(False, description=(
        "Auto-stop tears the cluster down (deleting its disk and checkpoints) instead of "
        "stopping it."))
    serve_idle_minutes: float = Field(60.0, ge=0, description=(
        "`art serve --idle-exit-minutes`: exit after this long without a request, so "
        "auto-stop can fire. 0 keeps the server running until `art down`."))
    package: str = Field("art-agents[backend]", description=(
        "pip requirement that installs this package on the host (a version pin, a wheel URL, "
        "or 'git+https://...')."))
    vllm: str = Field("vllm>=0.10", description="pip requirement for vLLM's CUDA build.")
    run_dir: str = Field("~/art", description="Run directory on the host (checkpoints, logs).")
    train_processes: int | None = Field(None, ge=1, strict=True, description=(
        "`art serve --train-processes`: data-parallel training ranks per step, one per GPU. "
        "None: the GPU count in `accelerators` ('A100:4' -> 4, 'L4' -> 1)."))
    allow_base_models: list[str] = Field(default_factory=list, description=(
        "`art serve --allow-base-model` patterns; empty: any base model."))
    envs: dict[str, str] = Field(default_factory=dict, description=(
        "Extra environment variables for the server (e.g. HF_TOKEN for gated models)."))
    health_timeout_s: float = Field(1800.0, gt=0, description=(
        "How long to wait for /health after the job starts (installing vLLM and loading the "
        "model take minutes)."))
    reuse_timeout_s: float = Field(15.0, gt=0, description=(
        "How long the server of a cluster that is already up gets to answer /health before "
        "its serve job is started again (a running server answers at once)."))

    @model_validator(mode="after")
    def _train_processes_fit(self) -> LaunchConfig:
        # refused here, not by `art serve` on the host after a paid launch and a long setup
        if self.train_processes is not None and self.train_processes > gpu_count(self.accelerators):
            raise ValueError(f"train_processes={self.train_processes} but accelerators="
                             f"{self.accelerators!r} gives {gpu_count(self.accelerators):g} "
                             "GPU(s): one training process per GPU")
        return self

    def train_process_count(self) -> int:
        """The `--train-processes` the server gets: the explicit value, else one per GPU
        (at least 1: a fractional GPU, 'A100:0.5', still trains in one process)."""
        if self.train_processes is not None:
            return self.train_processes
        return max(1, int(gpu_count(self.accelerators)))


def gpu_count(accelerators: str) -> float:
    """How many GPUs a SkyPilot accelerators string asks for, read as SkyPilot reads it:
    '<name>:<count>' or '<memory>:<count>' ('A100:4', '24GB+:2') -> the count; no count
    ('L4', '80GB+', 'nvidia:24GB') -> 1. Fractions ('A100:0.5') stay fractions."""
    _, sep, tail = accelerators.rpartition(":")
    if not sep:
        return 1.0
    try:
        return float(tail)
    except ValueError:  # 'nvidia:24GB': manufacturer and memory, count 1
        return 1.0


def generate_api_key() -> str:
    """A fresh API key: 256 random bits, URL-safe."""
    return secrets.token_urlsafe(32)


def task_config(cfg: LaunchConfig, api_key: str) -> dict[str, Any]:
    """The SkyPilot task (its YAML schema, as a dict) that installs and runs `art serve`."""
    if not api_key:
        raise ValueError("the server listens on 0.0.0.0, so it needs an API key")
    resources: dict[str, Any] = {
        "accelerators": cfg.accelerators,
        "ports": [cfg.port],
        "use_spot": cfg.use_spot,
        "autostop": {"idle_minutes": cfg.idle_minutes, "down": cfg.down},
    }
    if cfg.infra:
        resources["infra"] = cfg.infra
    if cfg.disk_size:
        resources["disk_size"] = cfg.disk_size
    setup = "\n".join([
        "set -euo pipefail",
        # uv brings its own Python 3.11 (cloud images often ship 3.10) and installs fast
        "command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh",
        'export PATH="$HOME/.local/bin:$PATH"',
        "uv venv --python 3.11 --allow-existing ~/art-venv",
        'uv pip install --python ~/art-venv/bin/python "$ART_VLLM" "$ART_PACKAGE"',
    ])
    serve = ["~/art-venv/bin/art", "serve", "--host", "0.0.0.0", "--port", '"$ART_PORT"',
             "--path", '"$ART_RUN_DIR"', "--idle-exit-minutes", '"$ART_SERVE_IDLE_MINUTES"',
             "--train-processes", '"$ART_TRAIN_PROCESSES"']
    for pattern in cfg.allow_base_models:
        serve += ["--allow-base-model", shlex.quote(pattern)]
    run = "\n".join([
        "set -euo pipefail",
        "nvidia-smi -L || true  # the GPUs SkyPilot gave us, in the job log",
        # ART_API_KEY comes from the task's secrets; `art serve` reads it from the environment
        "exec " + " ".join(serve),
    ])
    envs = {"ART_PORT": str(cfg.port), "ART_RUN_DIR": cfg.run_dir,
            "ART_SERVE_IDLE_MINUTES": f"{cfg.serve_idle_minutes:g}",
            "ART_TRAIN_PROCESSES": str(cfg.train_process_count()),
            "ART_PACKAGE": cfg.package, "ART_VLLM": cfg.vllm, **cfg.envs}
    return {"name": f"art-serve-{cfg.cluster}", "resources": resources, "envs": envs,
            "secrets": {"ART_API_KEY": api_key}, "setup": setup, "run": run}


def _sky() -> Any:
    try:
        import sky
    except ImportError as e:
        raise LaunchError(INSTALL_HINT) from e
    return sky


def build_task(cfg: LaunchConfig, api_key: str, *, sky: Any = None) -> Any:
    """The `sky.Task`, parsed and checked by SkyPilot itself: its task and resources YAML
    schemas (`Task.from_yaml_config`), the task name and run script. Accelerator names are
    checked against SkyPilot's catalog, which it downloads, by `sky.launch` itself.
    `sky`: the SkyPilot module (None: import it)."""
    sky = sky if sky is not None else _sky()
    task = sky.Task.from_yaml_config(task_config(cfg, api_key))
    task.validate_name()
    task.validate_run()
    return task


# ---- state kept on this machine: which key a launched cluster uses ---------------------------


def _state_path(cluster: str) -> Path:
    base = Path(os.environ.get("ART_HOME", Path.home() / ".art"))
    return base / "launch" / f"{cluster}.json"


def _load_state(cluster: str) -> dict[str, Any]:
    p = _state_path(cluster)
    return json.loads(p.read_text()) if p.exists() else {}


def _save_state(cluster: str, state: dict[str, Any]) -> None:
    p = _state_path(cluster)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # the key is a secret
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    tmp.replace(p)


# ---- launch and down ------------------------------------------------------------------------


def wait_healthy(url: str, timeout_s: float, *, poll_s: float = 5.0) -> None:
    """Block until `url`/health answers 200 with status ok, or raise `LaunchError`."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url.rstrip("/") + "/health", timeout=min(10.0, timeout_s))
            if r.status_code == 200 and r.json().get("status") == "ok":
                return
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except (httpx.HTTPError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))
    raise LaunchError(f"{url}/health did not answer within {timeout_s:.0f} s ({last}); see "
                      "`sky logs <cluster>`")


def _endpoint(sky: Any, cluster: str, port: int) -> str:
    ends = sky.get(sky.endpoints(cluster, port))
    url = ends.get(port) or ends.get(str(port))
    if not url:
        raise LaunchError(f"SkyPilot reports no endpoint for port {port} of {cluster}: {ends}")
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


def _cluster_up(sky: Any, cluster: str) -> bool:
    records = sky.get(sky.status([cluster]))
    for r in records:
        status = r.get("status") if isinstance(r, dict) else getattr(r, "status", None)
        if str(getattr(status, "value", status)).upper() == "UP":
            return True
    return False


def launch_backend(cfg: LaunchConfig | None = None, *, api_key: str | None = None,
                   dryrun: bool = False, sky: Any = None) -> RemoteBackend | None:
    """Provision (or reuse) the cluster, start `art serve`, wait for /health; return a ready
    `RemoteBackend`. `dryrun=True` asks SkyPilot to plan the launch without provisioning
    and returns None. `sky`: the SkyPilot module (None: import it; tests pass a stand-in)."""
    from art_core.backend.remote import RemoteBackend

    cfg = cfg or LaunchConfig()
    sky = sky if sky is not None else _sky()
    state = _load_state(cfg.cluster)
    key = api_key or state.get("api_key") or generate_api_key()
    task = build_task(cfg, key, sky=sky)
    if dryrun:
        sky.stream_and_get(sky.launch(task, cluster_name=cfg.cluster, dryrun=True))
        return None
    _save_state(cfg.cluster, {"api_key": key, "port": cfg.port})
    if _cluster_up(sky, cfg.cluster):
        url = _endpoint(sky, cfg.cluster, cfg.port)
        try:
            wait_healthy(url, timeout_s=cfg.reuse_timeout_s, poll_s=3)
            return RemoteBackend(url, api_key=key)
        except LaunchError:  # up, but the server exited (idle exit): run it again, no setup
            sky.stream_and_get(sky.exec(task, cluster_name=cfg.cluster))
    else:
        # auto-stop comes from the task's resources (not launch()'s arguments, which would
        # override it): one place says how the cluster stops
        sky.stream_and_get(sky.launch(task, cluster_name=cfg.cluster))
    url = _endpoint(sky, cfg.cluster, cfg.port)
    wait_healthy(url, cfg.health_timeout_s)
    _save_state(cfg.cluster, {"api_key": key, "port": cfg.port, "url": url})
    return RemoteBackend(url, api_key=key)


def down(cluster: str = "art", *, sky: Any = None) -> None:
    """Tear the cluster down (its disk, and the checkpoints on it, are deleted)."""
    sky = sky if sky is not None else _sky()
    sky.stream_and_get(sky.down(cluster))
    _state_path(cluster).unlink(missing_ok=True)
