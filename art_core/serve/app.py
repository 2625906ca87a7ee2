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

The parts, one concern each:
    art_core/serve/app.py          the app, its routes and shutdown; the uvicorn server (`serve`)
    art_core/serve/models.py   register, latest step, checkpoint lists, deletion, downloads
    art_core/serve/jobs.py     training steps as jobs: TrainJob, its event relay, retries
    art_core/serve/errors.py   ApiError and validation messages
    art_core/inference/guard.py  (below serve and backend, shared with LocalBackend's gateway):
                               API key, body size, last-resort errors (ASGI middleware)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import math
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from art_core.backend.local import LocalBackend
from art_core.inference.engine import EngineError
from art_core.inference.gateway import Gateway
from art_core.inference.guard import (
    DEFAULT_MAX_BODY_BYTES,
    BodyTooLarge,
    Guard,
    check_bind,
    error_response,
    size_text,
)
from art_core.inference.policy_check import PolicyMismatch
from art_core.model import TrainableModel, validate_name
from art_core.protocol import API_PREFIX
from art_core.serve.errors import ApiError, validation_message
from art_core.serve.jobs import JOB_ID, TrainingJobs, TrainJob
from art_core.serve.models import ModelOperations
from art_core.storage import ModelDir

log = logging.getLogger("art_core.serve.app")
T = TypeVar("T")

STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG, errno.EACCES,
                  errno.EPERM, errno.EIO}
"""OS errors of a full or unwritable disk: answered 507 with what the OS said."""



# ---- the server ------------------------------------------------------------------------------


class ArtServer(ModelOperations, TrainingJobs):
    """The app and the state behind it: a `LocalBackend` whose gateway runs in this loop.

    The model operations are in art_core/serve/models.py, the training jobs in
    art_core/serve/jobs.py; the app, its routes, its shutdown and the helpers they share
    are here."""

    def __init__(self, root: str | Path = ".art", *, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, keepalive_s: float = 10.0,
                 shutdown_grace_s: float = 60.0, max_jobs_kept: int = 1000,
                 base_models: tuple[str, ...] = (), allow_engine_args: bool = False,
                 train_processes: int = 1) -> None:
        self.root = Path(root).resolve()
        self.base_models = tuple(base_models)  # glob patterns; empty: any base model
        self.allow_engine_args = allow_engine_args
        self.api_key = api_key or None
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        self.shutdown_grace_s = shutdown_grace_s
        self.max_jobs_kept = max_jobs_kept
        self.gateway = Gateway()
        self.backend = LocalBackend(self.root, gateway=self.gateway,
                                    train_processes=train_processes)
        self.models: dict[tuple[str, str], TrainableModel] = {}  # registered in this process
        self._names: dict[str, str] = {}  # served name -> its project
        self.jobs: OrderedDict[str, TrainJob] = OrderedDict()
        self._by_request: dict[tuple[str, str, str], str] = {}  # (project, name, rid) -> job
        self._starting: dict[tuple[str, str, str], asyncio.Future[TrainJob]] = {}
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
            return ApiError(400, validation_message(e, what))
        if isinstance(e, ValueError | TypeError | FloatingPointError):
            return ApiError(400, f"{what}: {self._scrub(str(e))}")
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            where = f" ({self._scrub(e.filename)})" if isinstance(e.filename, str) else ""
            return ApiError(507, f"{what}: the server could not write the step to its disk: "
                            f"{e.strerror or e}{where}. Nothing was committed; free space (or "
                            "fix the directory) and send the step again", "insufficient_storage")
        if isinstance(e, PolicyMismatch):  # committed, not published: the client must know
            return ApiError(500, f"{what}: {self._scrub(str(e))}", "policy_mismatch")
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
        except RecursionError:
            raise ApiError(400, "request body is nested too deeply to decode") from None
        except ValueError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}") from None

    def _model_dir(self, project: str, name: str) -> ModelDir:
        try:
            return ModelDir(self.root, project, name)
        except ValueError as e:
            raise ApiError(400, str(e), "invalid_name") from None


    # ---- routes ----------------------------------------------------------------------------

    def _add_routes(self, app: FastAPI) -> None:
        p = API_PREFIX

        @app.get("/health")
        async def health(deep: int = 0) -> dict[str, Any]:
            """Answers at once, whatever the engine is doing (it only reads state); `deep=1`
            also lists the served names that would not answer."""
            out = await self.gateway.health(bool(deep))
            engines = list(self.gateway.engines.values())
            out["engines_running"] = sum(e.state == "ready" for e in engines)
            if self.shutting_down:
                out["status"] = "shutting_down"
            return out

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

        @app.post(p + "/models/{project}/{name}/log")
        async def log_groups(project: str, name: str, request: Request) -> dict[str, Any]:
            return await self.log_groups(project, name, await self._json(request))

        @app.get(p + "/jobs/{job_id}")
        async def get_job(job_id: str) -> dict[str, Any]:
            job = self.jobs.get(job_id) if JOB_ID.fullmatch(job_id) else None
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
                 allow_engine_args: bool = False, train_processes: int = 1) -> _Server:
    """The uvicorn server for `art serve` (not started). Refuses an unsafe bind.
    `train_processes`: see `LocalBackend` (1: train in this process)."""
    check_bind(host, api_key)
    art = ArtServer(root, api_key=api_key, max_body_bytes=max_body_bytes,
                    keepalive_s=keepalive_s, shutdown_grace_s=shutdown_grace_s,
                    base_models=base_models, allow_engine_args=allow_engine_args,
                    train_processes=train_processes)
    config = uvicorn.Config(art.app, host=host, port=port, log_level=log_level,
                            access_log=False, lifespan="on", proxy_headers=False,
                            timeout_graceful_shutdown=max(1, math.ceil(shutdown_grace_s)))
    return _Server(config, art)


async def serve(root: str | Path = ".art", *, host: str = "127.0.0.1", port: int = 7999,
                api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                shutdown_grace_s: float = 60.0, log_level: str = "info",
                base_models: tuple[str, ...] = (), allow_engine_args: bool = False,
                idle_exit_minutes: float = 0.0, train_processes: int = 1) -> int:
    """Run until SIGTERM/SIGINT (or `idle_exit_minutes` without a request, if > 0); returns
    the exit status."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per vLLM call otherwise
    server = build_server(root, host=host, port=port, api_key=api_key,
                          max_body_bytes=max_body_bytes, shutdown_grace_s=shutdown_grace_s,
                          log_level=log_level, base_models=base_models,
                          allow_engine_args=allow_engine_args,
                          train_processes=train_processes)
    art = server.art
    log.info("art serve: run directory %s; OpenAI API at http://%s:%d/v1; control API at "
             "%s; API key %s; body limit %s", art.root, host, port, API_PREFIX,
             "required" if art.api_key else "not set (loopback only)", size_text(max_body_bytes))
    watcher = None
    if idle_exit_minutes > 0:  # art_core/serve/idle.py says why
        from art_core.serve.idle import ActivityTracker, exit_when_idle

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
