"""Steps whose caller gave up: a retry of the same call is answered, never trained twice.

A `train()` cancelled before its step starts (while it waits for the model's lock) never
trains. One cancelled after its step started cannot stop it halfway (the step is journaled,
trains and commits), so the step finishes for nobody; a caller that retries the same call, as
anyone would after a timeout, would then train the same groups twice. `Orphans` remembers such
steps by a fingerprint of the call (kind, model, config, groups): a retry with the same
fingerprint waits for that step, or gets its result, instead of training again.
`RemoteBackend` gets the same guarantee from its request ids; this is the in-process one,
which needs no id from the caller.

Only cancelled calls are remembered, so training the same groups twice on purpose (two
ordinary calls) still trains twice; a step that failed is forgotten (a retry trains anew).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

log = logging.getLogger(__name__)

MAX_ORPHANS = 16
"""Cancelled calls remembered at most (the oldest forgotten first): retries come soon."""


def call_key(kind: str, project: str, name: str, config: BaseModel,
             groups: Sequence[BaseModel]) -> str:
    """A fingerprint of one call: the same kind, model, config and groups give the same key."""
    h = hashlib.sha256(f"{kind}\0{project}\0{name}\0".encode())
    h.update(config.model_dump_json().encode())
    for g in groups:
        h.update(b"\0")
        h.update(g.model_dump_json().encode())
    return h.hexdigest()


class Orphans:
    """Steps whose caller was cancelled after they started, by call key."""

    def __init__(self) -> None:
        self._tasks: OrderedDict[str, asyncio.Task[Any]] = OrderedDict()

    def claim(self, key: Callable[[], str]) -> asyncio.Task[Any] | None:
        """The orphaned step of this call, if there is one (then forgotten: it has a caller
        again). `key` is only computed while something is remembered."""
        if not self._tasks:
            return None
        return self._tasks.pop(key(), None)

    async def wait(self, task: asyncio.Task[Any], key: Callable[[], str]) -> Any:
        """Await a step for its caller; if the caller is cancelled, the step goes on (it cannot
        stop halfway) and is remembered under the call's key for a retry."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done() or (not task.cancelled() and task.exception() is None):
                self._remember(key(), task)
            raise

    def _remember(self, k: str, task: asyncio.Task[Any]) -> None:
        self._tasks[k] = task
        self._tasks.move_to_end(k)
        while len(self._tasks) > MAX_ORPHANS:
            self._tasks.popitem(last=False)

        def forget_failed(t: asyncio.Task[Any]) -> None:
            if (t.cancelled() or t.exception() is not None) and self._tasks.get(k) is t:
                del self._tasks[k]  # a retry of a failed step trains anew

        task.add_done_callback(forget_failed)
        log.info("a step's caller was cancelled after it started: the step finishes, and a "
                 "retry of the same call gets its result instead of training again")
