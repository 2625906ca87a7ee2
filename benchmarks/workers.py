"""The worker protocol of the race benchmarks (vs_trl.py, vs_trl_agent.py): each system runs in
a subprocess of its own, so that its peak RSS (summed over its process tree, our vLLM server
included) is its own, and reports one `RESULT_TAG` line of JSON on stdout."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

RESULT_TAG = "RESULT "


@dataclass
class StepRecord:
    step_s: float
    gen_s: float
    train_s: float
    sampled_tokens: int
    trained_tokens: int


@dataclass
class WorkerResult:
    system: str
    model: str
    max_tokens: int
    steps: list[StepRecord] = field(default_factory=list)
    peak_rss_gib: float = 0.0
    setup_s: float = 0.0
    error: str | None = None


class TreeRSS:
    """Peak of the summed RSS of this process and all its descendants, sampled every 0.2 s
    (getrusage alone misses a child still running and cannot add processes up)."""

    def __init__(self, interval: float = 0.2) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def sample(self) -> None:
        import psutil

        total = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # a child that just exited
                total += p.memory_info().rss
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()

    def __enter__(self) -> TreeRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    @property
    def gib(self) -> float:
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return max(self.peak, own) / 2**30


def run_subprocess(cmd: list[str], args: argparse.Namespace,
                   failed: WorkerResult) -> tuple[dict[str, Any], float]:
    """Run one worker (`args.threads` OpenMP threads, `args.timeout`); its result is the last
    RESULT_TAG line of its stdout, else `failed` with stderr's last line as the error.
    Returns the result and the wall seconds."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        out, err = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = f"timed out after {args.timeout} s"
    found = [ln for ln in out.splitlines() if ln.startswith(RESULT_TAG)]
    if found:
        result = json.loads(found[-1][len(RESULT_TAG):])
    else:
        tail = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        failed.error = tail[0][:200]
        result = asdict(failed)
    if args.verbose and err:
        print(err[-4000:], file=sys.stderr)
    return result, time.perf_counter() - t0
