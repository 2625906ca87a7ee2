"""`art serve`: the backend (vLLM supervisor, gateway, trainer) as one HTTP server.

One uvicorn app, one event loop:

    /v1/...      the gateway's OpenAI API for rollouts (chat/completions, completions, models)
    /art/v1/...  the control API `RemoteBackend` speaks:
        POST   /art/v1/models                                   register (TrainableModel JSON)
        GET    /art/v1/models/{project}/{name}/step             latest complete step
        POST   /art/v1/models/{project}/{name}/train            one step; NDJSON event stream
        GET    /art/v1/models/{project}/{name}/checkpoints      steps and their metrics
        DELETE /art/v1/models/{project}/{name}/checkpoints      keep latest + best by a metric
        GET    /art/v1/models/{project}/{name}/checkpoints/{step}/files[/{file}]   download
        GET    /art/v1/jobs/{job_id}                            a training job's state
    /health      liveness, the only route that needs no API key

Why it is shaped like this:
- A training step runs as a server-side asyncio task, not inside the request: the request only
  relays the task's events (NDJSON lines, a keep-alive line every few seconds so no proxy or
  client read timeout fires). A client that disconnects leaves the step to finish; the next
  call sees a consistent step. A retried request with the same `request_id` re-attaches to
  the job instead of training twice; after a server restart it gets the recorded result
  (`requests.jsonl` in the model directory).
- Operations that change a model (register, train, delete) take a per-model asyncio lock, so
  two clients training one model queue in the event loop, one step after the other.
- Read-only calls (step, checkpoint lists, downloads) list the checkpoint directory without
  side effects; temp directories of interrupted saves are removed only at registration, under
  the model lock, so a save running at the same time is never broken.
- Safety (ARCHITECTURE invariant 8): with an API key every route but /health needs
  `Authorization: Bearer <key>` (constant-time compare); bodies are capped (Content-Length
  checked before reading, and counted while streaming); names are validated before they touch
  the file system; errors are JSON `{"error": {"message", "type", "param", "code"}}` and an
  unexpected exception returns a generic message with an id, its traceback goes to the log.
- What a client may make the host load or run is the operator's choice: `--allow-base-model
  PATTERN` limits the base models (glob; none given: any), and vLLM command-line flags or a
  chat-template path from a client (`engine.extra_args`, `engine.chat_template`: they name
  server files and switches such as `--trust-remote-code`) are refused unless the server was
  started with `--allow-engine-args`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hmac
import json
import logging
import math
import os
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from art_core.backend.local import LocalBackend
from art_core.backend.remote import API_PREFIX, bind_refusal
from art_core.config import TrainConfig
from art_core.engine import EngineError
from art_core.gateway import Gateway
from art_core.model import TrainableModel, validate_name
from art_core.storage import ModelDir, append_jsonl, read_jsonl
from art_core.trajectory import TrajectoryGroup

log = logging.getLogger("art_core.server")
T = TypeVar("T")

DEFAULT_MAX_BODY_BYTES = 64 * 2**20  # a few hundred long agent trajectories; raise with --max-body-mb
PUBLIC_PATHS = frozenset({"/health"})
_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JOB_ID = re.compile(r"[0-9a-f]{32}")
_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                 409: "conflict_error", 413: "invalid_request_error",
                 422: "invalid_request_error", 503: "service_unavailable"}


# ---- errors ----------------------------------------------------------------------------------


class ApiError(Exception):
    """An error meant for the client: its message is shown as it is."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when a streamed body passes the limit (FastAPI re-raises
    HTTPExceptions untouched, so this reaches our handler as a 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the server's limit of "
                              f"{_size(limit)} (art serve --max-body-mb)")


