"""`RemoteBackend`: the `LocalBackend` interface over HTTP, talking to `art serve`.

    backend = LocalBackend(".art")                                  # train on this machine
    backend = RemoteBackend("http://gpu-host:7999", api_key="...")  # train on a server

It needs only the base install (pydantic, openai, httpx, tqdm): no torch, vLLM or FastAPI.
Rollouts go straight to the server's OpenAI API (`model.openai_client()` points at
`<server>/v1` with the API key); the control calls go to `<server>/art/v1/...` (see
art_core/serve/app.py for the routes).

Training streams NDJSON events (one per phase, keep-alive lines while the step runs), shown as
a tqdm bar. Each train call carries a `request_id`: if the connection drops, the call is sent
again with the same id, for up to `retry_deadline_s` (long enough for a server restart: vLLM
alone takes 20-30 s to start), and the server re-attaches it to the step already running, or
answers with the step it committed before a restart, instead of training twice. If the server
restarted and forgot a model this client registered, it is registered again; a model this
client never registered (a typo) is an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel, Field

from art_core.config import SFTConfig, TrainConfig
from art_core.model import Endpoint, TrainableModel, TrainResult, validate_name
from art_core.protocol import API_PREFIX, REQUEST_ID, TRAIN_PHASES, is_loopback_host
from art_core.trajectory import Trajectory, TrajectoryGroup, check_groups

DEFAULT_URL = "http://127.0.0.1:7999"
log = logging.getLogger(__name__)


class RemoteBackendError(RuntimeError):
    """The server refused or failed a call; `status` is the HTTP status (None: unreachable)."""

    def __init__(self, message: str, status: int | None = None, type_: str | None = None,
                 code: str | int | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.code = message, status, type_, code


class CheckpointInfo(BaseModel):
    """One complete checkpoint on the server and the metrics of the step that produced it."""

    step: int
    metrics: dict[str, float] = Field(default_factory=dict)


class _Retry(Exception):
    """A transport failure after which the same request may safely be sent again."""


class RemoteBackend:
    """A client of `art serve` with the same methods as `LocalBackend`."""

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, *,
                 timeout: float = 60.0, retry_deadline_s: float = 600.0,
                 progress_bar: bool | None = None) -> None:
        """`api_key` defaults to $ART_API_KEY. `retry_deadline_s`: how long a training call
        keeps retrying a server it lost (a restart with a large model can take minutes).
        `progress_bar`: None shows the training bar only on a terminal (tqdm's rule), True
        always, False never."""
        url = base_url.strip().rstrip("/")
        url = url.removesuffix("/v1")  # the OpenAI URL was given: the server is one up
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must be an http(s) URL like {DEFAULT_URL}, got "
                             f"{base_url!r}")
        self.base_url = url
        self.api_key = api_key if api_key is not None else (os.environ.get("ART_API_KEY")
                                                             or None)
        if self.api_key and parts.scheme == "http" and not is_loopback_host(parts.hostname):
            warnings.warn(f"sending the API key in clear text to {parts.hostname} over plain "
                          "http: use https (e.g. a TLS proxy) or an SSH tunnel", stacklevel=2)
        self.timeout = timeout
        if retry_deadline_s < 0:
            raise ValueError(f"retry_deadline_s must be >= 0, got {retry_deadline_s}")
        self.retry_deadline_s = retry_deadline_s
        self.progress_bar = progress_bar
        self._registered: set[tuple[str, str]] = set()  # by this client, in this process
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None

    # ---- plumbing --------------------------------------------------------------------------

    @property
    def client(self) -> httpx.AsyncClient:
        """One connection pool per event loop (a client cannot move between loops)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(
                base_url=self.base_url, headers=headers,
                timeout=httpx.Timeout(self.timeout, connect=10.0))
            self._client_loop = loop
        return self._client

    def _path(self, model: TrainableModel, *rest: str) -> str:
        parts = [quote(model.project, safe=""), quote(model.name, safe=""), *rest]
        return f"{API_PREFIX}/models/" + "/".join(parts)

    @staticmethod
    def _error(r: httpx.Response) -> RemoteBackendError:
        try:
            err = r.json()["error"]
            return RemoteBackendError(str(err["message"]), r.status_code, err.get("type"),
                                      err.get("code"))
        except (ValueError, KeyError, TypeError):
            return RemoteBackendError(f"HTTP {r.status_code}: {r.text[:500]}", r.status_code)

    def _unreachable(self, e: httpx.HTTPError) -> RemoteBackendError:
        return RemoteBackendError(f"cannot reach the art server at {self.base_url} "
                                  f"({type(e).__name__}: {e}); is `art serve` running?")

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = await self.client.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise self._unreachable(e) from e
        if r.status_code >= 400:
            raise self._error(r)
        return r.json()

    async def health(self) -> dict[str, Any]:
        """The server's /health (needs no key)."""
        return await self._call("GET", "/health")

    # ---- the Backend interface -------------------------------------------------------------

    async def register(self, model: TrainableModel) -> Endpoint:
        """Register the model on the server (it starts vLLM for the base model if needed, which
        can take minutes); returns the server's OpenAI endpoint."""
        body = model.model_dump(mode="json", include={"name", "project", "base_model",
                                                      "config"})
        wait = max(600.0, model.config.engine.startup_timeout_s + 300.0)
        await self._call("POST", f"{API_PREFIX}/models", json=body,
                         timeout=httpx.Timeout(wait, connect=10.0))
        self._registered.add((model.project, model.name))
        return Endpoint(base_url=f"{self.base_url}/v1", api_key=self.api_key)

    async def get_step(self, model: TrainableModel) -> int:
        """The latest complete checkpoint step on the server."""
        return int((await self._call("GET", self._path(model, "step")))["step"])

    async def train(self, model: TrainableModel, groups: list[TrajectoryGroup],
                    config: TrainConfig | None = None, *,
                    progress: Callable[[dict[str, Any]], None] | None = None,
                    request_id: str | None = None,
                    keep_serving: bool | None = None) -> TrainResult:
        """One GRPO step on the server; returns the new step and its metrics.

        `progress`, like LocalBackend's, gets one {"phase", "step", ...} dict per phase.
        `request_id` (default: a new one): the same id sent again, by this call's retries or
        by a restarted caller, gets the step it committed instead of a second one.
        `keep_serving`: as LocalBackend.train's (None: the server decides)."""
        groups = check_groups(groups)
        request_id = _request_id(request_id)
        content = await asyncio.to_thread(_train_body, groups, config, request_id,
                                          keep_serving)
        return await self._train_request(model, content, progress)

    async def train_sft(self, model: TrainableModel,
                        data: list[Trajectory | TrajectoryGroup] | str | Path,
                        config: SFTConfig | None = None, *,
                        progress: Callable[[dict[str, Any]], None] | None = None,
                        request_id: str | None = None) -> TrainResult:
        """One supervised step on the server (LocalBackend.train_sft there). A JSONL path is
        read and checked here, so a bad line is refused before anything is sent; retries
        and `request_id` as in `train`."""
        from art_core.sft.data import as_trajectories

        examples = await asyncio.to_thread(as_trajectories, data)
        request_id = _request_id(request_id)
        content = await asyncio.to_thread(
            _train_body, [TrajectoryGroup(trajectories=examples)], config or SFTConfig(),
            request_id)
        return await self._train_request(model, content, progress)

    async def _train_request(self, model: TrainableModel, content: bytes,
                             progress: Callable[[dict[str, Any]], None] | None
                             ) -> TrainResult:
        """Post a train request, retrying the same request id until the retry deadline."""
        from tqdm.auto import tqdm

        bar = tqdm(total=len(TRAIN_PHASES), desc=f"train {model.name}", unit="phase",
                   disable=None if self.progress_bar is None else not self.progress_bar,
                   bar_format="{desc}: {n}/{total} {bar} {elapsed} {postfix}")
        attempts, reregistered, lost = 0, False, False
        deadline = time.monotonic() + self.retry_deadline_s
        mine = (model.project, model.name) in self._registered
        try:
            while True:
                try:
                    if lost and mine and not reregistered:
                        # the server may have restarted and forgotten the model (and the
                        # step may be answered from disk without it): serve it again first
                        await self._reregister(model)
                        reregistered = True
                    return await self._train_once(model, content, bar, progress)
                except _Retry as e:
                    lost = True
                    attempts += 1
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise RemoteBackendError(
                            f"training request to {self.base_url} failed {attempts} times over "
                            f"{self.retry_deadline_s:.0f} s (RemoteBackend.retry_deadline_s): "
                            f"{e}") from None
                    bar.set_postfix_str(f"server lost ({e}); retrying for {left:.0f} s more")
                    if attempts == 1:
                        log.warning("training %s: lost the server at %s (%s); retrying the "
                                    "same request for up to %.0f s", model.name, self.base_url,
                                    e, left)
                    await asyncio.sleep(min(2.0 ** (attempts - 1), 10.0, left))
                except RemoteBackendError as e:
                    if e.code != "model_not_registered" or reregistered:
                        raise
                    if not mine:
                        raise RemoteBackendError(
                            f"{e.message} (this client never registered "
                            f"{model.project}/{model.name}: await model.register(backend) "
                            "first; is the name spelled right?)", e.status, e.type,
                            e.code) from None
                    reregistered = True  # the server restarted: register again, then retry
                    bar.set_postfix_str("the server restarted: registering again")
                    await self.register(model)
        finally:
            bar.close()

    async def _reregister(self, model: TrainableModel) -> None:
        """`register` again, as a retryable step: a server that is not back yet is a _Retry."""
        try:
            await self.register(model)
        except RemoteBackendError as e:
            if e.status is None:  # unreachable: still restarting
                raise _Retry(e.message) from None
            raise

    async def _train_once(self, model: TrainableModel, content: bytes, bar: Any,
                          progress: Callable[[dict[str, Any]], None] | None) -> TrainResult:
        # read timeout: the server writes a keep-alive line every few seconds while it trains
        timeout = httpx.Timeout(connect=10.0, read=max(120.0, self.timeout), write=600.0,
                                pool=60.0)
        try:
            async with self.client.stream(
                    "POST", self._path(model, "train"), content=content, timeout=timeout,
                    headers={"Content-Type": "application/json"}) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise self._error(r)
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind = event.get("event")
                    if kind == "progress":
                        phase = event.get("phase")
                        if phase in TRAIN_PHASES:  # absolute, so a replay after a retry is exact
                            bar.n = TRAIN_PHASES.index(phase) + 1
                        bar.set_postfix_str(f"step {event.get('step')}: {phase}")
                        if progress is not None:
                            progress({k: v for k, v in event.items() if k != "event"})
                    elif kind == "queued":
                        bar.set_postfix_str("queued behind another step of this model")
                    elif kind == "keepalive":
                        bar.refresh()
                    elif kind == "result":
                        bar.n = bar.total
                        bar.refresh()
                        return TrainResult(step=event["step"], metrics=event.get("metrics", {}))
                    elif kind == "error":
                        err = event.get("error") or {}
                        raise RemoteBackendError(str(err.get("message", "training failed")),
                                                 None, err.get("type"), err.get("code"))
        except (httpx.TransportError, httpx.RemoteProtocolError) as e:
            raise _Retry(f"{type(e).__name__}: {e}") from e
        raise _Retry("the server closed the stream before the step's result")

    async def log(self, model: TrainableModel, groups: list[TrajectoryGroup],
                  split: str = "val") -> None:
        """Record groups not trained on (e.g. validation) at the model's current step, on the
        server (its run directory and loggers), as LocalBackend.log does."""
        if split == "train":
            raise ValueError("train groups are logged by train(); use another split, e.g. 'val'")
        groups = check_groups(groups)
        body = ('{"groups":[' + ",".join(g.model_dump_json() for g in groups) + '],"split":'
                + json.dumps(split) + "}").encode()
        await self._call("POST", self._path(model, "log"), content=body,
                         headers={"Content-Type": "application/json"})

    async def delete_checkpoints(self, model: TrainableModel,
                                 best_checkpoint_metric: str = "reward_mean") -> list[int]:
        """Delete all checkpoints but the latest and the best by `best_checkpoint_metric`;
        returns the deleted steps."""
        data = await self._call("DELETE", self._path(model, "checkpoints"),
                                params={"best_checkpoint_metric": best_checkpoint_metric})
        return [int(s) for s in data["deleted"]]

    async def list_checkpoints(self, model: TrainableModel) -> list[CheckpointInfo]:
        """The model's complete checkpoints on the server, oldest first."""
        data = await self._call("GET", self._path(model, "checkpoints"))
        return [CheckpointInfo.model_validate(c) for c in data["checkpoints"]]

    async def download_checkpoint(self, model: TrainableModel, step: int | None,
                                  dest_dir: str | Path) -> Path:
        """Copy checkpoint `step` (None: the latest) into `dest_dir`: a peft adapter directory
        (adapter_config.json, adapter_model.safetensors) to load with peft or vLLM."""
        if step is None:
            step = await self.get_step(model)
        listing = await self._call("GET", self._path(model, "checkpoints", str(step), "files"))
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        for f in listing["files"]:
            name = validate_name(str(f["name"]), "file name")  # a name from the wire: no paths
            part = dest / f".{name}.part"
            try:
                async with self.client.stream(
                        "GET", self._path(model, "checkpoints", str(step), "files", name),
                        timeout=httpx.Timeout(self.timeout, connect=10.0, read=300.0)) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        raise self._error(r)
                    with part.open("wb") as out:
                        async for chunk in r.aiter_bytes(1 << 20):
                            out.write(chunk)
            except httpx.HTTPError as e:
                part.unlink(missing_ok=True)
                raise self._unreachable(e) from e
            size = part.stat().st_size
            if size != f.get("size", size):
                part.unlink(missing_ok=True)
                raise RemoteBackendError(f"download of {name} was cut short: {size} of "
                                         f"{f['size']} bytes")
            part.replace(dest / name)
        return dest

    async def close(self) -> None:
        """Close the connections. The server and its models keep running."""
        if self._client is not None:
            with contextlib.suppress(RuntimeError):  # its loop may be gone already
                await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> RemoteBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _request_id(request_id: str | None) -> str:
    """The caller's request id, checked, or a new one."""
    if request_id is None:
        return uuid.uuid4().hex
    if not REQUEST_ID.fullmatch(request_id):
        raise ValueError(f"request_id must be 1-64 letters, digits, '-' or '_', got "
                         f"{request_id!r}")
    return request_id


def _train_body(groups: list[TrajectoryGroup], config: TrainConfig | SFTConfig | None,
                request_id: str, keep_serving: bool | None = None) -> bytes:
    """The train request's JSON, built from pydantic's own serializer (fast, exact floats).
    An SFTConfig makes it an SFT step (`"kind": "sft"`)."""
    cfg = config.model_dump_json() if config is not None else "null"
    serving = "" if keep_serving is None else ',"keep_serving":' + json.dumps(keep_serving)
    kind = ',"kind":"sft"' if isinstance(config, SFTConfig) else ""
    return ('{"groups":[' + ",".join(g.model_dump_json() for g in groups) + '],"config":'
            + cfg + ',"request_id":' + json.dumps(request_id) + serving + kind
            + "}").encode()
