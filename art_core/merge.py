"""Merge a LoRA checkpoint into its base model's weights, for serving without a runtime LoRA.

    W' = W + (alpha / r) * B @ A        W: [out, in]   B: [out, r]   A: [r, in]

computed in float32 and stored in the base checkpoint's dtype, or in `dtype` when the server
computes in a wider one (a bf16 checkpoint served in float32 keeps the whole of a small delta,
which bf16 would round away). Every other tensor is copied as it is. The output mirrors the base's safetensors files (one output file per input file, so memory
stays at one file's size) plus its JSON configs, and vLLM reloads it in place
(`VLLMEngine` with `EngineConfig.serve_merged`).

Why: vLLM's CPU LoRA kernels run one small gather and einsum per adapted module per token, and
decode ~2x slower than the base model (FIELD-NOTES). Merged weights decode at the base's speed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

_PREFIX = "base_model.model."  # peft's name for the wrapped model


class MergeError(ValueError):
    """The adapter does not fit the base checkpoint (names, shapes or settings)."""


def lora_deltas(adapter_dir: str | Path) -> dict[str, tuple[object, object, float]]:
    """{base weight name: (A [r, in], B [out, r], scale)} from a peft LoRA directory."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    try:
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
        tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise MergeError(f"{adapter_dir} is not a readable LoRA checkpoint: {e}") from None
    if cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("rank_pattern") \
            or cfg.get("alpha_pattern"):
        raise MergeError(f"{adapter_dir}: only plain LoRA (one rank and alpha) can be merged")
    scale = float(cfg["lora_alpha"]) / float(cfg["r"])
    deltas: dict[str, tuple[object, object, float]] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        b = tensors.get(module + ".lora_B.weight")
        if b is None:
            raise MergeError(f"{adapter_dir}: {key} has no matching lora_B")
        module = module[len(_PREFIX):] if module.startswith(_PREFIX) else module
        deltas[module + ".weight"] = (a, b, scale)
    if not deltas:
        raise MergeError(f"{adapter_dir} holds no LoRA weights")
    return deltas


def merge_lora(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path,
               dtype: str | None = None) -> Path:
    """Write base + LoRA as a safetensors checkpoint in `out_dir` (replaced if present); the
    merged tensors in `dtype` ("float32", ...) if given, else in the checkpoint's dtype.

    Raises `MergeError` if an adapted module has no weight of the right shape in the base."""
    from safetensors.torch import save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    deltas = lora_deltas(adapter_dir)
    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise MergeError(f"{base_dir} has no safetensors weights to merge into")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        merged: set[str] = set()
        for path in files:
            tensors, metadata = _merged_file(path, deltas, merged, dtype)
            save_file(tensors, str(tmp / path.name), metadata=metadata)
        missing = sorted(set(deltas) - merged)
        if missing:
            raise MergeError(f"{len(missing)} adapted modules have no weight in {base_dir}, "
                             f"e.g. {missing[0]}")
        for cfg in base_dir.glob("*.json"):  # config.json, generation config, shard index
            shutil.copy2(cfg, tmp / cfg.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the last good merge stays as it was
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _merged_file(path: Path, deltas: dict[str, tuple[object, object, float]],
                 merged: set[str], dtype: str | None) -> tuple[dict[str, object],
                                                             dict[str, str] | None]:
    """One safetensors file's tensors with the LoRA deltas added, and its metadata; adds the
    merged names to `merged`."""
    import torch
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            w = f.get_tensor(name)  # [out, in] for a linear weight
            if name in deltas:
                a, b, scale = deltas[name]  # A [r, in], B [out, r]
                if tuple(w.shape) != (b.shape[0], a.shape[1]):
                    raise MergeError(f"{name}: base shape {tuple(w.shape)} does not fit the "
                                     f"adapter's B {tuple(b.shape)} x A {tuple(a.shape)}")
                out_dtype = getattr(torch, dtype) if dtype else w.dtype
                w = (w.float() + scale * (b.float() @ a.float())).to(out_dtype)
                merged.add(name)
            out[name] = w.contiguous()
    return out, metadata