def error_response(status: int, message: str, code: str | int | None = None,
                   param: str | None = None, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    """The OpenAI error shape, the same as the gateway's `openai_error`."""
    return JSONResponse(
        {"error": {"message": message, "type": _STATUS_TYPES.get(status, "server_error"),
                   "param": param, "code": code if code is not None else status}},
        status_code=status, headers=headers)


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def _validation_message(e: ValidationError, where: str) -> str:
    """A short, one-line account of a pydantic error (first few problems, no doc links)."""
    parts = []
    for err in e.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{where}{'.' + loc if loc else ''}: {err.get('msg')}")
    more = len(e.errors()) - 5
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


# ---- the ASGI guard: auth, body size, last-resort errors ---------------------------------------


class Guard:
    """Pure ASGI middleware (streams pass through untouched) in front of every route.

    Order matters: an unauthenticated request is refused before its body is read; a body whose
    Content-Length is over the limit is refused before it is read; a chunked body is counted
    as it arrives. An exception that escapes a route becomes a 500 with an error id.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope.get("path") not in PUBLIC_PATHS:
            given = headers.get("authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(),
                                                                      self.api_key):
                message = ("missing API key: send 'Authorization: Bearer <key>'" if not given
                           else "invalid API key")
                await error_response(401, message, "invalid_api_key",
                                     headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await error_response(400, "invalid Content-Length header")(scope, receive, send)
                return
            if int(length) > self.max_body_bytes:
                await error_response(413, BodyTooLarge(self.max_body_bytes).detail,
                                     "body_too_large")(scope, receive, send)
                return

        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as e:
            if not started:
                await error_response(413, str(e.detail), "body_too_large")(scope, receive, send)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            log.exception("unhandled error %s in %s %s", error_id, scope.get("method"),
                          scope.get("path"))
            if not started:
                await error_response(
                    500, f"internal server error (error id {error_id}; details are in the "
                    "server's log)", "internal_error")(scope, receive, send)


# ---- training jobs --------------------------------------------------------------------------


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


# ---- the server ------------------------------------------------------------------------------


class ArtServer:
    """The app and the state behind it: a `LocalBackend` whose gateway runs in this loop."""

    def __init__(self, root: str | Path = ".art", *, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, keepalive_s: float = 10.0,
                 shutdown_grace_s: float = 60.0, max_jobs_kept: int = 1000,
                 base_models: tuple[str, ...] = (), allow_engine_args: bool = False) -> None:
        self.root = Path(root).resolve()
        self.base_models = tuple(base_models)  # glob patterns; empty: any base model
        self.allow_engine_args = allow_engine_args
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        self.shutdown_grace_s = shutdown_grace_s
        self.max_jobs_kept = max_jobs_kept
        self.gateway = Gateway()
        self.backend = LocalBackend(self.root, gateway=self.gateway)
        self.models: dict[tuple[str, str], TrainableModel] = {}  # registered in this process
        self._names: dict[str, str] = {}  # served name -> its project
        self.jobs: OrderedDict[str, TrainJob] = OrderedDict()
        self._by_request: dict[tuple[str, str, str], str] = {}  # (project, name, rid) -> job
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._vocab: dict[str, int | None] = {}
        self.shutting_down = False
        self._deadline: float | None = None
        self.app = self._build_app()

    # ---- plumbing --------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="art serve", docs_url=None, redoc_url=None, openapi_url=None,
                      lifespan=self._lifespan)
        # The gateway's OpenAI routes, as they are; /health is ours (it names no paths).
        app.router.routes.extend(r for r in self.gateway.app.router.routes
                                 if isinstance(r, APIRoute) and r.path != "/health")
        self._add_routes(app)

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, e: ApiError) -> Response:
            return error_response(e.status, e.message, e.code, e.param)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, e: StarletteHTTPException) -> Response:
            detail = e.detail if isinstance(e.detail, str) else "request failed"
            if e.status_code == 404 and detail == "Not Found":
                detail = f"no route {request.method} {request.url.path}"
            code = "body_too_large" if isinstance(e, BodyTooLarge) else None
            return error_response(e.status_code, detail, code,
                                  headers=getattr(e, "headers", None))

        @app.exception_handler(RequestValidationError)
        async def _validation_error(request: Request, e: RequestValidationError) -> Response:
            first = e.errors()[0] if e.errors() else {}
            loc = ".".join(str(x) for x in first.get("loc", ()))
            return error_response(400, f"{loc}: {first.get('msg', 'invalid request')}")

        app.add_middleware(Guard, api_key=self.api_key, max_body_bytes=self.max_body_bytes)
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # Threads wait on vLLM and the trainer; the default pool (cores + 4) can run dry and
        # stall the gateway's own to_thread calls, so give the loop a larger one.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=64, thread_name_prefix="art-serve"))
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            yield
        finally:
            await self.shutdown()

    def begin_shutdown(self) -> None:
        """Refuse new training from now on; running steps get `shutdown_grace_s` to finish."""
        if not self.shutting_down:
            self.shutting_down = True
            self._deadline = time.monotonic() + self.shutdown_grace_s
            log.info("shutting down: new training requests are refused")

    async def shutdown(self) -> None:
        """Let running steps finish (within the grace period), then stop vLLM.

        A step still running after the grace period is abandoned when the process exits, which
        is safe: its groups are journaled and checkpoints are renamed into place only when
        complete, so the model's step stays the last complete one."""
        self.begin_shutdown()
        running = [t for t in self._tasks if not t.done()]
        if running:
            left = max(0.0, (self._deadline or time.monotonic()) - time.monotonic())
            log.info("waiting up to %.0f s for %d running task(s)", left, len(running))
            _, pending = await asyncio.wait(running, timeout=left)
            if pending:
                log.warning("abandoning %d training task(s) after the grace period; their "
                            "groups are journaled for replay", len(pending))
        await self.backend.close()
        await self.gateway.aclose()

    def _lock(self, project: str, name: str) -> asyncio.Lock:
        return self._locks.setdefault((project, name), asyncio.Lock())

    def _spawn(self, coro: Awaitable[T]) -> asyncio.Task[T]:
        """A task that outlives the request that started it (kept referenced until done)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _scrub(self, message: str) -> str:
        """Paths in messages are shown relative to the run directory, never absolute."""
        root = str(self.root)
        return message.replace(root + os.sep, "").replace(root, ".")

    def _client_error(self, e: BaseException, what: str) -> ApiError:
        """Map an exception from the backend to what the client may see."""
        if isinstance(e, ApiError):
            return e
        if isinstance(e, ValidationError):
            return ApiError(400, _validation_message(e, what))
        if isinstance(e, ValueError | TypeError | FloatingPointError):
            return ApiError(400, f"{what}: {self._scrub(str(e))}")
        error_id = uuid.uuid4().hex[:12]
        log.error("%s failed (error id %s)", what, error_id, exc_info=e)
        if isinstance(e, EngineError):
            first = self._scrub(str(e).splitlines()[0]) if str(e) else "engine error"
            return ApiError(503, f"{what}: the inference engine failed: {first} (error id "
                            f"{error_id}; vLLM's log is in the run directory's logs/)",
                            "engine_error")
        return ApiError(500, f"{what} failed (error id {error_id}; details are in the "
                        "server's log)", "internal_error")

    async def _json(self, request: Request) -> Any:
        raw = await request.body()
        try:
            return await asyncio.to_thread(json.loads, raw) if len(raw) > 2**20 \
                else json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None

    def _model_dir(self, project: str, name: str) -> ModelDir:
        try:
            return ModelDir(self.root, project, name)
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_name") from None

    def _existing(self, project: str, name: str) -> ModelDir:
        md = self._model_dir(project, name)
        if not md.path.is_dir():
            raise ApiError(404, f"model {project}/{name} does not exist on this server: "
                           "register it first", "model_not_found")
        return md

    @staticmethod
    def _parse_step(step: str) -> int:
        if not step.isdigit() or len(step) > 9:
            raise ApiError(400, f"invalid step {step!r}: a non-negative integer", "invalid_step")
        return int(step)

    # ---- operations ------------------------------------------------------------------------

    async def register(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object (a TrainableModel)")
        spec = {k: v for k, v in body.items() if k not in ("base_url", "api_key")}
        try:
            model = TrainableModel.model_validate(spec)
        except ValidationError as e:
            raise ApiError(400, _validation_message(e, "model")) from None
        self._check_allowed(model)
        key = (model.project, model.name)
        # The gateway serves models by name alone, so one name belongs to one project.
        owner = self._names.setdefault(model.name, model.project)
        if owner != model.project:
            raise ApiError(409, f"model name {model.name!r} is already served for project "
                           f"{owner!r}; served names are unique across projects",
                           "name_conflict")
        try:
            # a task of its own, shielded: a client that goes away does not cut it in half
            await asyncio.shield(self._spawn(self._register(model)))
        except Exception as e:
            if key not in self.models:
                self._names.pop(model.name, None)
            raise self._client_error(e, "register") from None
        steps = self._model_dir(*key).steps()
        return {"name": model.name, "project": model.project, "base_model": model.base_model,
                "step": steps[-1] if steps else 0}

    def _check_allowed(self, model: TrainableModel) -> None:
        """Refuse what the operator did not allow clients to make this host load or run."""
        if self.base_models and not any(fnmatch.fnmatchcase(model.base_model, pattern)
                                        for pattern in self.base_models):
            raise ApiError(403, f"base_model {model.base_model!r} is not allowed on this server;"
                           f" allowed: {list(self.base_models)} (art serve --allow-base-model)",
                           "base_model_not_allowed")
        engine = model.config.engine
        refused = [f for f, v in (("engine.extra_args", engine.extra_args),
                                  ("engine.chat_template", engine.chat_template)) if v]
        if refused and not self.allow_engine_args:
            raise ApiError(403, f"{' and '.join(refused)} pass vLLM flags or server file paths; "
                           "this server refuses them from clients (start it with "
                           "--allow-engine-args to allow them)", "engine_args_not_allowed")

    async def _register(self, model: TrainableModel) -> None:
        async with self._lock(model.project, model.name):
            await self.backend.register(model)
            self.models[(model.project, model.name)] = model

    def get_step(self, project: str, name: str) -> dict[str, Any]:
        md = self._existing(project, name)
        steps = md.steps()
        if not steps:
            raise ApiError(404, f"model {project}/{name} has no checkpoint: register it",
                           "model_not_found")
        return {"step": steps[-1]}

    def list_checkpoints(self, project: str, name: str) -> dict[str, Any]:
        md = self._existing(project, name)
        steps = md.steps()
        metrics: dict[int, dict[str, float]] = {}
        with contextlib.suppress(OSError, ValueError):
            for row in md.read_history():
                if isinstance(row.get("step"), int):
                    metrics[row["step"]] = {k: float(v) for k, v in row.items() if k != "step"
                                            and isinstance(v, int | float)
                                            and not isinstance(v, bool)}
        return {"latest": steps[-1] if steps else None,
                "checkpoints": [{"step": s, "metrics": metrics.get(s, {})} for s in steps]}

    async def delete_checkpoints(self, project: str, name: str, metric: str) -> dict[str, Any]:
        if not isinstance(metric, str) or not 0 < len(metric) <= 128:
            raise ApiError(400, "best_checkpoint_metric must be a metric name (1-128 chars)")
        self._existing(project, name)
        model = self.models.get((project, name)) or TrainableModel(name=name, project=project)
        async with self._lock(project, name):  # never while a step of this model is saving
            deleted = await self.backend.delete_checkpoints(model, metric)
        return {"deleted": deleted}

    def checkpoint_files(self, project: str, name: str, step: str) -> tuple[Path, list[Path]]:
        md = self._existing(project, name)
        s = self._parse_step(step)
        if s not in md.steps():
            raise ApiError(404, f"model {project}/{name} has no checkpoint {s}; steps: "
                           f"{md.steps()}", "checkpoint_not_found")
        d = md.checkpoint(s)
        files = sorted(p for p in d.iterdir() if p.is_file() and not p.is_symlink())
        return d, files

    async def start_training(self, project: str, name: str, body: Any) -> TrainJob:
        key = (project, name)
        self._model_dir(project, name)  # validates the names
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down: no new training steps",
                           "shutting_down")
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object: "
                           '{"groups": [...], "config": {...}, "request_id": "..."}')
        unknown = sorted(set(body) - {"groups", "config", "request_id"})
        if unknown:
            raise ApiError(400, f"unknown field(s) in the train request: {unknown}")
        request_id = body.get("request_id")
        if request_id is not None and (not isinstance(request_id, str)
                                       or not _REQUEST_ID.fullmatch(request_id)):
            raise ApiError(400, "request_id must be 1-64 letters, digits, '-' or '_'",
                           param="request_id")
        if request_id is not None:  # a retry of a request we have seen: re-attach
            job_id = self._by_request.get((project, name, request_id))
            if job_id is not None and job_id in self.jobs:
                return self.jobs[job_id]
            answered = await asyncio.to_thread(self._answered, project, name, request_id)
            if answered is not None:  # trained before a restart: answer, do not train again
                return self._add_job(TrainJob(uuid.uuid4().hex, project, name, request_id,
                                              status="done"), [answered])
        groups, config = await asyncio.to_thread(self._parse_groups, body)
        model = self.models.get(key)
        if model is None:
            raise ApiError(409, f"model {project}/{name} is not registered with this server "
                           "(since it started): register it first", "model_not_registered")
        await asyncio.to_thread(self._check_token_ids, groups, model)
        job = TrainJob(uuid.uuid4().hex, project, name, request_id)
        self._add_job(job, [{"event": "accepted", "job": job.id, "groups": len(groups),
                             "trajectories": sum(len(g) for g in groups)}])
        self._spawn(self._run_job(job, model, groups, config))
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
        """The result event of a train request this model's directory says was answered."""
        for row in reversed(read_jsonl(self._model_dir(project, name).requests)):
            if row.get("request_id") == request_id and isinstance(row.get("step"), int):
                return {"event": "result", "step": row["step"],
                        "metrics": row.get("metrics") or {}, "replayed": True}
        return None

    def _parse_groups(self, body: dict[str, Any]) -> tuple[list[TrajectoryGroup], TrainConfig]:
        """Validate the train request's groups and config; each problem is a 400 naming it."""
        raw_groups = body.get("groups")
        if not isinstance(raw_groups, list) or not raw_groups:
            raise ApiError(400, "'groups' must be a non-empty list of trajectory groups",
                           param="groups")
        try:
            config = TrainConfig.model_validate(body.get("config") or {})
        except ValidationError as e:
            raise ApiError(400, _validation_message(e, "config"), param="config") from None
        groups = []
        for i, g in enumerate(raw_groups):
            try:
                groups.append(TrajectoryGroup.model_validate(g))
            except ValidationError as e:
                raise ApiError(400, _validation_message(e, f"groups[{i}]"),
                               param="groups") from None
        for i, g in enumerate(groups):
            for j, t in enumerate(g.trajectories):
                if not t.trainable and not config.allow_retokenize:
                    raise ApiError(400, f"groups[{i}].trajectories[{j}] has no sampled turn (no "
                                   "token ids): nothing to train on. Record turns from the "
                                   "gateway's responses, or set config.allow_retokenize",
                                   param="groups")
        return groups, config

    def _check_token_ids(self, groups: list[TrajectoryGroup], model: TrainableModel) -> None:
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
        """The base model's embedding size, so out-of-range ids fail here and not in a CUDA
        kernel (a device-side assert ruins the process)."""
        if model.base_model not in self._vocab:
            size = None
            with contextlib.suppress(Exception):
                from art_core.base_models import resolve_base_model

                cfg = json.loads((Path(resolve_base_model(model.base_model)) / "config.json")
                                 .read_text())
                size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
            self._vocab[model.base_model] = int(size) if size else None
        return self._vocab[model.base_model]

    async def _run_job(self, job: TrainJob, model: TrainableModel,
                       groups: list[TrajectoryGroup], config: TrainConfig) -> None:
        lock = self._lock(job.project, job.name)
        try:
            if lock.locked():
                job.emit({"event": "queued", "reason": "another step of this model is running"})
            async with lock:
                job.status = "running"
                result = await self.backend.train(model, groups, config, progress=job.progress)
                if job.request_id is not None:  # before the result: a retry must find it
                    append_jsonl(self._model_dir(job.project, job.name).requests,
                                 {"request_id": job.request_id, "step": result.step,
                                  "metrics": result.metrics})
            job.status = "done"
            job.emit({"event": "result", "step": result.step, "metrics": result.metrics})
        except BaseException as e:  # noqa: B036 - the job must always end with an event
            err = self._client_error(e, f"training {job.project}/{job.name}") \
                if isinstance(e, Exception) else ApiError(503, "training was cancelled")
            job.status = "failed"
            job.emit({"event": "error", "error": {
                "message": err.message, "type": _STATUS_TYPES.get(err.status, "server_error"),
                "param": err.param, "code": err.code or err.status}})
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

    # ---- routes ----------------------------------------------------------------------------

    def _add_routes(self, app: FastAPI) -> None:
        p = API_PREFIX

        @app.get("/health")
        async def health() -> dict[str, Any]:
            engines = list(self.gateway.engines.values())
            return {"status": "shutting_down" if self.shutting_down else "ok",
                    "paused": self.gateway.paused, "in_flight": self.gateway.in_flight,
                    "engines": len(engines), "engines_running": sum(e.running for e in engines)}

        @app.post(p + "/models")
        async def register(request: Request) -> dict[str, Any]:
            return await self.register(await self._json(request))

        @app.get(p + "/models/{project}/{name}/step")
        async def get_step(project: str, name: str) -> dict[str, Any]:
            return self.get_step(project, name)

        @app.post(p + "/models/{project}/{name}/train")
        async def train(project: str, name: str, request: Request) -> Response:
            job = await self.start_training(project, name, await self._json(request))
            return StreamingResponse(job.relay(self.keepalive_s),
                                     media_type="application/x-ndjson",
                                     headers={"Cache-Control": "no-store",
                                              "X-Accel-Buffering": "no"})

        @app.get(p + "/jobs/{job_id}")
        async def get_job(job_id: str) -> dict[str, Any]:
            job = self.jobs.get(job_id) if _JOB_ID.fullmatch(job_id) else None
            if job is None:
                raise ApiError(404, f"no training job {job_id!r} (unknown or forgotten)",
                               "job_not_found")
            return job.summary()

        @app.get(p + "/models/{project}/{name}/checkpoints")
        async def list_checkpoints(project: str, name: str) -> dict[str, Any]:
            return self.list_checkpoints(project, name)

        @app.delete(p + "/models/{project}/{name}/checkpoints")
        async def delete_checkpoints(project: str, name: str,
                                     best_checkpoint_metric: str = "reward_mean"
                                     ) -> dict[str, Any]:
            return await self.delete_checkpoints(project, name, best_checkpoint_metric)

        @app.get(p + "/models/{project}/{name}/checkpoints/{step}/files")
        async def list_files(project: str, name: str, step: str) -> dict[str, Any]:
            _, files = self.checkpoint_files(project, name, step)
            return {"step": int(step),
                    "files": [{"name": f.name, "size": f.stat().st_size} for f in files]}

        @app.get(p + "/models/{project}/{name}/checkpoints/{step}/files/{filename}")
        async def get_file(project: str, name: str, step: str, filename: str) -> Response:
            try:
                validate_name(filename, "file name")
            except ValueError as e:
                raise ApiError(400, str(e), "invalid_name") from None
            d, files = self.checkpoint_files(project, name, step)
            match = [f for f in files if f.name == filename]
            if not match:
                raise ApiError(404, f"checkpoint {step} of {project}/{name} has no file "
                               f"{filename!r}; files: {[f.name for f in files]}",
                               "file_not_found")
            return FileResponse(match[0], media_type="application/octet-stream",
                                filename=filename)


# ---- running it ------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app the moment a shutdown starts (SIGTERM/SIGINT), so
    new training is refused while running steps finish."""

    def __init__(self, config: uvicorn.Config, art: ArtServer) -> None:
        super().__init__(config)
        self.art = art

    async def shutdown(self, sockets: Any = None) -> None:
        self.art.begin_shutdown()
        await super().shutdown(sockets)


def build_server(root: str | Path, *, host: str = "127.0.0.1", port: int = 7999,
                 api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 shutdown_grace_s: float = 60.0, keepalive_s: float = 10.0,
                 log_level: str = "info", base_models: tuple[str, ...] = (),
                 allow_engine_args: bool = False) -> _Server:
    """The uvicorn server for `art serve` (not started). Refuses an unsafe bind."""
    refusal = bind_refusal(host, api_key)
    if refusal:
        raise ValueError(refusal)
    art = ArtServer(root, api_key=api_key, max_body_bytes=max_body_bytes,
                    keepalive_s=keepalive_s, shutdown_grace_s=shutdown_grace_s,
                    base_models=base_models, allow_engine_args=allow_engine_args)
    config = uvicorn.Config(art.app, host=host, port=port, log_level=log_level,
                            access_log=False, lifespan="on", proxy_headers=False,
                            timeout_graceful_shutdown=max(1, math.ceil(shutdown_grace_s)))
    return _Server(config, art)


async def serve(root: str | Path = ".art", *, host: str = "127.0.0.1", port: int = 7999,
                api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                shutdown_grace_s: float = 60.0, log_level: str = "info",
                base_models: tuple[str, ...] = (), allow_engine_args: bool = False,
                idle_exit_minutes: float = 0.0) -> int:
    """Run until SIGTERM/SIGINT (or `idle_exit_minutes` without a request, if > 0); returns
    the exit status."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per vLLM call otherwise
    server = build_server(root, host=host, port=port, api_key=api_key,
                          max_body_bytes=max_body_bytes, shutdown_grace_s=shutdown_grace_s,
                          log_level=log_level, base_models=base_models,
                          allow_engine_args=allow_engine_args)
    art = server.art
    log.info("art serve: run directory %s; OpenAI API at http://%s:%d/v1; control API at "
             "%s; API key %s; body limit %s", art.root, host, port, API_PREFIX,
             "required" if art.api_key else "not set (loopback only)", _size(max_body_bytes))
    watcher = None
    if idle_exit_minutes > 0:  # art_core/idle.py says why
        from art_core.idle import ActivityTracker, exit_when_idle

        tracker = ActivityTracker(server.config.app)
        server.config.app = tracker
        busy = lambda: art.gateway.in_flight > 0 or any(  # noqa: E731
            not j.finished for j in art.jobs.values())
        watcher = asyncio.create_task(exit_when_idle(
            tracker, idle_exit_minutes, busy, lambda: setattr(server, "should_exit", True)))
    try:
        await server.serve()
    finally:
        if watcher is not None:
            watcher.cancel()
    return 0 if server.started else 1
