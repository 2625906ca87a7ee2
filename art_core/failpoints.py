"""Named points of a training step where a crash test can kill this process.

`failpoint("committed", step)` does nothing unless the environment names that point, as
`ART_FAILPOINT=committed` (any step) or `committed@3` (step 3 only; several comma-separated):
then the process SIGKILLs itself there, as a power cut or an OOM kill would. The crash tests
(tests/engine/test_faults.py) run `art serve` with it and check that a restarted server and a
retrying client lose nothing and train nothing twice. Points, in the order a step reaches them:

    journaled   the groups are on disk, nothing trained
    trained     the optimizer stepped in memory, nothing saved
    committed   the checkpoint is renamed into place, not yet served or in history.jsonl
    published   the new step serves, history.jsonl not yet written
"""

from __future__ import annotations

import os
import signal

POINTS = ("journaled", "trained", "committed", "published")


def failpoint(name: str, step: int) -> None:
    wanted = os.environ.get("ART_FAILPOINT")
    if wanted and ({name, f"{name}@{step}"} & set(wanted.split(","))):
        os.kill(os.getpid(), signal.SIGKILL)
