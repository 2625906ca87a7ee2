"""Training steps of `art serve` (art_core/serve/app.py) as server-side jobs.

    POST /art/v1/models/{project}/{name}/train   -> start_training -> a TrainJob, its events relayed
                                                  ("kind": "sft": a supervised step, SFTConfig)
    GET  /art/v1/jobs/{job_id}                   -> TrainJob.summary

- A step runs as an asyncio task of the server, not inside the request: the request only relays
  the job's events (NDJSON lines, a keep-alive line every few seconds so no proxy or client read
  timeout fires). A client that disconnects leaves the step to finish.
- A retried request with the same `request_id` re-attaches to its job instead of training twice;
  after a server restart it gets the recorded result: the request id is committed with the
  step it produced (`checkpoints/<step>/step.json`, one atomic rename with the adapter), so a
  step is never trained twice, wherever the server was killed. Two posts of one id at the
  same moment become one job: the id is claimed before the first await.
- Steps of one model take the model's lock: two clients training one model queue, one step
  after the other.
- The request is checked before anything trains or is journaled: groups and config validate,
  rewards are finite, every trajectory has a sampled turn (unless config.allow_retokenize),
  every token id is inside the base model's vocabulary (an out-of-range id would fail in a
  CUDA kernel and ruin the process) and no sequence is longer than the trainer's limit.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from art_core.backend.local import LocalBackend
from art_core.base_models import base_model_limits
from art_core.config import SFTConfig, TrainConfig
from art_core.inference.policy_check import replayed_mismatch
from art_core.model import TrainableModel
from art_core.protocol import REQUEST_ID, error_body
from art_core.serve.errors import ApiError, validation_message
from art_core.storage import ModelDir
from art_core.trajectory import TrajectoryGroup, check_groups, check_sequence_lengths

JOB_ID = re.compile(r"[0-9a-f]{32}")


@dataclass
class TrainJob:
    """One training step running on the server, and the events it has produced so far."""

    id: str
    project: str
    name: str
    request_id: str | None
    events: list[dict[str, Any]] = field(default_factory=list)
    status: str = "queued"  # queued | running | done | failed
    created: float = field(default_factory=time.time)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.status in ("done", "failed")

    def emit(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # wakes every relay waiting on the old event

    def progress(self, event: dict[str, Any]) -> None:
        """LocalBackend.train's progress callback (called in the event loop)."""
        self.emit({"event": "progress", **event})

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "project": self.project, "name": self.name,
                               "status": self.status, "created": self.created,
                               "events": self.events[-50:]}
        last = self.events[-1] if self.events else {}
        if last.get("event") in ("result", "error"):
            out[last["event"]] = {k: v for k, v in last.items() if k != "event"}
        return out

    async def relay(self, keepalive_s: float) -> AsyncIterator[bytes]:
        """All events so far, then new ones as they come; a keep-alive line when quiet.
        Cancelled when the client goes away; the job itself goes on."""
        i = 0
        while True:
            changed = self._changed  # taken before reading: no event can slip between
            while i < len(self.events):
                yield (json.dumps(self.events[i], separators=(",", ":")) + "\n").encode()
                i += 1
            if self.finished:
                return
            try:
                await asyncio.wait_for(changed.wait(), keepalive_s)
            except TimeoutError:
                yield b'{"event":"keepalive"}\n'


