"""The GRPO policy loss: a small pure function of tensors (ARCHITECTURE invariant 6).

The algorithm, for every trained token t of sequence b (mask[b, t] is True):

    r     = exp(logp - old)                     trainer / sampler probability of the token
    A     = advantages[b]                       group-relative advantage of b's trajectory
                                                (advantages[b, t] where a row packs several)
    ppo   loss_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
                   PPO clipped surrogate (Schulman et al. 2017); eps_high > eps_low is DAPO's
                   "clip-higher". A clipped token gets no gradient.
    cispo loss_t = -sg[clip(r, 1 - eps_low, 1 + eps_high)] A logp
                   CISPO (MiniMax-M1, 2025): the importance WEIGHT is clipped and detached, the
                   gradient of logp itself is never cut, so every token keeps a gradient.
    dppo  loss_t = -sg[min(r, C)] A logp   where the token stayed in the trust region, else 0
                   DPPO-Binary-TV (Qiu et al., "Rethinking the Trust Region in LLM RL", 2026;
                   verl's dppo_tv): the region is |p - p_old| of the sampled token's probability
                   (a one-token total variation), not the ratio: p - p_old <= eps_high when A > 0,
                   p - p_old >= -eps_low when A <= 0. A rare token's ratio can swing by 10x while
                   its probability moves by 0.001; PPO cuts its gradient, DPPO does not.
                   C = DPPO_RATIO_CAP bounds the importance weight (verl's clip_ratio_c).
    gspo  s_b    = exp(mean over b's trained tokens of (logp - old))     one ratio per sequence
          s_bt   = sg[s_b] exp(logp_t - sg[logp_t])   value s_b, gradient s_b * d logp_t
          loss_t = -min(s_bt A, clip(s_bt, 1 - eps_low, 1 + eps_high) A)
                   GSPO-token (Zheng et al., Qwen 2025): the sequence ratio decides clipping for
                   the whole sequence, the gradient still flows per token.
    kl    loss_t += kl_coef (exp(ref - logp) - (ref - logp) - 1)
                   k3 estimator of KL(policy || reference) (Schulman, "Approximating KL", 2020):
                   unbiased, always >= 0. Optional: off unless ref_logprobs are given.

    tis   (tis_cap set) the trust region is measured against the trainer's own logprob at the
          start of the step, sg[logp], and the sampler/trainer mismatch is corrected by a
          truncated importance weight instead (token-level TIS, Yao et al. 2025, "Your Efficient
          RL Framework Secretly Brings You Off-Policy RL Training"; on by default in TRL 1.x):
              loss_t = w_t * loss_t(old = sg[logp]),   w_t = sg[min(exp(logp - old), tis_cap)]
          Our trainer takes one optimizer step per call, so sg[logp] IS the policy before the
          step: every ratio of the trust region is exactly 1 (ppo and gspo clip nothing, dppo
          masks nothing) and each of them becomes the truncated-IS policy gradient
          -w_t A d logp, i.e. CISPO's gradient with no lower bound and cap tis_cap.

    loss = sum over b, t of token_weights[b, t] * loss_t

What the ratio compares: `logp` is the trainer's logprob of the token under the model's own
(unconstrained) distribution at the sampling temperature; `old` is the sampler's logprob of it,
the same quantity as vLLM computed it. Where a tool-call grammar chose the token, vLLM reports
the logprob of the masked, renormalised distribution (even in its raw-logprobs mode), which is
not the model's: measured ratio 0.73 on a strict call at step 0. The trainer passes its own
detached logprob as `old` there (ratio 1; art_core/train/batch.py marks those tokens NaN), so
`ratio_mean` and `sampler_trainer_prob_diff` measure sampler/trainer drift on free tokens only.

`token_weights` make every trajectory weigh the same however long it is
(`trajectory_token_weights`): a 5000-token agent episode and a 50-token one move the policy
equally. For gspo a sequence is one unit of weight, spread evenly over its tokens, which makes
sum_t w_t loss_t equal GSPO's per-sequence loss.

Tensor shapes: B sequences, T token positions, H hidden size, V vocabulary. Logprobs passed in are
already aligned with their targets (see `batch.shift_for_next_token`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

LOSSES = ("ppo", "cispo", "gspo", "dppo")

DPPO_RATIO_CAP = 20.0
"""DPPO's truncation of the importance weight (verl's clip_ratio_c default): only outliers."""


def grpo_loss(
    logprobs: Tensor,  # [B, T] trainer logprob of each target token, with grad
    old_logprobs: Tensor,  # [B, T] sampler logprob of the same tokens
    advantages: Tensor,  # [B], or [B, T] per token (rows that pack several trajectories)
    mask: Tensor,  # [B, T] bool (or 0/1): True at trained tokens
    *,
    loss: str,
    epsilon_low: float,
    epsilon_high: float,
    ref_logprobs: Tensor | None = None,  # [B, T] reference-model logprobs, for the KL term
    kl_coef: float = 0.0,
    token_weights: Tensor | None = None,  # [B, T]; None: each row is its own trajectory
    tis_cap: float | None = None,  # truncated importance sampling against the sampler (tis)
) -> tuple[Tensor, dict[str, float]]:
    """The weighted policy loss (a scalar with grad) and float metrics. See the module docstring.

    Metrics, all over trained tokens (sequences for gspo) of this call, unweighted:
      loss, ratio_mean, clip_frac (clipping active at either bound: for ppo/gspo the clipped
      branch was chosen, for cispo the weight was truncated), clip_low_frac, clip_high_frac,
      sampler_trainer_prob_diff = mean |exp(logp) - exp(old)| over trained tokens (chosen over
      |r - 1| because it is bounded in [0, 1] and not dominated by rare low-probability tokens
      whose ratios explode: a large value means vLLM and the trainer disagree, e.g. different
      weights or numerics), kl when ref_logprobs are given, and with tis_cap: tis_weight_mean
      and tis_clip_frac (weights truncated at the cap). For dppo, clip_*_frac count the tokens
      outside the trust region (masked).
    Off-mask positions never reach the arithmetic, so padding garbage (even -inf) is harmless.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"tis_cap must be None or > 0, got {tis_cap!r}")
    m = mask.to(torch.bool)  # [B, T]
    mf = m.float()  # [B, T]
    if token_weights is None:
        # each row its own trajectory: token-level and per-sequence weights then coincide
        token_weights = trajectory_token_weights(m, torch.arange(m.shape[0], device=m.device))
    w = token_weights.float() * mf  # [B, T]
    per_row = advantages.dim() == 1
    if not per_row and loss == "gspo":
        raise ValueError("gspo takes one advantage per row ([B]): its ratio is per sequence")
    adv = advantages.float()[:, None] if per_row else advantages.float()  # [B, 1] or [B, T]
    # where() instead of multiplying by the mask: keeps inf/nan at padding out of values and grads
    logp = torch.where(m, logprobs.float(), 0.0)  # [B, T]
    sampler = torch.where(m, old_logprobs.float(), 0.0)  # [B, T]
    tis_w = None
    if tis_cap is not None:
        # the trust region against the trainer's own policy; the sampler by a truncated weight
        tis_w = torch.exp(logp.detach() - sampler).clamp(max=tis_cap)  # [B, T]
        old = logp.detach()
    else:
        old = sampler
    lo, hi = 1.0 - epsilon_low, 1.0 + epsilon_high

    if loss == "gspo":
        n_tokens = mf.sum(-1)  # [B]
        seq_ratio = torch.exp((logp - old).sum(-1) / n_tokens.clamp(min=1))  # [B]
        # value: s_b at every token; gradient: s_b * d logp_t (the GSPO-token trick)
        ratio = seq_ratio.detach()[:, None] * torch.exp(logp - logp.detach())  # [B, T]
        per_token = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)  # [B, T]
        with torch.no_grad():
            valid = n_tokens > 0  # [B]
            units, unit_ratio = valid, seq_ratio  # clipping is decided per sequence
            high = valid & (adv[:, 0] > 0) & (seq_ratio > hi)
            low = valid & (adv[:, 0] < 0) & (seq_ratio < lo)
    else:
        ratio = torch.exp(logp - old)  # [B, T]
        if loss == "ppo":
            per_token = -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
            with torch.no_grad():  # the clipped branch is the smaller one only on these sides
                high = m & (adv > 0) & (ratio > hi)
                low = m & (adv < 0) & (ratio < lo)
        elif loss == "dppo":
            with torch.no_grad():  # the trust region on the token's probability, by A's sign
                moved = logp.exp() - old.exp()  # [B, T]
                high = m & (adv > 0) & (moved > epsilon_high)
                low = m & (adv <= 0) & (moved < -epsilon_low)
                keep = (~(high | low)).float()  # [B, T]
            per_token = -ratio.clamp(max=DPPO_RATIO_CAP).detach() * adv * logp * keep
        else:  # cispo
            per_token = -ratio.clamp(lo, hi).detach() * adv * logp
            with torch.no_grad():  # the weight is truncated whatever the advantage's sign
                high = m & (ratio > hi)
                low = m & (ratio < lo)
        units, unit_ratio = m, ratio

    if tis_w is not None:
        per_token = per_token * tis_w
    kl_t = None
    if ref_logprobs is not None:
        d = torch.where(m, ref_logprobs.float(), 0.0) - logp  # [B, T] log(ref / policy)
        kl_t = torch.exp(d) - d - 1.0  # [B, T] k3, >= 0, 0 off the mask
        per_token = per_token + kl_coef * kl_t

    total = (per_token * w).sum()

    with torch.no_grad():
        n_units = units.sum().clamp(min=1).float()
        n_tok = mf.sum().clamp(min=1)
        prob_diff = ((logp.exp() - sampler.exp()).abs() * mf).sum() / n_tok
        metrics = {
            "loss": total.item(),
            "ratio_mean": (unit_ratio * units).sum().div(n_units).item(),
            "clip_frac": (high | low).sum().div(n_units).item(),
            "clip_low_frac": low.sum().div(n_units).item(),
            "clip_high_frac": high.sum().div(n_units).item(),
            "sampler_trainer_prob_diff": prob_diff.item(),
        }
        if kl_t is not None:
            metrics["kl"] = (kl_t * mf).sum().div(n_tok).item()
        if tis_w is not None:
            metrics["tis_weight_mean"] = (tis_w * mf).sum().div(n_tok).item()
            metrics["tis_clip_frac"] = ((tis_w >= tis_cap) & m).sum().div(n_tok).item()
    return total, metrics


