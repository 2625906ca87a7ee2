"""The GRPO loss on hand-made numbers (ARCHITECTURE invariant 6).

Every expected number below was worked out by hand from the inputs, not by running the code.
Inputs are built from chosen ratios: old = logp - ln(r), so r = exp(logp - old) is known exactly.
Bounds in most tests: eps_low = 0.2, eps_high = 0.28, i.e. ratios are clipped to [0.8, 1.28].
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from art_core.train.loss import (  # noqa: E402
    chunked_token_logprobs,
    grpo_loss,
    trajectory_token_weights,
)

EPS = {"epsilon_low": 0.2, "epsilon_high": 0.28}
LN = math.log


def single_token(r: float, logp: float = -2.0):
    """B=1, T=2: position 0 is prompt (masked out), position 1 a trained token with ratio r."""
    logprobs = torch.tensor([[-0.5, logp]], requires_grad=True)
    old = torch.tensor([[-7.0, logp - LN(r)]])
    mask = torch.tensor([[False, True]])
    return logprobs, old, mask


# loss, r, A, expected loss, expected d loss / d logp, clipped low, clipped high
# (logp = -2 so cispo's value -w * A * logp is easy: e.g. -1.28 * 1 * -2 = 2.56)
SINGLE_TOKEN = [
    ("ppo", 1.0, 2.0, -2.0, -2.0, 0, 0),  # -r A; grad -r A
    ("ppo", 1.5, 1.0, -1.28, 0.0, 0, 1),  # A > 0, r above 1.28: clipped, no gradient
    ("ppo", 1.5, -1.0, 1.5, 1.5, 0, 0),  # A < 0, r high: min picks the unclipped -1.5
    ("ppo", 0.5, -1.0, 0.8, 0.0, 1, 0),  # A < 0, r below 0.8: clipped, no gradient
    ("ppo", 0.5, 1.0, -0.5, -0.5, 0, 0),  # A > 0, r low: unclipped
    ("ppo", 1.2, -0.5, 0.6, 0.6, 0, 0),  # inside the bounds
    ("cispo", 1.0, 2.0, 4.0, -2.0, 0, 0),  # -1 * 2 * -2 = 4; grad -w A = -2
    ("cispo", 1.5, 1.0, 2.56, -1.28, 0, 1),  # weight truncated to 1.28, gradient kept
    ("cispo", 1.5, -1.0, -2.56, 1.28, 0, 1),  # truncated whatever A's sign
    ("cispo", 0.5, -1.0, -1.6, 0.8, 1, 0),  # -0.8 * -1 * -2 = -1.6; grad 0.8
    ("cispo", 0.5, 1.0, 1.6, -0.8, 1, 0),
    # dppo (trust region on p - p_old, eps 0.2 down / 0.28 up; p = e^-2 = 0.135 here):
    ("dppo", 1.5, 1.0, 3.0, -1.5, 0, 0),  # ratio 1.5 (ppo clips) but p moved +0.045: kept
    ("dppo", 0.5, -1.0, -1.0, 0.5, 0, 0),  # p_old 0.27, moved -0.135 > -0.2: kept
    ("dppo", 30.0, 1.0, 40.0, -20.0, 0, 0),  # moved +0.13: kept; weight capped at 20
    ("gspo", 1.5, 1.0, -1.28, 0.0, 0, 1),  # one token: sequence ratio = token ratio, as ppo
    ("gspo", 0.5, -1.0, 0.8, 0.0, 1, 0),
    ("gspo", 1.2, -0.5, 0.6, 0.6, 0, 0),  # grad s * (-A) = 1.2 * 0.5
]


@pytest.mark.parametrize("loss,r,adv,expected,grad,low,high", SINGLE_TOKEN)
def test_single_token(loss, r, adv, expected, grad, low, high):
    logprobs, old, mask = single_token(r)
    value, metrics = grpo_loss(logprobs, old, torch.tensor([adv]), mask, loss=loss, **EPS)
    value.backward()
    assert value.item() == pytest.approx(expected, abs=1e-5)
    assert logprobs.grad[0, 1].item() == pytest.approx(grad, abs=1e-5)
    assert logprobs.grad[0, 0].item() == 0.0  # prompt position: no gradient
    assert metrics["clip_low_frac"] == low
    assert metrics["clip_high_frac"] == high
    assert metrics["clip_frac"] == low + high
    assert metrics["ratio_mean"] == pytest.approx(r, abs=1e-5)


def two_by_three(loss: str):
    """The shared 2x3 example. Row 0: A = +1, row 1: A = -1; position 0 of each row is prompt.

    ppo/cispo ratios: row 0 (1.5, 1.1), row 1 (0.5, 1.2).
    gspo: token log-ratios spread around the sequence's so that s = (1.5, 0.9) exactly.
    """
    logp = torch.tensor([[-0.3, -1.0, -2.0], [-0.7, -0.5, -1.5]])
    if loss == "gspo":
        log_r = torch.tensor([[0.0, LN(1.5) + 0.1, LN(1.5) - 0.1], [0.0, LN(0.9) + 0.3, LN(0.9) - 0.3]])
    else:
        log_r = torch.tensor([[0.0, LN(1.5), LN(1.1)], [0.0, LN(0.5), LN(1.2)]])
    old = logp - log_r
    old[:, 0] = -9.0  # prompt positions: anything, must not matter
    mask = torch.tensor([[False, True, True], [False, True, True]])
    return logp.clone().requires_grad_(True), old, torch.tensor([1.0, -1.0]), mask


# Weights (None given): each row is its own trajectory of 2 tokens -> 1/2 / 2 = 0.25 per token.
# ppo:   row 0: 1.5 clipped -> -1.28, 1.1 -> -1.1; row 1: 0.5 clipped -> +0.8, 1.2 -> +1.2
#        loss = 0.25 (-1.28 - 1.1 + 0.8 + 1.2) = -0.095; grads (0, -1.1 * .25), (0, 1.2 * .25)
# cispo: weights (1.28, 1.1), (0.8, 1.2); loss_t = -w A logp:
#        row 0: -1.28 (1)(-1) = 1.28, -1.1 (1)(-2) = 2.2; row 1: -0.8 (-1)(-0.5) = -0.4,
#        -1.2 (-1)(-1.5) = -1.8; loss = 0.25 (1.28 + 2.2 - 0.4 - 1.8) = 0.32
#        grads -w A / 4: (-0.32, -0.275), (0.2, 0.3)
# gspo:  s = 1.5 (A > 0, clipped: -1.28, no grad), s = 0.9 (inside: +0.9, grad -A s / 4 = 0.225)
#        loss = 0.5 (-1.28) + 0.5 (0.9) = -0.19
TWO_BY_THREE = [
    ("ppo", -0.095, [[0, 0, -0.275], [0, 0, 0.3]], 0.5, 1.075),
    ("cispo", 0.32, [[0, -0.32, -0.275], [0, 0.2, 0.3]], 0.5, 1.075),
    ("gspo", -0.19, [[0, 0, 0], [0, 0.225, 0.225]], 0.5, 1.2),
]


@pytest.mark.parametrize("loss,expected,grads,clip_frac,ratio_mean", TWO_BY_THREE)
def test_two_by_three(loss, expected, grads, clip_frac, ratio_mean):
    logp, old, adv, mask = two_by_three(loss)
    value, metrics = grpo_loss(logp, old, adv, mask, loss=loss, **EPS)
    value.backward()
    assert value.item() == pytest.approx(expected, abs=1e-5)
    torch.testing.assert_close(logp.grad, torch.tensor(grads, dtype=torch.float32), atol=1e-5, rtol=0)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["clip_frac"] == pytest.approx(clip_frac)
    assert metrics["ratio_mean"] == pytest.approx(ratio_mean, abs=1e-5)
    assert "kl" not in metrics


def test_gspo_sequence_ratio_counts_only_trained_tokens():
    # Row 1 now trains only position 1 (log-ratio ln 0.9); position 2's log-ratio ln 5 must not
    # enter s. s = (1.5, 0.9); weights: row 0 0.25 per token, row 1 0.5 on its one token.
    # loss = 0.5 (-1.28) + 0.5 (0.9) = -0.19; row 1's gradient -A s 0.5 = 0.45.
    logp, old, adv, _ = two_by_three("gspo")
    old = old.clone()
    old[1, 1] = logp[1, 1].item() - LN(0.9)
    old[1, 2] = logp[1, 2].item() - LN(5.0)
    mask = torch.tensor([[False, True, True], [False, True, False]])
    value, metrics = grpo_loss(logp, old, adv, mask, loss="gspo", **EPS)
    value.backward()
    assert value.item() == pytest.approx(-0.19, abs=1e-5)
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0, 0, 0], [0, 0.45, 0]], dtype=torch.float32), atol=1e-5, rtol=0
    )
    assert metrics["ratio_mean"] == pytest.approx(1.2, abs=1e-5)


def test_sampler_trainer_prob_diff():
    # |p - p_old| = p |1 - 1/r|: e^-1/3 + e^-2 (1/11) + e^-0.5 (1) + e^-1.5 (1/6)
    # = 0.122626 + 0.012303 + 0.606531 + 0.037188 = 0.778648, mean over 4 tokens = 0.194662
    logp, old, adv, mask = two_by_three("ppo")
    _, metrics = grpo_loss(logp, old, adv, mask, loss="ppo", **EPS)
    assert metrics["sampler_trainer_prob_diff"] == pytest.approx(0.194662, abs=1e-5)


@pytest.mark.parametrize("loss", ["ppo", "cispo", "gspo", "dppo"])
def test_zero_advantages_give_zero_loss(loss):
    logp, old, _, mask = two_by_three(loss)
    value, _ = grpo_loss(logp, old, torch.zeros(2), mask, loss=loss, **EPS)
    value.backward()
    assert value.item() == 0.0
    assert torch.count_nonzero(logp.grad) == 0


# k3 with d = ref - logp: d = ln 2 -> 2 - ln 2 - 1 = 0.306853; d = -ln 2 -> 0.5 + ln 2 - 1 =
# 0.193147; d = 0 -> 0. The ln 2 cancel: sum 0.5, mean over 4 tokens 0.125, weighted 0.125,
# times kl_coef 0.1 = 0.0125. d k3 / d logp = 1 - e^d: -1 (d = ln 2), 0.5 (d = -ln 2), x 0.25 x 0.1.
@pytest.mark.parametrize("loss", ["ppo", "cispo", "gspo", "dppo"])
@pytest.mark.parametrize(
    "kl_coef,use_ref,expected,grads",
    [
        (0.1, True, 0.0125, [[0, -0.025, 0], [0, 0.0125, 0]]),
        (0.0, True, 0.0, [[0, 0, 0], [0, 0, 0]]),  # measured, not added
        (0.0, False, 0.0, [[0, 0, 0], [0, 0, 0]]),
    ],
)
def test_kl(loss, kl_coef, use_ref, expected, grads):
    logp, old, _, mask = two_by_three(loss)
    d = torch.tensor([[5.0, LN(2), 0.0], [-3.0, -LN(2), 0.0]])  # position 0 masked out
    ref = logp.detach() + d if use_ref else None
    value, metrics = grpo_loss(
        logp, old, torch.zeros(2), mask, loss=loss, ref_logprobs=ref, kl_coef=kl_coef, **EPS
    )
    value.backward()
    assert value.item() == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor(grads, dtype=torch.float32), atol=1e-6, rtol=0)
    if use_ref:
        assert metrics["kl"] == pytest.approx(0.125, abs=1e-6)
    else:
        assert "kl" not in metrics


def test_kl_coef_without_reference_is_an_error():
    logp, old, adv, mask = two_by_three("ppo")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logp, old, adv, mask, loss="ppo", kl_coef=0.1, **EPS)


def test_unknown_loss_is_an_error():
    logp, old, adv, mask = two_by_three("ppo")
    with pytest.raises(ValueError, match="loss must be one of"):
        grpo_loss(logp, old, adv, mask, loss="grpo", **EPS)


def test_padding_garbage_is_harmless():
    logp, old, adv, mask = two_by_three("ppo")
    logp = logp.detach().clone()
    logp[:, 0] = float("-inf")
    old[:, 0] = float("nan")
    logp.requires_grad_(True)
    ref = torch.full_like(old, float("nan"))
    ref[mask] = logp.detach()[mask]
    value, metrics = grpo_loss(logp, old, adv, mask, loss="ppo", ref_logprobs=ref, kl_coef=0.1, **EPS)
    value.backward()
    assert value.item() == pytest.approx(-0.095, abs=1e-5)  # same as the clean 2x3 case
    assert torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


# Rows 0, 1 belong to trajectory 7 (2 + 1 trained tokens), row 2 to trajectory 3 (1 token).
# Token-level: trajectory 7 has 3 tokens -> 1/3 / 2 = 1/6 each; trajectory 3 -> 1/2.
# Per sequence: trajectory 7 has 2 sequences -> row 0: 1/2 / 2 / 2 = 1/8, row 1: 1 / 2 / 2 = 1/4.
WEIGHT_MASK = [[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 1, 0]]


@pytest.mark.parametrize(
    "per_sequence,expected",
    [
        (False, [[0, 1 / 6, 1 / 6, 0], [0, 1 / 6, 0, 0], [0, 0, 1 / 2, 0]]),
        (True, [[0, 1 / 8, 1 / 8, 0], [0, 1 / 4, 0, 0], [0, 0, 1 / 2, 0]]),
    ],
)
def test_trajectory_token_weights(per_sequence, expected):
    mask = torch.tensor(WEIGHT_MASK, dtype=torch.bool)
    w = trajectory_token_weights(mask, torch.tensor([7, 7, 3]), per_sequence=per_sequence)
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float32))
    assert w.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("loss", ["ppo", "cispo", "gspo", "dppo"])
def test_long_and_short_trajectory_weigh_the_same(loss):
    # Trajectory 0: 5 trained tokens, A = +1; trajectory 1: 1 trained token, A = -1; r = 1.
    # Each token of trajectory 0 weighs 1/5 / 2 = 0.1, the one of trajectory 1 weighs 0.5, so the
    # gradients per trajectory sum to -A / 2 = -0.5 and +0.5. (A token mean would give -5/6, +1/6.)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0]], dtype=torch.bool)
    logp = torch.full((2, 6), -1.0, requires_grad=True)
    old = logp.detach().clone()
    adv = torch.tensor([1.0, -1.0])
    weights = trajectory_token_weights(mask, torch.tensor([0, 1]), per_sequence=loss == "gspo")
    value, _ = grpo_loss(logp, old, adv, mask, loss=loss, token_weights=weights, **EPS)
    value.backward()
    row_grad = logp.grad.sum(-1)
    torch.testing.assert_close(row_grad, torch.tensor([-0.5, 0.5]))
    if loss not in ("cispo", "dppo"):  # these: -A logp; the others -A r: 0.5 (-1) + 0.5 (+1) = 0
        assert value.item() == pytest.approx(0.0, abs=1e-6)


def naive_logprobs(hidden, weight, targets, bias=None):
    logits = torch.nn.functional.linear(hidden, weight, bias).float()  # [B, T, V] all at once
    logsm = logits.log_softmax(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logsm.gather(-1, targets[..., None]).squeeze(-1), entropy


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 14, 64])  # N = 2 x 7 = 14 positions
@pytest.mark.parametrize("head", ["weight", "module"])
@pytest.mark.parametrize("keep_bytes", [0, 1 << 20])  # recompute in backward, or keep
def test_chunked_logprobs_match_naive(chunk_size, head, keep_bytes):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 7, 8, generator=g, requires_grad=True)
    linear = torch.nn.Linear(8, 11, bias=head == "module")
    targets = torch.randint(0, 11, (2, 7), generator=g)
    coef = torch.randn(2, 7, generator=g)  # a loss that weighs every position differently

    lm_head = linear.weight if head == "weight" else linear
    lp, ent = chunked_token_logprobs(hidden, lm_head, targets, chunk_size, keep_bytes=keep_bytes)
    (lp * coef).sum().backward()
    got = (hidden.grad.clone(), linear.weight.grad.clone())
    hidden.grad, linear.weight.grad = None, None

    ref_lp, ref_ent = naive_logprobs(hidden, linear.weight, targets, linear.bias)
    (ref_lp * coef).sum().backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent.detach())
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], linear.weight.grad)
    assert lp.dtype == torch.float32
    assert not ent.requires_grad


FULL = 128 * 5000 * 4  # bytes of the float32 log-softmax of all 2 x 64 positions below


@pytest.mark.parametrize(("keep_bytes", "kept"), [
    (0, False),  # the default of the function: always recompute
    (FULL - 1, False),  # one byte short: recompute
    (FULL, True),  # fits: autograd keeps each chunk's [16, 5000] log-softmax
])
def test_chunked_logprobs_keep_logits_for_backward_only_within_budget(keep_bytes, kept):
    hidden = torch.randn(2, 64, 8, requires_grad=True)
    weight = torch.randn(5000, 8, requires_grad=True)
    targets = torch.randint(0, 5000, (2, 64))
    saved: dict[int, int] = {}  # storage -> elements, each saved tensor counted once

    def pack(x):
        saved[x.data_ptr()] = x.numel()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp, _ = chunked_token_logprobs(hidden, weight, targets, 16, keep_bytes=keep_bytes)
    chunk_logits = sum(n == 16 * 5000 for n in saved.values())  # a chunk's [16, 5000]
    assert chunk_logits == (8 if kept else 0), saved
    inputs = weight.numel() + hidden.numel() + targets.numel()
    assert sum(saved.values()) <= FULL // 4 + inputs  # elements: the budget's, and the inputs
    lp.sum().backward()
    assert hidden.grad.abs().sum() > 0 and weight.grad.abs().sum() > 0


def test_chunked_logprobs_positions_and_no_grad():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 8, generator=g)
    weight = torch.randn(13, 8, generator=g)
    targets = torch.randint(0, 13, (2, 5), generator=g)
    positions = torch.tensor([[0, 1, 1, 0, 1], [0, 0, 0, 1, 0]], dtype=torch.bool)
    ref_lp, ref_ent = naive_logprobs(hidden, weight, targets)
    with torch.no_grad():
        lp, ent = chunked_token_logprobs(hidden, weight, targets, 2, positions=positions)
    torch.testing.assert_close(lp, torch.where(positions, ref_lp, 0.0))
    torch.testing.assert_close(ent, torch.where(positions, ref_ent, 0.0))


def test_chunked_logprobs_bf16_hidden_gives_float32():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 6, 8, generator=g).bfloat16()
    weight = torch.randn(17, 8, generator=g).bfloat16()
    targets = torch.randint(0, 17, (1, 6), generator=g)
    lp, _ = chunked_token_logprobs(hidden, weight, targets, 4)
    ref_lp, _ = naive_logprobs(hidden, weight, targets)  # bf16 logits, float32 log-softmax
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp)


@pytest.mark.parametrize("loss", ["ppo", "cispo", "gspo", "dppo"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_sgd_step_moves_logprobs_with_the_advantage(loss, sign):
    # The hidden states are the parameters: each position has its own, so a token's logprob moves
    # only through its own gradient and the test sees no interference between tokens.
    g = torch.Generator().manual_seed(3)
    hidden = torch.nn.Parameter(torch.randn(1, 4, 8, generator=g))
    weight = torch.randn(9, 8, generator=g)
    targets = torch.randint(0, 9, (1, 4), generator=g)
    mask = torch.tensor([[False, True, True, True]])
    eps = {"ppo": (0.2, 0.28), "cispo": (1.0, 4.0), "gspo": (3e-4, 4e-4),
           "dppo": (0.2, 0.2)}[loss]  # config defaults

    before, _ = chunked_token_logprobs(hidden, weight, targets, 3)
    value, _ = grpo_loss(
        before, before.detach(), torch.tensor([sign]), mask, loss=loss,
        epsilon_low=eps[0], epsilon_high=eps[1],
    )
    value.backward()
    with torch.no_grad():
        hidden -= 0.1 * hidden.grad
        after, _ = chunked_token_logprobs(hidden, weight, targets, 3)
    change = (after - before.detach())[mask]
    assert (change * sign > 0).all(), change


# dppo where the probability itself moves far: p, r (so p_old = p / r), A, loss, grad, low, high
DPPO_REGION = [
    (0.9, 3.0, 1.0, 0.0, 0.0, 0, 1),  # p_old 0.3 -> 0.9, A > 0: outside, masked
    (0.9, 3.0, -1.0, 3 * LN(0.9), 3.0, 0, 0),  # the same move, A < 0: a push back, kept
    (0.1, 0.2, -1.0, 0.0, 0.0, 1, 0),  # p_old 0.5 -> 0.1, A < 0: outside, masked
    (0.1, 0.2, 1.0, -0.2 * LN(0.1), -0.2, 0, 0),  # A > 0 pushes it back up: kept
]


@pytest.mark.parametrize("p,r,adv,expected,grad,low,high", DPPO_REGION)
def test_dppo_masks_tokens_whose_probability_left_the_region(p, r, adv, expected, grad, low,
                                                             high):
    logprobs, old, mask = single_token(r, logp=LN(p))
    value, metrics = grpo_loss(logprobs, old, torch.tensor([adv]), mask, loss="dppo", **EPS)
    value.backward()
    assert value.item() == pytest.approx(expected, abs=1e-5)
    assert logprobs.grad[0, 1].item() == pytest.approx(grad, abs=1e-5)
    assert (metrics["clip_low_frac"], metrics["clip_high_frac"]) == (low, high)


# tis: the trust region against the trainer's own logprob (ratio 1), the sampler mismatch r
# weighted by w = min(r, cap): loss, r, A, logp, loss value, grad, weight truncated
TIS = [
    ("ppo", 1.5, 1.0, -2.0, -1.5, -1.5, 0),  # without tis ppo clips this token (grad 0)
    ("ppo", 3.0, 1.0, -2.0, -2.0, -2.0, 1),  # w capped at 2
    ("ppo", 0.5, -1.0, -2.0, 0.5, 0.5, 0),  # -(1 x -1) x 0.5
    ("cispo", 1.5, 1.0, -2.0, 3.0, -1.5, 0),  # -A logp x w = 2 x 1.5
    ("dppo", 3.0, 1.0, LN(0.9), -2 * LN(0.9), -2.0, 1),  # masked without tis; kept, w = 2
    ("gspo", 1.5, -1.0, -2.0, 1.5, 1.5, 0),  # sequence ratio 1 against the trainer
]


@pytest.mark.parametrize("loss,r,adv,logp,expected,grad,capped", TIS)
def test_truncated_importance_sampling(loss, r, adv, logp, expected, grad, capped):
    logprobs, old, mask = single_token(r, logp=logp)
    value, metrics = grpo_loss(logprobs, old, torch.tensor([adv]), mask, loss=loss,
                               tis_cap=2.0, **EPS)
    value.backward()
    assert value.item() == pytest.approx(expected, abs=1e-5)
    assert logprobs.grad[0, 1].item() == pytest.approx(grad, abs=1e-5)
    assert metrics["tis_weight_mean"] == pytest.approx(min(r, 2.0), abs=1e-5)
    assert metrics["tis_clip_frac"] == capped
    assert metrics["clip_frac"] == 0  # nothing moved against the trainer's own policy
    with pytest.raises(ValueError, match="tis_cap must be None or > 0"):
        grpo_loss(logprobs, old, torch.tensor([adv]), mask, loss=loss, tis_cap=0.0, **EPS)
