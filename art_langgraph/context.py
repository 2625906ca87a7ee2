"""`record()`: capture every LangChain / LangGraph model call in a block, with no change to the
graph's code.

    async with record(reward=lambda state: ...) as traj:   # or `with record() as traj:`
        await graph.ainvoke(inputs)                         # no callbacks argument needed
    # traj is now complete: messages, tools, sampled tokens, reward

langchain-core's configure hook adds the active recorder to every callback manager created while
the context variable is set. Context variables are copied into each asyncio task, so rollouts run
with `asyncio.gather` each record into their own trajectory and never mix. The trajectory is
filled in when the block ends (the ledger is read once, in a batch).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar, Token
from typing import Any

from langchain_core.tracers.context import register_configure_hook

from art_core.model import Model
from art_core.recording import Recorder, recording
from art_core.trajectory import Trajectory
from art_langgraph.recorder import TrajectoryRecorder

_ACTIVE: ContextVar[TrajectoryRecorder | None] = ContextVar("art_langgraph_record", default=None)
register_configure_hook(_ACTIVE, inheritable=True)


class record:  # noqa: N801 - used like a function: `with record() as traj`
    """Record the model calls made inside the block into one `Trajectory` (sync or async).

    Takes the `TrajectoryRecorder` options (`model`, `reward`, `on_missing`, `on_empty`,
    `debug`, ...). The yielded trajectory is filled in when the block exits without an error.
    `self.recorder` is the underlying callback handler.
    """

    def __init__(self, model: Model | None = None, **options: Any) -> None:
        self.recorder = TrajectoryRecorder(model, **options)
        self._token: Token[TrajectoryRecorder | None] | None = None
        self._tools: contextlib.AbstractContextManager[Recorder] | None = None

    def _enter(self) -> Trajectory:
        if self._token is not None:
            raise RuntimeError("a record() block cannot be entered twice")
        self._token = _ACTIVE.set(self.recorder)
        self._tools = recording(self.recorder)  # tool-side recorders (MCP) report here too
        self._tools.__enter__()
        return self.recorder.trajectory

    def _exit(self) -> None:
        assert self._token is not None and self._tools is not None
        self._tools.__exit__(None, None, None)
        _ACTIVE.reset(self._token)

    def __enter__(self) -> Trajectory:
        return self._enter()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._exit()
        if exc_type is None:
            self.recorder.finish()

    async def __aenter__(self) -> Trajectory:
        return self._enter()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._exit()
        if exc_type is None:
            await self.recorder.afinish()
