"""The client of BFCL's worker (`worker.py`, run in `.venv-bfcl`): items and verdicts, single-
turn and multi-turn (`multi_turn.py`).

The training environment never imports `bfcl_eval`: one long-lived worker process per
`BfclWorker` answers JSON lines (its docstring has the protocol). Requests are serialised by a
lock; a check takes about a millisecond, so rollouts call it directly.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
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
    matched: int = 0  # the ground truth's calls that a call of the answer passes, one to one
    expected: int = 0  # the ground truth's calls (0 for irrelevance)


@dataclass(frozen=True)
class MultiTurnItem:
    """One BFCL multi-turn entry: its user turns (each a list of messages), the OpenAI tools
    of its API classes, and the ground truth call strings per turn (only the checker and the
    tests read them)."""

    id: str
    turns: list[list[dict[str, Any]]] = field(hash=False, compare=False)
    tools: list[dict[str, Any]] = field(hash=False, compare=False)
    classes: tuple[str, ...] = ()
    ground_truth: list[list[str]] = field(default_factory=list, hash=False, compare=False)


@dataclass(frozen=True)
class MultiTurnVerdict:
    """BFCL's multi-turn checker: `valid` is the official all-or-nothing verdict;
    `turns_passed` the turns that pass in a row from the first (the per-turn signal)."""

    valid: bool
    turns_passed: int
    n_turns: int
    error_type: str | None = None
    error: str = ""


Calls = list[dict[str, str]]
"""One model step's tool calls as BFCL's FC handler parses them: [{name: arguments JSON}]."""


def step_calls(message: dict[str, Any]) -> Calls:
    """An assistant message's tool calls (OpenAI form) as BFCL's handler parses them."""
    return [{c["function"]["name"]: c["function"]["arguments"]}
            for c in message.get("tool_calls") or []]


def ground_truth_steps(item: MultiTurnItem) -> list[list[Calls]]:
    """The ground truth as the model would call it: one call per step, keyword arguments by
    the tool's parameter order for BFCL's positional ones (`sort('a.pdf')`)."""
    params = {t["function"]["name"]: list(t["function"]["parameters"].get("properties", {}))
              for t in item.tools}
    turns = []
    for calls in item.ground_truth:
        steps = []
        for text in calls:
            call = ast.parse(text, mode="eval").body
            assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name), text
            args = {params[call.func.id][i]: ast.literal_eval(a) for i, a in enumerate(call.args)}
            args.update({k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg})
            steps.append([{call.func.id: json.dumps(args)}])
        turns.append(steps)
    return turns


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
        return Verdict(valid=v["valid"], error_type=v["error_type"], error=tuple(v["error"]),
                       matched=v["matched"], expected=v["expected"])

    def multi_turn(self, category: str = "multi_turn_base") -> list[MultiTurnItem]:
        """Every entry of a BFCL multi-turn category, in the package's order."""
        items = self._call({"op": "mt_load", "category": category})["items"]
        return [MultiTurnItem(id=i["id"], turns=i["turns"], tools=i["tools"],
                              classes=tuple(i["classes"]), ground_truth=i["ground_truth"])
                for i in items]

    def execute(self, item: MultiTurnItem, session: str, calls: Calls
                ) -> tuple[list[str], list[str]] | None:
        """Run one model step's calls on the rollout `session`'s API instances: (the call
        strings BFCL decoded, their results); None when they do not decode (the turn ends)."""
        out = self._call({"op": "mt_execute", "id": item.id, "session": session,
                          "calls": calls})
        return None if out["decoded"] is None else (out["decoded"], out["results"])

    def check_turns(self, item: MultiTurnItem, turns: list[list[Calls]]) -> MultiTurnVerdict:
        """BFCL's multi-turn verdict on the model's steps per user turn."""
        v = self._call({"op": "mt_check", "id": item.id, "turns": turns})
        return MultiTurnVerdict(valid=v["valid"], turns_passed=v["turns_passed"],
                                n_turns=v["n_turns"], error_type=v["error_type"],
                                error=v["error"])

    def end_session(self, session: str) -> None:
        """Free the session's API instances in the worker."""
        self._call({"op": "mt_close", "session": session})

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
