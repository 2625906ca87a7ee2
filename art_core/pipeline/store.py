"""What a pipeline has gathered and what became of it, on disk: a killed pipeline loses no
completed group and trains none twice.

    <run_dir>/
        groups.jsonl   {"id", "started_step", "group"}: every completed group, appended and
                       fsynced as it completes, before it can be trained
        ledger.jsonl   what became of the groups, one event per line, fsynced:
                       {"event": "train", "request_id", "groups": [ids], "policy_step"}
                           written before the step is asked for
                       {"event": "committed", "request_id", "step", "row"}
                           written when the backend has answered with the step
                       {"event": "dropped", "groups": [ids], "reason", "policy_step"}

Recovery (`PipelineStore.recover`): groups that no committed step took and none dropped are the
pool again; a "train" event without its "committed" is the pending step, to be sent again with
the same request id, so the backend answers with the step it committed before the kill instead
of training it twice (`TrainableModel.train(request_id=...)`), or trains it now. A line torn by
a kill is skipped (storage.read_jsonl): a group whose line is torn had not been trained.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_core.storage import append_jsonl, read_jsonl
from art_core.trajectory import TrajectoryGroup

log = logging.getLogger(__name__)


@dataclass
class Buffered:
    """A completed group waiting to be trained."""

    id: str
    started_step: int  # the policy step when its rollouts started
    group: TrajectoryGroup


@dataclass
class Pending:
    """A step asked for but not known to be committed: send it again with its request id."""

    request_id: str
    groups: list[Buffered]
    policy_step: int


class PipelineStore:
    """The two files of the module docstring, under `path`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.groups_file = self.path / "groups.jsonl"
        self.ledger_file = self.path / "ledger.jsonl"

    @staticmethod
    def new_group_id() -> str:
        return f"g-{uuid.uuid4().hex[:16]}"

    @staticmethod
    def new_request_id() -> str:
        return f"pipeline-{uuid.uuid4().hex}"

    def add(self, item: Buffered) -> None:
        """Record a completed group (before it is offered for training)."""
        self.path.mkdir(parents=True, exist_ok=True)
        # the group's JSON is written by pydantic, then embedded as an object
        row = {"id": item.id, "started_step": item.started_step,
               "group": json.loads(item.group.model_dump_json())}
        append_jsonl(self.groups_file, row)

    def train(self, request_id: str, items: list[Buffered], policy_step: int) -> None:
        self._event({"event": "train", "request_id": request_id,
                     "groups": [i.id for i in items], "policy_step": policy_step})

    def committed(self, request_id: str, step: int, row: dict[str, Any]) -> None:
        self._event({"event": "committed", "request_id": request_id, "step": step, "row": row})

    def dropped(self, items: list[Buffered], reason: str, policy_step: int) -> None:
        if items:
            self._event({"event": "dropped", "groups": [i.id for i in items], "reason": reason,
                         "policy_step": policy_step})

    def _event(self, event: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        append_jsonl(self.ledger_file, event)

    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.ledger_file)

    def recover(self) -> tuple[list[Buffered], Pending | None]:
        """The pool (completed groups not yet trained or dropped, oldest first) and the step
        that was asked for but not seen committed, if any."""
        groups: dict[str, Buffered] = {}
        for row in read_jsonl(self.groups_file):
            try:
                groups[row["id"]] = Buffered(row["id"], int(row["started_step"]),
                                             TrajectoryGroup.model_validate(row["group"]))
            except (KeyError, TypeError, ValueError) as e:
                log.warning("%s: a group row that cannot be read was skipped (%s)",
                            self.groups_file, e)
        taken: set[str] = set()
        asked: dict[str, dict[str, Any]] = {}  # request id -> its "train" event
        for event in self.events():
            kind = event.get("event")
            if kind == "train":
                asked[event["request_id"]] = event
            elif kind == "committed":
                done = asked.pop(event.get("request_id"), None)
                taken |= set(done["groups"] if done else [])
            elif kind == "dropped":
                taken |= set(event.get("groups") or [])
        pending = None
        if asked:  # the loop asks for one step at a time: only the last can be pending
            *older, last = asked.values()
            for event in older:  # asked again under a newer id: their groups came back
                log.warning("%s: step request %s was superseded", self.ledger_file,
                            event["request_id"])
            items = [groups[i] for i in last["groups"] if i in groups]
            pending = Pending(last["request_id"], items, int(last["policy_step"]))
            taken |= set(last["groups"])
        pool = [g for gid, g in groups.items() if gid not in taken]
        return pool, pending

    def completed_groups(self) -> int:
        """How many groups completed (trained, pooled or dropped): where a resumed run's
        scenario stream goes on."""
        return len(read_jsonl(self.groups_file))

    def rows(self) -> list[dict[str, Any]]:
        """The committed steps' rows, in order (for a summary across restarts)."""
        return [e["row"] | {"step": e["step"]} for e in self.events()
                if e.get("event") == "committed" and isinstance(e.get("row"), dict)]
