"""One GRPO step on a peft LoRA adapter: the model half of training.

The algorithm of `Trainer.step(groups, config)`:

1. advantages: A = (reward - group mean) / group std; zero-variance groups are dropped and
   counted (advantages.compute_advantages). Or, with `advantage="teacher"` (on-policy distillation),
   per token A_t = teacher logprob - sampler logprob of each sampled token, every trajectory
   kept (advantages.teacher_advantages): the same loss then pulls the student towards the teacher.
   Or, with `advantage="turn"`, per turn: its return-to-go against the other trajectories of
   the group at the same turn (credit.turn_advantages), given to each of its tokens.
2. sequences: the exact token ids the engine sampled, masked to the sampled completion tokens,
   with the sampler's logprobs as the old policy (batch.build_all_sequences); weights so every
   trajectory counts the same (batch.with_token_weights); sequences that share a prompt packed
   into one row so it is forwarded once (packing.share_prefixes).
3. for each micro-batch: hidden states of the LoRA model -> logprobs of the targets, a chunk of
   positions at a time (loss.chunked_token_logprobs); optionally the same with the adapter
   disabled as the KL reference; grpo_loss; backward (gradients accumulate over micro-batches).
4. clip the gradient norm, one AdamW step. The caller saves the adapter (`save_adapter`).

If no group has signal, steps 3-4 are skipped: the step still advances (invariant 7).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from art_core.config import LoraConfig, TrainConfig
from art_core.host import cpu_supports_bf16
from art_core.sft.render import assistant_mask_tokens
from art_core.train import advantages as A
from art_core.train import batch as B
from art_core.train import packing as P
from art_core.train.credit import turn_advantages
from art_core.train.loss import chunked_token_logprobs, grpo_loss
from art_core.trajectory import History, TrajectoryGroup

log = logging.getLogger(__name__)

CHECKPOINT_ABOVE_BYTES = 2 * 10**9
"""'auto' gradient checkpointing recomputes on a CPU only when a micro-batch's activations
would exceed this: the race's step (1,427 forwarded tokens, 1.3 GB) keeps them and runs 22%
faster; 8k-token BFCL multi-turn rows (~7 GB) recompute, beside vLLM on a 24 GB machine."""


def activation_bytes(model_config: Any, tokens: int, bf16: bool) -> int | None:
    """Activations autograd keeps for `tokens` forwarded tokens without checkpointing, estimated
    from the model's shape: per layer and token ~10 values of the hidden size (attention inputs,
    norms, residuals, LoRA's) and ~6 of the MLP's. Calibrated on SmolLM2-135M in bf16: 1.31 GB
    measured for 1,427 tokens, 1.28 estimated. None: a config without those sizes."""
    layers = getattr(model_config, "num_hidden_layers", None)
    hidden = getattr(model_config, "hidden_size", None)
    if not layers or not hidden:
        return None
    inner = getattr(model_config, "intermediate_size", None) or 4 * hidden
    return tokens * layers * (10 * hidden + 6 * inner) * (2 if bf16 else 4)


def use_checkpointing(setting: bool | str, model_config: Any, padded_tokens: int, bf16: bool,
                      device: torch.device) -> bool:
    """Whether a step whose largest micro-batch is `padded_tokens` (rows x longest) recomputes
    activations in backward: `setting` itself, or for 'auto' whether a CPU would hold more than
    `CHECKPOINT_ABOVE_BYTES` of them (on a GPU, whose memory vLLM shares, always)."""
    if setting != "auto":
        return bool(setting)
    if device.type != "cpu":
        return True
    estimate = activation_bytes(model_config, padded_tokens, bf16)
    return estimate is None or estimate > CHECKPOINT_ABOVE_BYTES


class Trainer:
    """A base model with one LoRA adapter and its optimizer, kept in memory across steps."""

    def __init__(self, base_model: str, lora: LoraConfig, device: str | None = None) -> None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.bf16_capable = (
            torch.cuda.is_bf16_supported() if self.device.type == "cuda" else cpu_supports_bf16()
        )
        self.tokenizer = AutoTokenizer.from_pretrained(base_model)
        # Frozen base weights in bf16 where supported (half the memory); LoRA weights stay fp32.
        dtype = torch.bfloat16 if self.bf16_capable else torch.float32
        # safetensors only (invariant 8): a pickle checkpoint can run code when loaded
        base = AutoModelForCausalLM.from_pretrained(
            base_model, dtype=dtype, use_safetensors=True).to(self.device)
        base.config.use_cache = False
        peft_config = PeftLoraConfig(
            r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(base, peft_config)
        # the attention kernel the model runs: the 4-D mask of packed rows takes its form
        self.attention: str | None = getattr(base.config, "_attn_implementation", None)
        self.lora_params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        self.optimizer: torch.optim.AdamW | None = None
        self._optimizer_key: tuple[float, float] | None = None
        self._checkpointing: bool | None = None  # gradient checkpointing, once set by a step
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.tokenizer.eos_token_id or 0

    # ---- adapter files ---------------------------------------------------------------------

    def save_adapter(self, out_dir: Path) -> None:
        """A standard peft adapter directory (adapter_config.json + safetensors)."""
        self.model.save_pretrained(out_dir, safe_serialization=True)

    def save_probe(self, out_dir: Path) -> None:
        """The served-policy check's manifest (art_core/train/probe.py): the probe's token ids
        and this adapter's logprobs of them, in `out_dir/probe.json`."""
        from art_core.train.probe import (
            next_prompt,
            next_token,
            probe_logprobs,
            probe_token_ids,
            write_probe,
        )

        ids = probe_token_ids(self.tokenizer)
        trained = probe_logprobs(self.model, ids, self.device)
        with self.model.disable_adapter():
            base = probe_logprobs(self.model, ids, self.device)
        long = next_prompt(ids)
        write_probe(out_dir, ids, trained, base_logprobs=base, next_ids=long,
                    next_=next_token(self.model, long, self.device))

    def load_adapter(self, adapter_dir: Path) -> None:
        from peft import set_peft_model_state_dict

        state = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(self.model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"adapter {adapter_dir} does not fit this model: {unexpected[:3]}")

    def save_optimizer(self, path: Path, checkpoint: int) -> None:
        """AdamW moments as safetensors (weights load from safetensors only, invariant 8),
        tagged with the checkpoint they belong to, in one atomic file."""
        if self.optimizer is None:
            return
        tensors: dict[str, torch.Tensor] = {}
        steps = 0
        for name, p in self.lora_params.items():
            st = self.optimizer.state.get(p)
            if st:
                tensors[f"{name}.exp_avg"] = st["exp_avg"].detach().cpu().contiguous()
                tensors[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().contiguous()
                steps = int(st["step"])
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"step": str(steps), "checkpoint": str(checkpoint)})
        tmp.replace(path)

    def load_optimizer(self, path: Path, config: TrainConfig, checkpoint: int) -> bool:
        """Restore the moments saved with `checkpoint`; returns whether it did. Moments of any
        other checkpoint (a run killed between saving the adapter and the optimizer) are left
        out: AdamW starts fresh, which is safe, where stale moments would not be."""
        if not path.exists():
            return False
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("checkpoint") != str(checkpoint):
                log.info("optimizer state in %s is for checkpoint %s, not %d: starting fresh",
                         path, meta.get("checkpoint"), checkpoint)
                return False
            opt = self._ensure_optimizer(config)
            steps = int(meta.get("step", "0"))
            keys = set(f.keys())
            for name, p in self.lora_params.items():
                if f"{name}.exp_avg" in keys:
                    opt.state[p] = {
                        "step": torch.tensor(float(steps)),
                        "exp_avg": f.get_tensor(f"{name}.exp_avg").to(p.device),
                        "exp_avg_sq": f.get_tensor(f"{name}.exp_avg_sq").to(p.device),
                    }
        return True

    def _ensure_optimizer(self, config: TrainConfig) -> torch.optim.AdamW:
        key = (config.learning_rate, config.weight_decay)
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(
                list(self.lora_params.values()), lr=config.learning_rate,
                weight_decay=config.weight_decay, betas=(0.9, 0.999), eps=1e-8,
            )
        elif key != self._optimizer_key:
            for g in self.optimizer.param_groups:  # keep the moments, change the rates
                g["lr"], g["weight_decay"] = key
        self._optimizer_key = key
        return self.optimizer

    # ---- the step ------------------------------------------------------------------------------

    def step(self, groups: list[TrajectoryGroup], config: TrainConfig) -> dict[str, float]:
        """One GRPO step on `groups`; returns its metrics. See the module docstring."""
        t0 = time.perf_counter()
        torch.manual_seed(config.seed)
        teacher = config.advantage == "teacher"
        per_token = None
        if teacher:
            scored, stats = A.teacher_advantages(groups)
        elif config.advantage == "turn":
            scored, stats, per_token = turn_advantages(groups)
        else:
            scored, stats = A.compute_advantages(groups, config.scale_rewards)
        retokenize = self._retokenize if config.allow_retokenize else None
        sequences, seq_metrics = B.build_all_sequences(scored, retokenize=retokenize,
                                                       teacher=teacher, token_advantages=per_token)
        metrics: dict[str, float] = {**stats, **seq_metrics}
        opt = self._ensure_optimizer(config)
        opt.zero_grad(set_to_none=True)
        if not sequences:
            log.warning("no group has reward variance: nothing to learn; the step still advances")
            metrics.update(loss=0.0, grad_norm=0.0, seconds=time.perf_counter() - t0)
            return metrics

        gspo = config.loss == "gspo"
        sequences = B.with_token_weights(sequences, per_sequence=gspo)
        sequences = self._local_share(sequences)  # all of them, unless one rank of several
        low, high = config.clip_bounds()
        use_bf16 = self.bf16_capable if config.bf16 is None else config.bf16
        rows, budget = self._rows(sequences, config)
        batches = B.micro_batches(rows, config.micro_batch_size, max_tokens=budget)
        padded = max(len(mb) * len(mb[0]) for mb in batches)  # longest first in each
        checkpointing = use_checkpointing(config.gradient_checkpointing,
                                          self.model.get_base_model().config, padded, use_bf16,
                                          self.device)
        self._set_checkpointing(checkpointing)
        self.model.train()
        metrics.update(forwarded_tokens=P.forwarded_tokens(rows),
                       packed_rows=sum(isinstance(r, P.Packed) for r in rows),
                       checkpointing=float(checkpointing))
        sums: dict[str, float] = {}
        trained = 0
        for mb in batches:
            batch = {k: v.to(self.device) for k, v in self._collate(mb).items()}
            shifted = B.shift_for_next_token(batch)
            mask = shifted["loss_mask"]  # [B, T-1]
            with self._autocast(use_bf16):
                logp, entropy = self._token_logprobs(batch, shifted, config)  # [B, T-1] x2
                ref = None
                if config.kl_coef > 0:
                    with torch.no_grad(), self.model.disable_adapter():
                        ref, _ = self._token_logprobs(batch, shifted, config)
            # Rows re-rendered through the template have no sampler logprobs, and tokens a
            # tool-call grammar chose (NaN) only the masked distribution's: ratio 1 on both.
            sampler = shifted["old_logprobs"]  # [B, T-1]
            known = batch["has_old_logprobs"][:, None] & ~torch.isnan(sampler)
            old = torch.where(known, sampler, logp.detach())
            loss, m = grpo_loss(
                logp, old, shifted["advantages"], mask, loss=config.loss,
                epsilon_low=low, epsilon_high=high, ref_logprobs=ref,
                kl_coef=config.kl_coef, token_weights=shifted["token_weights"],
                tis_cap=config.tis_cap,
            )
            loss.backward()  # micro-batch losses add up to the step's loss (weights sum to 1)
            n = int(mask.sum())
            trained += n
            m["entropy"] = float((entropy * mask).sum() / max(n, 1))
            for k, v in m.items():  # token-weighted means over micro-batches; loss is a sum
                sums[k] = sums.get(k, 0.0) + (v if k == "loss" else v * n)

        sums, trained = self._reduce_across_ranks(sums, trained)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            list(self.lora_params.values()), config.max_grad_norm)
        if not math.isfinite(float(grad_norm)):
            opt.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {float(grad_norm)}: step not applied")
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.model.eval()
        for k, v in sums.items():
            metrics[k] = v if k == "loss" else v / max(trained, 1)
        metrics.update(grad_norm=float(grad_norm), trained_tokens=trained,
                       seconds=time.perf_counter() - t0)
        metrics["tokens_per_second"] = trained / metrics["seconds"]
        return metrics

    def _rows(self, sequences: list[B.Sequence],
              config: TrainConfig) -> tuple[list[P.Row], int | None]:
        """The rows to train, shared prefixes packed where the settings and attention allow
        (art_core/train/packing.py), and the token budget of a micro-batch (None: unbounded)."""
        longest = max(len(s) for s in sequences)
        model_config = self.model.get_base_model().config
        if (not config.pack_shared_prefix or config.loss == "gspo"
                or not P.can_pack(model_config, longest)):
            return list(sequences), None
        budget = config.micro_batch_size * longest
        return P.share_prefixes(sequences, min(budget, P.MAX_ROW_TOKENS)), budget

    def _collate(self, rows: list[P.Row]) -> dict[str, torch.Tensor]:
        if not any(isinstance(r, P.Packed) for r in rows):
            return B.collate(rows, self.pad_id)  # the 2-D mask keeps sdpa's causal kernel
        batch = P.collate(rows, self.pad_id)
        batch["attention_mask"] = P.mask_for(batch["attention_mask"], self.attention)
        return batch

    # ---- hooks for data-parallel training (art_core/train/distributed.py) -------------------

    def _local_share(self, sequences: list[B.Sequence]) -> list[B.Sequence]:
        """The sequences this process trains: all of them in a single process."""
        return sequences

    def _set_checkpointing(self, on: bool) -> None:
        """Gradient checkpointing on or off, changed only when the setting changes: each
        enable adds one more forward hook to the embeddings (enable_input_require_grads, so
        that checkpointed blocks see inputs that require grad with the base frozen)."""
        if on == self._checkpointing:
            return
        if on:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.model.gradient_checkpointing_disable()
            self.model.disable_input_require_grads()
        self._checkpointing = on

    def _reduce_across_ranks(self, sums: dict[str, float],
                             trained: int) -> tuple[dict[str, float], int]:
        """Combine gradients and metric sums of all ranks: nothing to do in one process."""
        return sums, trained

    def _autocast(self, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        if not enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _token_logprobs(self, batch: dict[str, torch.Tensor], shifted: dict[str, torch.Tensor],
                        config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs [B, T-1] of the targets under the current model, vocab in chunks."""
        inner = self.model.get_base_model()
        out = inner.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch.get("position_ids"))
        hidden = out.last_hidden_state[:, :-1]  # [B, T-1, H] predicts tokens 1..T-1
        return chunked_token_logprobs(
            hidden, inner.get_output_embeddings().weight, shifted["target_ids"],
            config.logprob_chunk_size, positions=shifted["loss_mask"],
            keep_bytes=config.logprob_keep_mb << 20,
        )

    # ---- the opt-in fallback ---------------------------------------------------------------

    def _retokenize(self, history: History) -> Iterator[dict[str, Any]]:
        """Render a history without sampled tokens through the chat template (invariant 1's
        counted, warned fallback): assistant turns are trained where each rendered prefix
        extends the previous one; the sampler's logprobs are unknown (ratio 1)."""
        tokens, mask = assistant_mask_tokens(self.tokenizer, history.messages, history.tools,
                                             skip_mismatched=True)
        if any(mask):
            yield {"token_ids": tokens, "mask": mask}
