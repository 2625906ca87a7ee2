"""Helpers for the tests of `art serve` (test_server.py, test_server_engine.py,
test_remote_client_env.py): a real `art serve` subprocess on a free loopback port with an API
key, a fake run directory as LocalBackend writes it, and process and file-tree probes.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

KEY = "test-" + secrets.token_hex(16)
BODY_LIMIT_MB = 1
MSG = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    root: Path
    log: Path

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def start_server(root: Path, *, api_key: str | None = KEY, extra: tuple[str, ...] = (),
                 python: str = sys.executable, timeout: float = 60.0, port: int | None = None,
                 env: dict[str, str] | None = None) -> Server:
    """`art serve` as a subprocess on a loopback port (free, unless given); waits for
    /health. `env`: more environment variables (e.g. ART_FAILPOINT)."""
    port = port or free_port()
    log = root.parent / f"{root.name}-server-{port}.log"
    env = {**os.environ, "ART_API_KEY": api_key or "", **(env or {})}
    cmd = [python, "-m", "art_core.cli", "serve", "--path", str(root), "--port", str(port),
           "--max-body-mb", str(BODY_LIMIT_MB), "--shutdown-grace", "60", *extra]
    with log.open("ab") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL)
    server = Server(proc, f"http://127.0.0.1:{port}", root, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"art serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"art serve did not become healthy:\n{server.log_tail()}")


def make_fake_run(root: Path, project: str = "proj", name: str = "fake", steps: int = 3) -> Path:
    """A model directory as LocalBackend writes it, with small fake adapter files (no engine
    is needed to list, download or delete them)."""
    md = root / project / "models" / name
    for s in range(steps):
        d = md / "checkpoints" / f"{s:04d}"
        d.mkdir(parents=True)
        (d / "adapter_config.json").write_text(json.dumps({"r": 8, "step": s}))
        (d / "adapter_model.safetensors").write_bytes(os.urandom(4096 + s))
    (md / "model.json").write_text(json.dumps({"name": name, "project": project,
                                               "base_model": "tiny"}))
    rows = [{"step": s, "reward_mean": r, "loss": 0.1} for s, r in [(1, 0.9), (2, 0.2)]][
        : max(0, steps - 1)]
    (md / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return md


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under the run dir (engine logs aside) with size and mtime."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if "logs" not in p.relative_to(root).parts}


def descendants(pid: int) -> set[int]:
    """Child processes of `pid`, recursively, from /proc."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier} - out
        out |= frontier
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def auth(key: str | None = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def trajectory_json(reward: float = 1.0, turns: bool = True) -> dict[str, Any]:
    """A trajectory as a client sends it, with one hand-made sampled turn (or none)."""
    msgs = [*MSG, {"role": "assistant", "content": "Paris"}]
    turn = {"message_index": 1, "prompt_token_ids": [1, 2, 3], "completion_token_ids": [4, 5],
            "logprobs": [-0.5, -0.25]}
    return {"messages": msgs, "reward": reward, "turns": [turn] if turns else []}
