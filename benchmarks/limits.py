"""What this machine can do, measured: GEMM FLOP/s, memory bandwidth, the model's parameter
counts, and from them the limits an RL step's phases are compared with (step_profile.py,
vs_trl_agent.py).

    training tokens/s <= GEMM FLOP/s / (k x 2 x linear params)   per token forwarded; k = 3 with
                         gradient checkpointing (forward, recompute, input gradients; LoRA's own
                         gradients are negligible)
    decoding tokens/s <= min(batch x bandwidth / weight bytes, GEMM FLOP/s / (2 x linear params))
                         on the engine's threads: each engine step reads the weights once
"""

from __future__ import annotations

import re
import time
from pathlib import Path


def gemm_flops(threads: int, dtype: str, n: int = 2048, seconds: float = 1.5) -> float:
    import torch

    torch.set_num_threads(threads)
    a = torch.randn(n, n, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, dtype=getattr(torch, dtype))
    a @ b  # warm up (oneDNN picks its kernel)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def bandwidth(mib: int = 256) -> float:
    """Bytes/s moved by a 1-thread copy (read + write), the decoding engine's situation."""
    import torch

    torch.set_num_threads(1)
    x = torch.ones(mib * 2**20 // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        y.copy_(x)
        reps += 1
    return 2 * x.numel() * 4 * reps / (time.perf_counter() - t0)


def nominal_amx_flops(cores: int) -> float | None:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "amx_bf16" not in text:
        return None
    mhz = [float(m) for m in re.findall(r"cpu MHz\s*:\s*([\d.]+)", text)]
    return cores * (max(mhz) if mhz else 2000.0) * 1e6 * 1024


def model_counts(path: str) -> tuple[int, int]:
    """(parameters in linear layers incl. the lm head, all parameters) of the base model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    total = sum(p.numel() for p in model.parameters())
    return linear, total


def train_limit(gemm: float, linear: int, k: int = 3) -> float:
    """Forwarded tokens/s a forward+backward can reach at `gemm` FLOP/s (module docstring)."""
    return gemm / (k * 2 * linear)


def decode_limit(batch: int, bandwidth_bps: float, gemm_1: float, threads: int, width: int,
                 total: int, linear: int) -> float:
    """Sampled tokens/s of `batch` sequences decoding on `threads` engine threads."""
    return min(batch * bandwidth_bps * threads / (width * total), gemm_1 * threads / (2 * linear))
