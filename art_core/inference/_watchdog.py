"""Runs a command (vLLM's server) and takes its whole process group down when art dies.

vLLM's server starts engine-core and worker processes of its own. PR_SET_PDEATHSIG only
reaches a direct child, so when the art process is SIGKILLed those grandchildren would live on.
This watchdog sits between: it leads a process group of its own (art starts it with setsid),
runs the command inside that group, and when its parent dies (PDEATHSIG, or a changed parent
pid) or it is told to stop, it stops the command gracefully and then kills the whole group.

    python -m art_core.inference._watchdog <command ...>
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

GRACE_S = 15.0


def main() -> None:
    parent = os.getppid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    proc = subprocess.Popen(sys.argv[1:])  # same process group as this watchdog

    def stop(*_: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=GRACE_S)
        os.killpg(0, signal.SIGKILL)  # whatever is left of the group, this process included

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        code = proc.poll()
        if code is not None:
            os.killpg(0, signal.SIGKILL) if code < 0 else None  # crashed: sweep its children
            sys.exit(code if code >= 0 else 1)
        if os.getppid() != parent:  # art died (even by SIGKILL): take vLLM down
            stop()
        time.sleep(0.1)  # a dead vLLM is reported (this process exits) within 0.1 s


if __name__ == "__main__":
    main()
