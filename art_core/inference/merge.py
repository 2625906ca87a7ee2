"""Merge a LoRA checkpoint into its base model's weights, for serving without a runtime LoRA.

    W' = W + (alpha / r) * B @ A        W: [out, in]   B: [out, r]   A: [r, in]

computed in float32 and stored in the base checkpoint's dtype, or in `dtype` when the server
computes in a wider one (a bf16 checkpoint served in float32 keeps the whole of a small delta,
which bf16 would round away). Every other tensor is passed on as it is. Two consumers:

- `merged_weights` streams the merged checkpoint, tensor by tensor, into vLLM's in-place reload,
  inside vLLM's worker (art_core/inference/vllm_worker.py, `EngineConfig.serve_merged`): only the 7 MB
  adapter crosses processes, nothing is written.
- `merge_lora` writes it as a safetensors checkpoint (one output file per input file, so memory
  stays at one file's size, plus the JSON configs): a merged model to export.

Why: vLLM's CPU LoRA kernels run one small gather and einsum per adapted module per token, and
decode ~2x slower than the base model (FIELD-NOTES). Merged weights decode at the base's speed.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_PREFIX = "base_model.model."  # peft's name for the wrapped model


class MergeError(ValueError):
    """The adapter does not fit the base checkpoint (names, shapes or settings)."""


def lora_deltas(adapter_dir: str | Path) -> dict[str, tuple[Any, Any, float]]:
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
    deltas: dict[str, tuple[Any, Any, float]] = {}
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


def merged_weights(base_dir: str | Path, adapter_dir: str | Path, dtype: str | None = None
                   ) -> Iterator[tuple[str, Any]]:
    """Every tensor of the base checkpoint, (name, tensor), with the LoRA deltas added to the
    adapted ones (in `dtype` if given, else the checkpoint's), one tensor at a time.

    Everything is checked before this returns (raising `MergeError`): a consumer that loads the
    stream in place, as vLLM's reload does, never sees a bad adapter half way through."""
    deltas = lora_deltas(adapter_dir)
    files = _checked_files(Path(base_dir), deltas)
    return (item for path in files for item in _merged_file(path, deltas, dtype))


def merge_lora(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path,
               dtype: str | None = None) -> Path:
    """Write base + LoRA as a safetensors checkpoint in `out_dir` (replaced if present); the
    merged tensors in `dtype` ("float32", ...) if given, else in the checkpoint's dtype.

    Raises `MergeError` if an adapted module has no weight of the right shape in the base."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    base_dir, out_dir = Path(base_dir), Path(out_dir)
    deltas = lora_deltas(adapter_dir)
    files = _checked_files(base_dir, deltas)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for path in files:  # one output file per input file: memory stays at one file's size
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata()
            save_file(dict(_merged_file(path, deltas, dtype)), str(tmp / path.name),
                      metadata=metadata)
        for cfg in base_dir.glob("*.json"):  # config.json, generation config, shard index
            shutil.copy2(cfg, tmp / cfg.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the last good merge stays as it was
        raise
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def _checked_files(base_dir: Path, deltas: dict[str, tuple[Any, Any, float]]) -> list[Path]:
    """The base's safetensors files, once every adapted weight is found in them with the
    shape its A and B fit (read from the files' headers, no tensor is loaded)."""
    from safetensors import safe_open

    files = sorted(base_dir.glob("*.safetensors"))
    if not files:
        raise MergeError(f"{base_dir} has no safetensors weights to merge into")
    found: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name not in deltas:
                    continue
                a, b, _ = deltas[name]  # A [r, in], B [out, r]
                shape = tuple(f.get_slice(name).get_shape())
                if shape != (b.shape[0], a.shape[1]):
                    raise MergeError(f"{name}: base shape {shape} does not fit the adapter's "
                                     f"B {tuple(b.shape)} x A {tuple(a.shape)}")
                found.add(name)
    missing = sorted(set(deltas) - found)
    if missing:
        raise MergeError(f"{len(missing)} adapted modules have no weight in {base_dir}, "
                         f"e.g. {missing[0]}")
    return files


def _merged_file(path: Path, deltas: dict[str, tuple[Any, Any, float]], dtype: str | None
                 ) -> Iterator[tuple[str, Any]]:
    """One safetensors file's tensors, (name, tensor), the adapted ones merged."""
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            w = f.get_tensor(name)  # [out, in] for a linear weight
            if name in deltas:
                a, b, scale = deltas[name]  # A [r, in], B [out, r]
                out_dtype = getattr(torch, dtype) if dtype else w.dtype
                # one fused pass: W + scale * B @ A in float32, rounded once
                merged = torch.addmm(w.float(), b.float(), a.float(), alpha=scale)
                w = (stochastic_bf16(merged, seed=zlib.crc32(name.encode()))
                     if out_dtype == torch.bfloat16 else merged.to(out_dtype))
            yield name, w.contiguous()


def stochastic_bf16(x: Any, seed: int) -> Any:
    """float32 -> bfloat16, rounded up or down at random in proportion to the distance, so
    that E[result] = x. Round-to-nearest would drop every LoRA update smaller than half a bf16
    step of W (bf16 keeps 8 bits of mantissa): the served policy would stay at the base while the
    adapter learns. Seeded per tensor, so a merge is reproducible (after a restart, the same
    weights). Adds 16 random low bits to the float32 pattern and truncates them: the carry
    rounds the magnitude up with probability (dropped bits) / 2^16, for either sign."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = x.numel()
    # 16 uniform bits per weight, 4 per 64-bit draw (a draw per weight costs 2.5x as much)
    draws = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), 2**63 - 1,
                                                                  generator=g)
    noise = draws.view(torch.int16)[:n].to(torch.int32).bitwise_and_(0xFFFF).view(x.shape)
    bits = noise.add_(x.contiguous().view(torch.int32))  # in place: one temporary
    # clear the 16 low bits (0xFFFF0000 as int32). inf and the canonical nan have zero low bits
    # and stay as they are; a weight within a bf16 step of float32's max could become inf.
    return bits.bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


def write_delta(merged_dir: str | Path, target_dir: str | Path | None, out_dir: str | Path
                ) -> Path:
    """Write, in `out_dir`, the LoRA that turns the weights served merged with `merged_dir`
    back into base + `target_dir` (None: the base itself):

        W + s_k B_k A_k = (W + s_n B_n A_n) + [s_k B_k | -s_n B_n] @ [A_k ; A_n]

    a LoRA of rank r_k + r_n with scale 1 (alpha = r); for the base, [-s_n B_n] @ [A_n].
    A module adapted by only one side gets zero rows there (peft wants one rank for all).
    Computed in float32. This is how one engine serves every other name (an older step, the
    base, a second model on the base) beside the merged policy, through vLLM's runtime LoRA."""
    import torch
    from safetensors.torch import save_file

    merged = lora_deltas(merged_dir)
    target = lora_deltas(target_dir) if target_dir is not None else {}
    r_k = next((a.shape[0] for a, _, _ in target.values()), 0)
    r_n = next(a.shape[0] for a, _, _ in merged.values())
    rank = r_k + r_n
    tensors: dict[str, Any] = {}
    for name in sorted(set(merged) | set(target)):
        ref_a, ref_b, _ = target.get(name) or merged[name]
        n_in, n_out = ref_a.shape[1], ref_b.shape[0]
        parts_a, parts_b = [], []
        for side, r, sign in ((target, r_k, 1.0), (merged, r_n, -1.0)):
            if not r:
                continue
            if name in side:
                a, b, scale = side[name]  # A [r, in], B [out, r]
                parts_a.append(a.float())
                parts_b.append(b.float() * (sign * scale))
            else:
                parts_a.append(torch.zeros(r, n_in))
                parts_b.append(torch.zeros(n_out, r))
        module = _PREFIX + name[: -len(".weight")]
        tensors[module + ".lora_A.weight"] = torch.cat(parts_a, 0).contiguous()  # [rank, in]
        tensors[module + ".lora_B.weight"] = torch.cat(parts_b, 1).contiguous()  # [out, rank]
    cfg = json.loads((Path(merged_dir) / "adapter_config.json").read_text())
    cfg.update(r=rank, lora_alpha=rank, use_rslora=False, lora_dropout=0.0,
               target_modules=sorted({n.rsplit(".", 2)[-2] for n in set(merged) | set(target)}))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return out_dir
