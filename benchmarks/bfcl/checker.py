"""The client of BFCL's worker (`worker.py`, run in `.venv-bfcl`): items and verdicts.

The training environment never imports `bfcl_eval`: one long-lived worker process per
`BfclWorker` answers JSON lines (its docstring has the protocol). Requests are serialised by a
lock; a check takes about a millisecond, so rollouts call it directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().with_name("worker.py")
BFCL_VERSION = "2026.3.23"
"""The bfcl-eval release scripts/setup.sh installs into .venv-bfcl (its data and checker)."""
SIDE_VENV = ROOT / ".venv-bfcl"


class BfclUnavailable(RuntimeError):
    """The side environment with bfcl-eval is missing or broken."""


@dataclass(frozen=True)
class Item:
    """One BFCL test entry: the prompt, the OpenAI tools BFCL's handler made of its functions,
    and the possible answers (only the checker reads them)."""

    id: str
    category: str
    messages: list[dict[str, Any]] = field(hash=False, compare=False)
    tools: list[dict[str, Any]] = field(hash=False, compare=False)
    ground_truth: list[dict[str, Any]] = field(hash=False, compare=False)


@dataclass(frozen=True)
class Verdict:
    """BFCL's AST checker on one response: `valid` is the benchmark's pass/fail."""

    valid: bool
    error_type: str | None = None
    error: tuple[str, ...] = ()


def worker_python() -> Path:
    """The side environment's interpreter (`BFCL_PYTHON` overrides it)."""
    return Path(os.environ.get("BFCL_PYTHON") or SIDE_VENV / "bin" / "python")


def unavailable_reason() -> str | None:
    """Why the BFCL worker cannot start here, or None when it can."""
    python = worker_python()
    if not python.exists():
        return (f"{python} does not exist: BFCL's checker runs in a side environment, created "
                "by `bash scripts/setup.sh --dev` (make test does it)")
    return None


class BfclWorker:
    """BFCL's loader, tool conversion and checker in a subprocess of the side environment."""

    def __init__(self, python: Path | None = None) -> None:
        reason = None if python else unavailable_reason()
        if reason:
            raise BfclUnavailable(reason)
        self._lock = threading.Lock()
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        # stderr to a file: BFCL's warnings must not fill a pipe nobody reads
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [str(python or worker_python()), "-I", str(WORKER)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1, env=env)
        info = self._call({"op": "version"})
        if info["version"] != BFCL_VERSION:
            self.close()
            raise BfclUnavailable(f"{worker_python()} has bfcl-eval {info['version']}, this code "
                                  f"is written against {BFCL_VERSION}: run scripts/setup.sh --dev")
        self.version: str = info["version"]
        self.registry: str = info["registry"]

    def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._proc.poll() is not None:
                raise BfclUnavailable(f"the BFCL worker exited ({self._proc.returncode}): "
                                      f"{self._stderr_tail()}")
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise BfclUnavailable(f"the BFCL worker exited: {self._stderr_tail()}")
        answer = json.loads(line)
        if not answer.pop("ok", False):
            raise ValueError(f"BFCL worker: {answer.get('error')}")
        return answer

    def _stderr_tail(self) -> str:
        self._proc.poll()
        self._stderr.seek(0)
        lines = [ln for ln in self._stderr.read().splitlines() if ln.strip()]
        return lines[-1] if lines else "no output"

    def load(self, category: str) -> list[Item]:
        """Every entry of a BFCL category, in the package's order."""
        items = self._call({"op": "load", "category": category})["items"]
        return [Item(id=i["id"], category=category, messages=i["messages"], tools=i["tools"],
                     ground_truth=i["ground_truth"]) for i in items]

    def check(self, item: Item, message: dict[str, Any]) -> Verdict:
        """BFCL's verdict on an assistant message in OpenAI form (`content`, `tool_calls` with
        `function.name` and `function.arguments` as a JSON string)."""
        calls = [{"id": c.get("id") or f"call_{k}", "type": "function",
                  "function": {"name": c["function"]["name"],
                               "arguments": c["function"]["arguments"]}}
                 for k, c in enumerate(message.get("tool_calls") or [])]
        v = self._call({"op": "check", "category": item.category, "id": item.id,
                        "message": {"content": message.get("content"), "tool_calls": calls}})
        return Verdict(valid=v["valid"], error_type=v["error_type"], error=tuple(v["error"]))

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> BfclWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