def trajectory_token_weights(
    mask: Tensor,  # [B, T] bool (or 0/1)
    traj_index: Tensor,  # [B] trajectory of each row
    *,
    per_sequence: bool = False,
) -> Tensor:  # [B, T] float32, 0 off the mask, sums to 1
    """Per-token weights under which every trajectory contributes the same total weight.

    per_sequence=False (ppo, cispo): w = 1 / (trained tokens of the row's trajectory, over all its
    rows) / (number of trajectories). per_sequence=True (gspo): each row is one unit,
    w = 1 / (trained tokens of the row) / (rows of its trajectory) / (number of trajectories).
    Rows and trajectories without trained tokens count for nothing.
    """
    mf = mask.float()  # [B, T]
    _, traj = torch.unique(traj_index, return_inverse=True)  # [B] in 0..J-1
    n_j = int(traj.max().item()) + 1 if traj.numel() else 0
    row_tokens = mf.sum(-1)  # [B]
    traj_tokens = torch.zeros(n_j, device=mf.device).index_add_(0, traj, row_tokens)  # [J]
    n_traj = (traj_tokens > 0).sum().clamp(min=1)
    if per_sequence:
        traj_rows = torch.zeros(n_j, device=mf.device).index_add_(0, traj, (row_tokens > 0).float())
        row_weight = 1.0 / row_tokens.clamp(min=1) / traj_rows[traj].clamp(min=1) / n_traj  # [B]
    else:
        row_weight = 1.0 / traj_tokens[traj].clamp(min=1) / n_traj  # [B]
    return mf * row_weight[:, None]


