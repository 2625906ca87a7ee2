"""Supervised fine-tuning of a `Trainer`'s LoRA: the model half of `model.train_sft`.

The algorithm of `sft_step(trainer, examples, config)`:

1. render: each example's conversation through the model's chat template (tools included);
   the tokens of the assistant turns to train are the targets (art_core/sft/render.py). This is
   the one place where rendering text is right: the data was not sampled by our engine, so
   there are no sampled tokens to keep (metric `rendered_examples`). An example longer than
   `max_length` is skipped and counted, or refused (`SFTConfig.over_long`).
2. for each epoch, the examples in a seeded shuffle, `batch_size` at a time; for each batch:
   a. weights: 1 / (trained tokens in the batch) on every trained token, so the loss is the
      batch's mean token cross-entropy (the usual SFT loss) however the rows are cut;
   b. rows: examples that share a prefix (system prompt, tools) packed over it
      (art_core/train/packing.py), micro-batches of `micro_batch_size` rows;
   c. loss = -sum_t w_t logp_t per micro-batch; backward (gradients accumulate);
   d. the learning rate of this update (warm-up, then the schedule), clip, one AdamW step.
3. the base rate is restored on the optimizer, so an RL step after SFT starts from its own rate
   with the moments SFT left (one optimizer for the one adapter).

Metrics: `loss` (mean token cross-entropy of the last epoch), `loss_first_epoch`, `examples`,
`skipped_over_long`, `updates`, `trained_tokens` (per epoch), `forwarded_tokens`,
`rendered_examples`, `grad_norm` (last update), `seconds`.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import TYPE_CHECKING

import torch

from art_core.config import SFTConfig, TrainConfig
from art_core.train import batch as B
from art_core.train import packing as P
from art_core.train.trainer import use_checkpointing
from art_core.trajectory import Trajectory

if TYPE_CHECKING:
    from art_core.train.trainer import Trainer


def render_examples(tokenizer: object, examples: list[Trajectory], config: SFTConfig,
                    limit: int | None) -> tuple[list[B.Sequence], int]:
    """Training sequences of `examples` (one per history that has a turn to train), and how
    many examples were skipped as longer than `limit`."""
    from art_core.sft.data import SFTDataError
    from art_core.sft.render import assistant_mask_tokens

    sequences: list[B.Sequence] = []
    skipped = 0
    for i, example in enumerate(examples):
        rendered = []
        for history in example.histories():
            tokens, mask = assistant_mask_tokens(tokenizer, history.messages, history.tools,
                                                 config.assistant_turns)
            if any(mask):
                rendered.append((tokens, mask))
        where = example.metadata.get("source", f"example {i}")
        if not rendered:
            raise SFTDataError(f"{where}: no assistant turn to train")
        longest = max(len(t) for t, _ in rendered)
        if limit is not None and longest > limit:
            if config.over_long == "error":
                raise SFTDataError(f"{where}: {longest} tokens, longer than max_length={limit} "
                                   "(SFTConfig.over_long='skip' skips such examples)")
            skipped += 1
            continue
        for tokens, mask in rendered:
            # no sampler here: old logprobs are unused by this loss (zeros keep packing open)
            sequences.append(B.Sequence(tokens, mask, [0.0] * len(tokens), 0.0, i))
    return sequences, skipped


def learning_rate(config: SFTConfig, update: int, total: int) -> float:
    """The rate of update `update` (0-based) of `total`: linear warm-up, then the schedule."""
    warmup = int(config.warmup_ratio * total)
    if update < warmup:
        return config.learning_rate * (update + 1) / warmup
    if config.schedule == "constant":
        return config.learning_rate
    progress = (update - warmup) / max(1, total - warmup)
    if config.schedule == "linear":
        return config.learning_rate * (1.0 - progress)
    return config.learning_rate * 0.5 * (1.0 + math.cos(math.pi * progress))


def sft_step(trainer: Trainer, examples: list[Trajectory], config: SFTConfig,
             limit: int | None) -> dict[str, float]:
    """Train `trainer`'s LoRA on `examples` (see the module docstring); returns the metrics."""
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    max_length = config.max_length if config.max_length is not None else limit
    sequences, skipped = render_examples(trainer.tokenizer, examples, config, max_length)
    if not sequences:
        raise ValueError(f"all {len(examples)} examples are longer than max_length="
                         f"{max_length}: nothing to train")
    by_example: dict[int, list[B.Sequence]] = {}
    for s in sequences:
        by_example.setdefault(s.traj_index, []).append(s)
    order = list(by_example)
    batches_per_epoch = math.ceil(len(order) / config.batch_size)
    total = batches_per_epoch * config.epochs

    # the shared machinery (logprob chunks, optimizer key) reads these from a TrainConfig
    shared = TrainConfig(learning_rate=config.learning_rate, weight_decay=config.weight_decay,
                         micro_batch_size=config.micro_batch_size)
    opt = trainer._ensure_optimizer(shared)
    use_bf16 = trainer.bf16_capable if config.bf16 is None else config.bf16
    # the largest micro-batch any update may hold: micro_batch_size x the longest example
    padded = config.micro_batch_size * max(len(s) for s in sequences)
    trainer._set_checkpointing(use_checkpointing(
        config.gradient_checkpointing, trainer.model.get_base_model().config, padded, use_bf16,
        trainer.device))
    trainer.model.train()
    rng = random.Random(config.seed)
    epoch_losses: list[float] = []
    forwarded = trained_tokens = 0
    grad_norm = 0.0
    update = 0
    from tqdm.auto import tqdm  # a warm start on long agent examples runs for many minutes

    bar = tqdm(total=total, desc=f"sft: {len(by_example)} examples x {config.epochs} epochs",
               unit="update")
    try:
        for _ in range(config.epochs):
            rng.shuffle(order)
            epoch_loss = epoch_tokens = 0.0
            for start in range(0, len(order), config.batch_size):
                batch_seqs = [s for i in order[start:start + config.batch_size]
                              for s in by_example[i]]
                n_tokens = sum(s.num_trained_tokens for s in batch_seqs)
                batch_seqs = [dataclasses.replace(s, token_weight=1.0 / n_tokens)
                              for s in batch_seqs]
                rows, budget = _rows(trainer, batch_seqs, config)
                forwarded += P.forwarded_tokens(rows)
                opt.zero_grad(set_to_none=True)
                batch_loss = 0.0
                for mb in B.micro_batches(rows, config.micro_batch_size, max_tokens=budget):
                    tensors = {k: v.to(trainer.device) for k, v in trainer._collate(mb).items()}
                    shifted = B.shift_for_next_token(tensors)
                    mask = shifted["loss_mask"]  # [B, T-1]
                    with trainer._autocast(use_bf16):
                        logp, _ = trainer._token_logprobs(tensors, shifted, shared)  # [B, T-1]
                    weights = shifted["token_weights"] * mask  # [B, T-1], sums to 1 per batch
                    loss = -(logp * weights).sum()
                    loss.backward()
                    batch_loss += float(loss.detach())
                for g in opt.param_groups:
                    g["lr"] = learning_rate(config, update, total)
                norm = torch.nn.utils.clip_grad_norm_(list(trainer.lora_params.values()),
                                                      config.max_grad_norm)
                grad_norm = float(norm)
                if not math.isfinite(grad_norm):
                    opt.zero_grad(set_to_none=True)
                    raise FloatingPointError(f"gradient norm is {grad_norm} at SFT update "
                                             f"{update}: not applied")
                opt.step()
                update += 1
                bar.update(1)
                bar.set_postfix(loss=f"{batch_loss:.3f}")
                epoch_loss += batch_loss * n_tokens
                epoch_tokens += n_tokens
            epoch_losses.append(epoch_loss / max(epoch_tokens, 1))
            trained_tokens = int(epoch_tokens)
    finally:
        bar.close()
        opt.zero_grad(set_to_none=True)
        for g in opt.param_groups:  # an RL step after this one starts at its own rate
            g["lr"] = config.learning_rate
        trainer.model.eval()
    seconds = time.perf_counter() - t0
    return {
        "loss": epoch_losses[-1], "loss_first_epoch": epoch_losses[0],
        "examples": len(by_example), "skipped_over_long": skipped, "updates": update,
        "trained_tokens": trained_tokens, "forwarded_tokens": forwarded,
        "rendered_examples": len(by_example), "grad_norm": grad_norm, "seconds": seconds,
        "tokens_per_second": trained_tokens * config.epochs / seconds,
    }


def _rows(trainer: Trainer, sequences: list[B.Sequence],
          config: SFTConfig) -> tuple[list[P.Row], int | None]:
    """Rows of one batch, packed over shared prefixes where the settings and attention allow."""
    longest = max(len(s) for s in sequences)
    model_config = trainer.model.get_base_model().config
    if not config.packing or not P.can_pack(model_config, longest):
        return list(sequences), None
    budget = config.micro_batch_size * longest
    return P.share_prefixes(sequences, min(budget, P.MAX_ROW_TOKENS)), budget
