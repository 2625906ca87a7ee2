"""The gateway: our OpenAI-compatible front door to vLLM that records exactly what was sampled.

For every request it (art_core/inference/completions.py)
1. resolves the model name: "<name>" -> that model's latest checkpoint, "<name>@<step>" -> that
   step (loaded on demand), a base model's name -> the base; anything else is a 404;
2. waits at the gate while a training step runs (new requests wait, they do not fail);
3. asks vLLM for sampled-token logprobs and token ids (`logprobs`, `return_token_ids`);
4. records prompt ids, completion ids, logprobs, finish reason and serving step in a bounded
   ledger keyed by response id (`GET /v1/art/completions/{id}`), for recorders whose client
   drops unknown fields (langchain-openai), and returns them as extra fields in the response.
   A streamed chat response also carries its id in each choice's `delta`, because clients that
   merge deltas into a message (langchain-openai) keep nothing else of the response id;
5. sends a chat that continues one of its answers as token ids: the earlier prompt, what was
   sampled, and the rendering of only the new messages (art_core/inference/splice.py);
6. enforces strict tool calls (a forced `tool_choice`, or `strict: true` on a function) with a
   grammar of the hermes call form and returns them as `tool_calls`
   (art_core/inference/tool_calls.py);
7. on a CPU engine, never batches a request for a LoRA adapter with one for the base weights
   (vLLM-CPU would add an adapter to the latter): they take turns
   (art_core/inference/lora_turns.py).

Nothing here blocks the event loop: every call into the engine supervisor (loads, unloads,
which take its lock, held for the whole of a restart) runs in a thread, so `/health` answers at
once whatever the engine is doing. The gate is counted: two models training at once reopen it
when the second is done.

It runs in its own thread and event loop (`GatewayServer`, art_core/inference/gateway_server.py)
so that user code which blocks its own loop (a sync LangGraph `invoke`) cannot stall inference.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from art_core.inference.completions import GatewayError, completion, openai_error
from art_core.inference.engine import EngineError, VLLMEngine
from art_core.inference.harness import ROLLOUTS_PATH, HarnessRollouts, record_call
from art_core.inference.ledger import Ledger
from art_core.inference.lora_turns import LoraTurns
from art_core.inference.policy_check import PolicyMismatch, check_served, tolerance_for
from art_core.inference.splice import Splicer
from art_core.inference.upstream import RETRY_AFTER_S
from art_core.protocol import LEDGER_PATH

__all__ = ["Gateway", "GatewayError", "Route", "ServedModel", "openai_error"]

log = logging.getLogger(__name__)


@dataclass
class ServedModel:
    """A trainable model as the gateway sees it: its engine and its checkpoints."""

    name: str
    engine: VLLMEngine
    project: str = "default"
    checkpoints: dict[int, Path] = field(default_factory=dict)
    latest: int = 0
    policy_error: str | None = None  # the last publish failed the served-policy check
    policy_tolerance: float | None = 0.1  # EngineConfig.policy_check_tolerance of the model
    keep_loaded: int = 3


@dataclass
class Route:
    engine: VLLMEngine
    upstream: str  # the name vLLM knows
    public: str  # the name we report ("name@step" or the base name)
    step: int | None


class Gateway:
    """The FastAPI app and the state behind it (engines, models, gate, ledger)."""

    def __init__(self, *, ledger_size: int = 50_000, gate_timeout_s: float = 3600.0,
                 drain_timeout_s: float = 600.0, restart_wait_s: float = 120.0) -> None:
        """`restart_wait_s`: how long a request whose engine died waits for the restart
        before it is answered 503 (vLLM restarts in 20-30 s on CPU)."""
        self.engines: dict[str, VLLMEngine] = {}
        self.models: dict[str, ServedModel] = {}
        self.ledger = Ledger(ledger_size)
        self.rollouts = HarnessRollouts()  # harness mode (harness.py)
        self.splicer = Splicer(ledger_size)
        self.turns = LoraTurns()  # CPU: adapter and base requests never batched together
        self.gate_timeout_s = gate_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.restart_wait_s = restart_wait_s
        self.in_flight = 0
        self._pausers = 0
        self._gate_open: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._client: httpx.AsyncClient | None = None
        self._load_lock: asyncio.Lock | None = None
        self.app = FastAPI(title="art gateway", docs_url=None, redoc_url=None)
        self._add_routes(self.app)

    # ---- state shared with backends (call in the gateway's loop) --------------------------

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._gate_open is None or self._idle is None:
            self._gate_open, self._idle = asyncio.Event(), asyncio.Event()
            self._gate_open.set()
            self._idle.set()
        return self._gate_open, self._idle

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=10.0),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128),
            )
        return self._client

    def add_engine(self, engine: VLLMEngine) -> None:
        self.engines[engine.served_name] = engine

    async def publish(self, name: str, engine: VLLMEngine, step: int, path: Path,
                      project: str | None = None,
                      checkpoints: dict[int, Path] | None = None,
                      tolerance: float | Literal["auto"] | None = 0.1) -> dict[str, float]:
        """Make checkpoint `step` of model `name` what "<name>" serves, and load it; the
        served-policy check's metrics. For a model served before, a load that fails (the engine
        restarting) is logged and left to the next request, which loads it on demand; for a new
        model it raises. What vLLM serves once loaded is checked against the trainer's probe
        before the name is published (art_core/inference/policy_check.py), within `tolerance`
        (the model's EngineConfig.policy_check_tolerance; "auto": by the dtype `engine`
        serves, `tolerance_for`; None: unchecked): on a mismatch the previous step keeps
        serving and `PolicyMismatch` is raised."""
        if tolerance == "auto":
            tolerance = tolerance_for(tolerance, engine.dtype)
        new = name not in self.models
        served = self.models.setdefault(name, ServedModel(name, engine, project or "default"))
        served.policy_tolerance = tolerance
        previous = None if new else served.latest
        served.checkpoints.update(checkpoints or {})
        served.checkpoints[step] = Path(path)
        metrics: dict[str, float] = {}
        try:
            await asyncio.to_thread(engine.load_adapter, f"{name}@{step}", path, latest=True)
        except EngineError as e:
            if new:
                raise
            log.warning("%s@%d is committed but not loaded yet (%s); it loads on the next "
                        "request", name, step, str(e).splitlines()[0])
        else:
            metrics = await self._check_policy(served, step, previous)
        served.latest = max(served.checkpoints)
        await asyncio.to_thread(self._unload_old, served)
        if new and engine.config.splice_turns:  # the template check, warned once (splice.py)
            await self.splicer.prepare(engine)
        return metrics

    async def _check_policy(self, served: ServedModel, step: int,
                            previous: int | None) -> dict[str, float]:
        """The served-policy check of `name@step` just loaded; on a mismatch, put the previous
        step back (re-merged if the merge replaced it), forget `step`, and raise."""
        tolerance = served.policy_tolerance
        if tolerance is None:
            return {}
        name = f"{served.name}@{step}"
        try:
            metrics = await asyncio.to_thread(check_served, served.engine, name,
                                              served.checkpoints[step], tolerance)
        except (EngineError, ValueError, OSError) as e:  # could not ask: not a mismatch
            log.warning("%s: the served-policy check could not run (%s)", name,
                        str(e).splitlines()[0])
            return {"policy_checked": 0.0}
        except PolicyMismatch as e:
            log.error("%s", e)
            served.policy_error = str(e)
            served.checkpoints.pop(step, None)
            engine = served.engine
            with contextlib.suppress(EngineError):
                if previous is not None and engine.serve_merged and engine.merged == name:
                    await asyncio.to_thread(engine.load_adapter, f"{served.name}@{previous}",
                                            served.checkpoints[previous], latest=True)
                await asyncio.to_thread(engine.unload_adapter, name)
            raise
        served.policy_error = None
        return metrics

    async def forget_checkpoints(self, name: str, steps: list[int]) -> None:
        """Stop serving `steps` of `name` (before their directories are deleted)."""
        served = self.models.get(name)
        if served is None:
            return
        gone = [s for s in steps if s != served.latest and served.checkpoints.pop(s, None)]
        for step in gone:
            await asyncio.to_thread(served.engine.unload_adapter, f"{name}@{step}")

    async def forget_model(self, name: str) -> None:
        """Serve `name` no more (a registration that failed leaves no served name)."""
        served = self.models.pop(name, None)
        if served is not None:
            for step in served.checkpoints:
                await asyncio.to_thread(served.engine.unload_adapter, f"{name}@{step}")

    def _unload_old(self, served: ServedModel) -> None:
        loaded = sorted(
            int(n.rsplit("@", 1)[1]) for n in list(served.engine.adapters)
            if n.rsplit("@", 1)[0] == served.name
        )
        for step in loaded[: max(0, len(loaded) - served.keep_loaded)]:
            if step != served.latest:
                served.engine.unload_adapter(f"{served.name}@{step}")

    async def pause(self) -> None:
        """Close the gate and wait until requests already running have finished.

        The wait is bounded (`drain_timeout_s`): a request whose client vanished must not be
        able to hold training back forever. Each pause() is matched by one resume()."""
        gate, idle = self._events()
        self._pausers += 1
        gate.clear()
        try:
            await asyncio.wait_for(idle.wait(), self.drain_timeout_s)
        except TimeoutError:
            log.warning("%d requests still running after %.0f s; training starts anyway",
                        self.in_flight, self.drain_timeout_s)

    def resume(self) -> None:
        """Open the gate once every step that paused it has resumed."""
        self._pausers = max(0, self._pausers - 1)
        if self._pausers == 0:
            self._events()[0].set()

    @property
    def paused(self) -> bool:
        return not self._events()[0].is_set()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # ---- request path (art_core/inference/completions.py) ----------------------------------

    async def resolve(self, requested: Any) -> Route:
        if not isinstance(requested, str) or not requested:
            raise GatewayError(400, "'model' is required and must be a string", "model")
        if requested in self.engines:
            engine = self.engines[requested]
            if engine.merged is None:
                return Route(engine, requested, requested, None)
            return Route(engine, await self._loaded(engine, None, None, requested), requested,
                         None)  # with merged weights, the base is a delta LoRA
        name, sep, step_s = requested.rpartition("@")
        if not sep:
            name, step_s = requested, ""
        served = self.models.get(name)
        if served is None:
            known = sorted([*self.models, *self.engines])
            raise GatewayError(404, f"The model '{requested}' does not exist. Served: {known}",
                               "model")
        if not step_s:
            step = served.latest
        elif step_s.isdigit():
            step = int(step_s)
        else:
            raise GatewayError(400, f"invalid step in model name '{requested}'", "model")
        if step not in served.checkpoints:
            raise GatewayError(404, f"The model '{name}' has no step {step}; steps: "
                               f"{sorted(served.checkpoints)}", "model")
        upstream = f"{name}@{step}"
        vllm_name = await self._loaded(served.engine, upstream, served.checkpoints[step],
                                       requested)
        return Route(served.engine, vllm_name, upstream, step)

    async def _loaded(self, engine: VLLMEngine, name: str | None, path: Path | None,
                      requested: str) -> str:
        """The name vLLM serves adapter `name` (None: the base) under, loaded first if it is
        not (unloaded, lost in a restart, or a delta from merged weights not built yet). A
        delta built here is checked before it serves (`_check_delta`)."""
        if self._load_lock is None:
            self._load_lock = asyncio.Lock()
        try:
            built = False
            if name is not None and name not in engine.adapters:
                async with self._load_lock:
                    if name not in engine.adapters:
                        await asyncio.to_thread(engine.load_adapter, name, path)
                        built = engine.merged not in (None, name)
            upstream = engine.upstream_name(name)
            if upstream is None:  # the base, beside merged weights
                async with self._load_lock:
                    if engine.upstream_name(name) is None:
                        await asyncio.to_thread(engine.load_base)
                        built = True
                upstream = engine.upstream_name(name)
            if upstream is None:
                raise EngineError("its delta from the merged weights did not load")
            if built:
                await self._check_delta(engine, name, path, requested)
            return upstream
        except EngineError as e:
            raise GatewayError(503, f"The model '{requested}' cannot be loaded right now: "
                               f"{str(e).splitlines()[0]}", "model",
                               {"Retry-After": str(RETRY_AFTER_S)}) from None

    async def _check_delta(self, engine: VLLMEngine, name: str | None, path: Path | None,
                           requested: str) -> None:
        """The served-policy check of a delta LoRA beside merged weights, the first time it
        serves after a merge (art_core/inference/policy_check.py): `name@k` against step k's
        probe, the base (`name` None) against the merged step's `base_logprobs`. Alone in vLLM
        (lora_turns.py). On a mismatch the delta is unloaded, the model's health is degraded,
        and the request is answered 500 naming it."""
        merged = engine.merged or ""
        owner = self.models.get((name or merged).rpartition("@")[0])
        checkpoint = path if name is not None else Path(engine.adapters.get(merged, ""))
        if owner is None or owner.policy_tolerance is None or checkpoint is None:
            return
        release = await self.turns.admit(engine, None)
        try:
            metrics = await asyncio.to_thread(
                check_served, engine, name or engine.served_name, checkpoint,
                owner.policy_tolerance, base=name is None, next_token=False,
                after=f"not served (a delta from the merged {merged}); asked as '{requested}'")
        except (EngineError, ValueError, OSError) as e:  # could not ask: not a mismatch
            log.warning("%s: the served-policy check could not run (%s)", requested,
                        str(e).splitlines()[0])
            return
        except PolicyMismatch as e:
            log.error("%s", e)
            owner.policy_error = str(e)
            with contextlib.suppress(EngineError):
                await asyncio.to_thread(engine.unload_adapter, name or engine.served_name)
            raise GatewayError(500, str(e), "model") from None
        finally:
            release()
        log.info("%s: the delta beside %s passed the served-policy check (mean |diff| %.1e)",
                 name or engine.served_name, merged, metrics.get("policy_check_mean_abs", 0.0))

    async def wait_gate(self) -> None:
        gate, _ = self._events()
        if not gate.is_set():
            try:
                await asyncio.wait_for(gate.wait(), self.gate_timeout_s)
            except TimeoutError:
                raise GatewayError(503, f"the model is training and did not resume within "
                                   f"{self.gate_timeout_s:.0f} s") from None

    def enter(self) -> None:
        self.in_flight += 1
        self._events()[1].clear()

    def exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._events()[1].set()

    # ---- health ----------------------------------------------------------------------------

    async def health(self, deep: bool = False) -> dict[str, Any]:
        """Liveness at once (never waits for an engine). `deep`: also ask each engine which
        adapters it really has, and list the served names that would not answer."""
        out: dict[str, Any] = {
            "status": "ok", "paused": self.paused, "in_flight": self.in_flight,
            "engines": {n: e.state for n, e in self.engines.items()}}
        if deep:
            unservable = []
            for served in self.models.values():
                name = f"{served.name}@{served.latest}"
                engine = served.engine
                if engine.state != "ready":
                    unservable.append(f"{served.name} ({name}: engine {engine.state})")
                elif not engine.serve_merged:
                    loaded = await asyncio.to_thread(engine.served_adapters, 1.0)
                    if loaded is not None and name not in loaded and \
                            not served.checkpoints[served.latest].is_dir():
                        unservable.append(f"{served.name} ({name}: checkpoint missing)")
            out["unservable"] = unservable
            if unservable:
                out["status"] = "degraded"
        mismatched = {m.name: m.policy_error for m in self.models.values() if m.policy_error}
        if mismatched:  # the last publish served something other than what was trained
            out["policy_mismatch"] = mismatched
            out["status"] = "degraded"
        return out

    def _add_routes(self, app: FastAPI) -> None:
        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await completion(self, request, "/v1/chat/completions")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await completion(self, request, "/v1/completions")

        @app.post("/v1" + ROLLOUTS_PATH)
        async def start_rollout(request: Request) -> Response:
            """A harness rollout of {"model": name}: its id and its base URL's path."""
            try:
                name = (await request.json()).get("model")
            except (ValueError, AttributeError, RecursionError):
                name = None
            if not isinstance(name, str) or not name:
                return openai_error(400, 'body must be {"model": "<served model name>"}',
                                    param="model")
            try:
                await self.resolve(name)  # a typo fails here, not in the harness
            except GatewayError as e:
                return openai_error(e.status, e.message, param=e.param, headers=e.headers)
            rid = self.rollouts.start(name)
            return JSONResponse({"id": rid, "path": f"/v1{ROLLOUTS_PATH}/{rid}/v1"})

        @app.post("/v1" + ROLLOUTS_PATH + "/{rid}/v1/chat/completions")
        async def rollout_chat(rid: str, request: Request) -> Response:
            try:
                rollout = self.rollouts.get(rid)
            except GatewayError as e:
                return openai_error(e.status, e.message)
            return await completion(
                self, request, "/v1/chat/completions", model=rollout.model,
                on_recorded=lambda body, message, rec: record_call(rollout, body, message, rec))

        @app.post("/v1" + ROLLOUTS_PATH + "/{rid}/finish")
        async def finish_rollout(rid: str) -> Response:
            try:
                rollout = self.rollouts.finish(rid)
            except GatewayError as e:
                return openai_error(e.status, e.message)
            return JSONResponse({"model": rollout.model, "calls": rollout.calls})

        @app.get("/v1/models")
        async def list_models() -> dict[str, Any]:
            now = int(time.time())
            data = [{"id": n, "object": "model", "created": now, "owned_by": "art"}
                    for n in self.engines]
            for m in self.models.values():
                data.append({"id": m.name, "object": "model", "created": now,
                             "owned_by": "art", "root": m.engine.served_name,
                             "art_step": m.latest})
                data += [{"id": f"{m.name}@{s}", "object": "model", "created": now,
                          "owned_by": "art", "root": m.engine.served_name, "art_step": s}
                         for s in sorted(m.checkpoints)]
            return {"object": "list", "data": data}

        @app.get("/v1" + LEDGER_PATH + "/{completion_id}")
        async def get_completion(completion_id: str) -> Response:
            rec = self.ledger.get(completion_id)
            if rec is None:
                return openai_error(404, f"no recorded completion with id '{completion_id}' "
                                    "(unknown, or evicted from the ledger)")
            return JSONResponse(rec)

        @app.post("/v1" + LEDGER_PATH + "/batch")
        async def get_completions(request: Request) -> Response:
            """Many ledger records in one round trip: {"ids": [...]} -> {"data", "missing"}."""
            try:
                ids = (await request.json()).get("ids")
            except (ValueError, AttributeError, RecursionError):
                ids = None
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                return openai_error(400, "body must be {\"ids\": [completion ids]}", param="ids")
            found = {i: self.ledger[i] for i in ids if i in self.ledger}
            return JSONResponse({"data": list(found.values()),
                                 "missing": [i for i in ids if i not in found]})

        @app.get("/health")
        async def health(deep: int = 0) -> dict[str, Any]:
            return await self.health(bool(deep))
