"""art_langgraph: make an existing LangGraph agent trainable with one callback.

    recorder = TrajectoryRecorder(reward=lambda state: ...)
    state = await graph.ainvoke(inputs, config={"callbacks": [recorder]})
    trajectory = await recorder.afinish()

or, with no change to the graph's call at all:

    async with record(reward=...) as trajectory:
        await graph.ainvoke(inputs)

Every chat-model call is recorded (subgraphs included) with the exact tokens the engine sampled,
read from the art gateway's ledger. `init_chat_model(model)` gives a ChatOpenAI pointed at a
trainable model; any ChatOpenAI pointed at the gateway records just as well.

Importing this package does not import LangChain; the first use of a name does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "TrajectoryRecorder": "art_langgraph.recorder",
    "NothingRecordedError": "art_langgraph.recorder",
    "NoSampledTokensError": "art_langgraph.recorder",
    "record": "art_langgraph.context",
    "init_chat_model": "art_langgraph.chat_model",
}

if TYPE_CHECKING:
    from art_langgraph.chat_model import init_chat_model
    from art_langgraph.context import record
    from art_langgraph.recorder import (
        NoSampledTokensError,
        NothingRecordedError,
        TrajectoryRecorder,
    )


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'art_langgraph' has no attribute {name!r}")


__all__ = [
    "NoSampledTokensError",
    "NothingRecordedError",
    "TrajectoryRecorder",
    "init_chat_model",
    "record",
]