class TrainingJobs:
    """A part of `ArtServer`, which sets up the state below and provides the helpers
    `_lock`, `_spawn`, `_model_dir` and `_client_error`."""

    backend: LocalBackend
    models: dict[tuple[str, str], TrainableModel]  # registered in this process
    jobs: OrderedDict[str, TrainJob]
    _by_request: dict[tuple[str, str, str], str]  # (project, name, rid) -> job
    _starting: dict[tuple[str, str, str], asyncio.Future[TrainJob]]  # claimed, not yet a job
    _vocab: dict[str, int | None]  # base model -> its vocabulary size, if known
    max_jobs_kept: int
    shutting_down: bool
    _lock: Callable[[str, str], asyncio.Lock]
    _spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]]
    _model_dir: Callable[[str, str], ModelDir]
    _client_error: Callable[[BaseException, str], ApiError]

    async def start_training(self, project: str, name: str, body: Any) -> TrainJob:
        self._model_dir(project, name)  # validates the names
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down: no new training steps",
                           "shutting_down")
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object: "
                           '{"groups": [...], "config": {...}, "request_id": "..."}')
        unknown = sorted(set(body) - {"groups", "config", "request_id", "keep_serving",
                                      "kind"})
        if unknown:
            raise ApiError(400, f"unknown field(s) in the train request: {unknown}")
        request_id = body.get("request_id")
        if request_id is not None and (not isinstance(request_id, str)
                                       or not REQUEST_ID.fullmatch(request_id)):
            raise ApiError(400, "request_id must be 1-64 letters, digits, '-' or '_'",
                           param="request_id")
        if body.get("kind", "rl") not in ("rl", "sft"):
            raise ApiError(400, "kind must be 'rl' (a GRPO step) or 'sft'", param="kind")
        if body.get("keep_serving") not in (None, True, False):
            raise ApiError(400, "keep_serving must be true, false or null",
                           param="keep_serving")
        if request_id is None:
            return await self._new_job(project, name, None, body)
        rkey = (project, name, request_id)
        job_id = self._by_request.get(rkey)
        if job_id is not None and job_id in self.jobs:  # a retry of a request seen: re-attach
            return self.jobs[job_id]
        starting = self._starting.get(rkey)
        if starting is not None:  # the same id posted twice at once: one job
            return await asyncio.shield(starting)
        starting = self._starting[rkey] = asyncio.get_running_loop().create_future()
        try:
            answered = await asyncio.to_thread(self._answered, project, name, request_id)
            if answered is not None:  # trained before a restart: answer, do not train again
                async with self._lock(project, name):  # no step of this model appending now
                    md = self._model_dir(project, name)
                    await asyncio.to_thread(md.repair_history)
                    row = await asyncio.to_thread(md.history_row, answered["step"])
                mismatch = replayed_mismatch(name, answered["step"], row)
                if mismatch is not None:  # the first answer was this error: so is the retry's
                    err = self._client_error(mismatch, f"training {project}/{name}")
                    answered = {"event": "error", **error_body(err.status, err.message,
                                                               err.code, err.param)}
                job = self._add_job(TrainJob(uuid.uuid4().hex, project, name, request_id,
                                             status="failed" if mismatch else "done"),
                                    [answered])
            else:
                job = await self._new_job(project, name, request_id, body)
        except BaseException as e:
            starting.set_exception(e)
            starting.exception()  # retrieved: no "never retrieved" warning if nobody waits
            raise
        finally:
            self._starting.pop(rkey, None)
        starting.set_result(job)
        return job

    async def _new_job(self, project: str, name: str, request_id: str | None,
                       body: dict[str, Any]) -> TrainJob:
        key = (project, name)
        groups, config = await asyncio.to_thread(self._parse_groups, body)
        model = self.models.get(key)
        if model is None:
            raise ApiError(409, f"model {project}/{name} is not registered with this server "
                           "(since it started): register it first", "model_not_registered")
        if isinstance(config, TrainConfig):  # SFT examples are rendered and checked in the step
            await asyncio.to_thread(self._check_token_ids, groups, model, config)
        job = TrainJob(uuid.uuid4().hex, project, name, request_id)
        self._add_job(job, [{"event": "accepted", "job": job.id, "groups": len(groups),
                             "trajectories": sum(len(g) for g in groups)}])
        self._spawn(self._run_job(job, model, groups, config, body.get("keep_serving")))
        return job

    def _add_job(self, job: TrainJob, events: list[dict[str, Any]]) -> TrainJob:
        self.jobs[job.id] = job
        if job.request_id is not None:
            self._by_request[(job.project, job.name, job.request_id)] = job.id
        self._forget_old_jobs()
        for event in events:
            job.emit(event)
        return job

    def _answered(self, project: str, name: str, request_id: str) -> dict[str, Any] | None:
        """The result event of a train request whose step this model's directory holds."""
        rec = self._model_dir(project, name).answered(request_id)
        if rec is None:
            return None
        return {"event": "result", "step": rec["step"], "metrics": rec.get("metrics") or {},
                "replayed": True}

    def _parse_groups(self, body: dict[str, Any], train: bool = True
                      ) -> tuple[list[TrajectoryGroup], TrainConfig | SFTConfig]:
        """Validate the request's groups and config; each problem is a 400 naming it. Groups
        only logged (`train=False`) and SFT examples need no sampled turns."""
        raw_groups = body.get("groups")
        if not isinstance(raw_groups, list) or not raw_groups:
            raise ApiError(400, "'groups' must be a non-empty list of trajectory groups",
                           param="groups")
        sft = body.get("kind") == "sft"
        train = train and not sft
        try:
            config: TrainConfig | SFTConfig = (SFTConfig if sft else TrainConfig).model_validate(
                body.get("config") or {})
        except ValidationError as e:
            raise ApiError(400, validation_message(e, "config"), param="config") from None
        groups = []
        for i, g in enumerate(raw_groups):
            try:
                groups.append(TrajectoryGroup.model_validate(g))
            except ValidationError as e:
                raise ApiError(400, validation_message(e, f"groups[{i}]"),
                               param="groups") from None
        try:
            check_groups(groups)  # finite rewards, named
        except ValueError as e:
            raise ApiError(400, str(e), param="groups") from None
        for i, g in enumerate(groups if train else []):
            for j, t in enumerate(g.trajectories):
                if not t.trainable and not getattr(config, "allow_retokenize", False):
                    raise ApiError(400, f"groups[{i}].trajectories[{j}] has no sampled turn (no "
                                   "token ids): nothing to train on. Record turns from the "
                                   "gateway's responses, or set config.allow_retokenize",
                                   param="groups")
        return groups, config

    async def log_groups(self, project: str, name: str, body: Any) -> dict[str, Any]:
        """`model.log(groups, split)` of a RemoteBackend: record groups not trained on (e.g.
        validation) at the model's current step, as LocalBackend.log does."""
        self._model_dir(project, name)  # validates the names
        if not isinstance(body, dict) or sorted(set(body) - {"groups", "split"}):
            raise ApiError(400, 'request body must be {"groups": [...], "split": "val"}')
        split = body.get("split", "val")
        if not isinstance(split, str):
            raise ApiError(400, "split must be a name such as 'val'", param="split")
        groups, _ = await asyncio.to_thread(self._parse_groups, {"groups": body.get("groups")},
                                            False)
        model = self.models.get((project, name))
        if model is None:
            raise ApiError(409, f"model {project}/{name} is not registered with this server "
                           "(since it started): register it first", "model_not_registered")
        try:
            await self.backend.log(model, groups, split=split)
        except ValueError as e:  # the split's name ("train" is train's own)
            raise ApiError(400, str(e), param="split") from None
        return {"logged": len(groups), "split": split, "step": self.get_step(project, name)["step"]}

    def _check_token_ids(self, groups: list[TrajectoryGroup], model: TrainableModel,
                         config: TrainConfig) -> None:
        try:
            check_sequence_lengths(groups, self.backend.sequence_limit(model, config))
        except ValueError as e:
            raise ApiError(400, str(e), param="groups") from None
        vocab = self._vocab_size(model)
        for i, g in enumerate(groups):
            for j, t in enumerate(g.trajectories):
                where = f"groups[{i}].trajectories[{j}]"
                for h in t.histories():
                    for turn in h.turns:
                        ids = turn.prompt_token_ids + turn.completion_token_ids
                        bad = [x for x in ids if x < 0 or (vocab is not None and x >= vocab)]
                        if bad:
                            size = f" of {vocab} tokens" if vocab is not None else ""
                            raise ApiError(400, f"{where}: token id {bad[0]} is outside the "
                                           f"model's vocabulary{size}", param="groups")

    def _vocab_size(self, model: TrainableModel) -> int | None:
        """The base model's vocabulary, so out-of-range ids fail here and not in a CUDA
        kernel (a device-side assert ruins the process); for a hub id too (its cached
        config)."""
        if model.base_model not in self._vocab:
            self._vocab[model.base_model] = base_model_limits(model.base_model).vocab_size
        return self._vocab[model.base_model]

    async def _run_job(self, job: TrainJob, model: TrainableModel,
                       groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig,
                       keep_serving: bool | None = None) -> None:
        lock = self._lock(job.project, job.name)
        try:
            if lock.locked():
                job.emit({"event": "queued", "reason": "another step of this model is running"})
            async with lock:
                job.status = "running"
                # the request id is committed with the step: a retry finds it
                if isinstance(config, SFTConfig):
                    result = await self.backend.train_sft(model, groups, config,
                                                          progress=job.progress,
                                                          request_id=job.request_id)
                else:
                    result = await self.backend.train(model, groups, config,
                                                      progress=job.progress,
                                                      request_id=job.request_id,
                                                      keep_serving=keep_serving)
            job.status = "done"
            job.emit({"event": "result", "step": result.step, "metrics": result.metrics})
        except BaseException as e:  # noqa: B036 - the job must always end with an event
            err = self._client_error(e, f"training {job.project}/{job.name}") \
                if isinstance(e, Exception) else ApiError(503, "training was cancelled")
            job.status = "failed"
            job.emit({"event": "error", **error_body(err.status, err.message, err.code,
                                                      err.param)})
            if not isinstance(e, Exception):
                raise

    def _forget_old_jobs(self) -> None:
        while len(self.jobs) > self.max_jobs_kept:
            old_id = next(iter(self.jobs))
            if not self.jobs[old_id].finished:
                break
            old = self.jobs.pop(old_id)
            if old.request_id is not None:
                self._by_request.pop((old.project, old.name, old.request_id), None)
