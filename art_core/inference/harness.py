"""Harness rollouts: an agent program we do not own (any language, its own loop) gets an OpenAI
base URL that belongs to one rollout, and every chat completion it makes there is recorded.

    POST /v1/art/rollouts {"model": name}            -> {"id", "path"}: a new open rollout
    POST /v1/art/rollouts/{id}/v1/chat/completions    the usual chat route, recorded to it
    POST /v1/art/rollouts/{id}/finish                -> {"model", "calls"}: closes it

The harness's base URL is `<gateway>/v1/art/rollouts/{id}/v1`. Its requests are served as any
other (token in / token out, strict tools, streaming) under the rollout's model, whatever
`model` the harness names (a harness often hard-codes one). Each call keeps the request's
messages and tools, the assistant message answered (a streamed one as accumulated) and the
ledger record (the exact sampled tokens); art_core/env/harness.py turns the calls into a
Trajectory. An unknown id is answered 404, a finished one 409, so a harness that outlives its
rollout cannot add to a trajectory already trained.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from art_core.inference.completions import GatewayError

ROLLOUTS_PATH = "/art/rollouts"


@dataclass
class HarnessRollout:
    model: str
    calls: list[dict[str, Any]] = field(default_factory=list)


class HarnessRollouts:
    """The open rollouts by id, and the ids of the last `size` finished ones (for the 409)."""

    def __init__(self, size: int = 10_000) -> None:
        self.open: dict[str, HarnessRollout] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.size = size

    def start(self, model: str) -> str:
        rid = uuid.uuid4().hex
        self.open[rid] = HarnessRollout(model)
        return rid

    def get(self, rid: str) -> HarnessRollout:
        """The open rollout `rid`; GatewayError 409 if it has finished, 404 if unknown."""
        rollout = self.open.get(rid)
        if rollout is not None:
            return rollout
        if rid in self.finished:
            raise GatewayError(409, f"rollout '{rid}' has finished: its trajectory is closed; "
                               "start a new rollout for new requests")
        raise GatewayError(404, f"no rollout with id '{rid}' (start one with POST /v1"
                           f"{ROLLOUTS_PATH})")

    def finish(self, rid: str) -> HarnessRollout:
        rollout = self.get(rid)
        del self.open[rid]
        self.finished[rid] = None
        while len(self.finished) > self.size:
            self.finished.popitem(last=False)
        return rollout


def record_call(rollout: HarnessRollout, body: dict[str, Any], message: dict[str, Any],
                record: dict[str, Any]) -> None:
    """Keep one answered chat request of a harness rollout."""
    rollout.calls.append({"messages": body.get("messages"), "tools": body.get("tools"),
                          "message": {"role": "assistant", **message}, "record": record})
