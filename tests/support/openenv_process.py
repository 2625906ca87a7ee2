"""Run tests/support/openenv_server.py (an OpenEnv `Environment` behind OpenEnv's own
`create_app`) in the side environment `.venv-openenv`, on a free local port."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from art_core.host import free_port

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
SERVER = Path(__file__).resolve().with_name("openenv_server.py")


def unavailable_reason() -> str | None:
    if not PYTHON.exists():
        return (f"{PYTHON} does not exist: OpenEnv runs in a side environment created by "
                "`bash scripts/setup.sh --dev` (make test does it)")
    return None


class OpenEnvServer:
    """The server process; `url` is its base URL; `kill()` ends it at once (SIGKILL)."""

    def __init__(self, startup_timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(PYTHON), "-I", str(SERVER), str(self.port)], stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenEnv server exited: {self.proc.stderr.read()!r}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the OpenEnv server did not answer /health in {startup_timeout_s} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