def chunked_token_logprobs(
    hidden_states: Tensor,  # [B, T, H] final hidden states at the positions that predict targets
    lm_head: Tensor | Callable[[Tensor], Tensor],  # weight [V, H], or a callable [N, H] -> [N, V]
    target_ids: Tensor,  # [B, T] the token whose logprob is wanted at each position
    chunk_size: int,
    *,
    positions: Tensor | None = None,  # [B, T] bool: compute only here (0 elsewhere)
    keep_bytes: int = 0,
) -> tuple[Tensor, Tensor]:  # logprobs [B, T] float32 (with grad), entropy [B, T] float32 (no grad)
    """log p(target) and the entropy at each position, `chunk_size` tokens at a time.

    The B*T positions are flattened and processed in chunks, so at most [chunk_size, V] logits
    are computed at once. Autograd keeps each chunk's float32 [chunk, V] log-softmax for backward
    while all of them together take at most `keep_bytes`; above that every chunk is
    checkpointed instead: dropped after the forward and recomputed in backward, so that the full
    [B, T, V] is never held, at ~1.6x the lm head's time (measured: SmolLM2's head over 1024
    positions, bf16, 0.98 s against 0.61 s). Gradients flow into hidden_states and into lm_head
    when it requires grad.

    The projection runs in the hidden states' dtype (as the model and vLLM compute logits); the
    log-softmax in float32: bf16 rounds a logprob near -10 by up to 0.03 nats, too coarse for ratios.
    `positions` skips work where no logprob is needed (prompt, tool results, padding), which is
    most of a long agent sequence.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    b, t, h = hidden_states.shape
    flat_h = hidden_states.reshape(b * t, h)  # [N, H]
    flat_t = target_ids.reshape(b * t)  # [N]
    index = None
    if positions is not None:
        index = positions.reshape(b * t).nonzero().squeeze(-1)  # [M]
        flat_h, flat_t = flat_h.index_select(0, index), flat_t.index_select(0, index)

    def project(x: Tensor) -> Tensor:
        return F.linear(x, lm_head) if isinstance(lm_head, Tensor) else lm_head(x)

    def chunk(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        logsm = project(x).float().log_softmax(-1)  # [n, V]
        with torch.no_grad():
            entropy = -(logsm.exp() * logsm).sum(-1)  # [n]
        return logsm.gather(-1, y[:, None]).squeeze(-1), entropy  # [n], [n]

    vocab = lm_head.shape[0] if isinstance(lm_head, Tensor) else getattr(
        lm_head, "out_features", None)  # a callable of unknown width: always recompute
    recompute = torch.is_grad_enabled() and (
        vocab is None or flat_h.shape[0] * vocab * 4 > keep_bytes)  # float32 [M, V] bytes
    lps, ents = [], []
    for start in range(0, flat_h.shape[0], chunk_size):
        x, y = flat_h[start : start + chunk_size], flat_t[start : start + chunk_size]
        if recompute:
            lp, ent = checkpoint(chunk, x, y, use_reentrant=False)
        else:
            lp, ent = chunk(x, y)
        lps.append(lp)
        ents.append(ent)
    device = hidden_states.device
    lp = torch.cat(lps) if lps else torch.zeros(0, device=device)  # [N] or [M]
    ent = torch.cat(ents) if ents else torch.zeros(0, device=device)
    if index is not None:
        zeros = torch.zeros(b * t, device=device)
        lp, ent = zeros.index_put((index,), lp), zeros.index_put((index,), ent)
    return lp.reshape(b, t), ent.reshape(b, t)
