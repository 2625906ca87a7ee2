"""From scored trajectory groups to padded tensors: the data half of one GRPO step.

The stages, one function each, in the order the trainer calls them:

1. advantages (art_core/train/advantages.py: `compute_advantages` for GRPO, `teacher_advantages`
   for on-policy distillation; per-turn credit in credit.py): (trajectory, advantage) pairs, and
   per-token advantages where an estimator gives them (set by stage 2).
2. `build_all_sequences` / `build_sequences`: each trajectory's sampled turns become training
   sequences made of the exact token ids the engine saw and produced (invariant 1). A turn whose
   prompt starts with everything before it extends the current sequence, so a multi-turn agent
   conversation trains as one sequence; otherwise a new sequence starts. A trajectory with no
   sampled turn is an error unless a re-tokenizing fallback is given, whose use is counted and
   warned about (invariants 1 and 2).
3. `with_token_weights`: per-token weights that make every trajectory weigh the same in the loss,
   however long it is and however many sequences it was split into.
4. `micro_batches`: sequences sorted by length and cut into micro-batches (less padding).
5. `collate`: right-padded tensors.

Tensor convention (every [B, T] tensor from `collate` is aligned to TOKEN POSITIONS):

    input_ids[b, t]     the t-th token of sequence b (pad_id after its end)
    loss_mask[b, t]     True exactly where token t was sampled by the engine (a completion token)
    old_logprobs[b, t]  the engine's sampling logprob of token t where loss_mask is True, else 0;
                        NaN where a tool-call grammar chose token t (the trainer's own is used)
    token_weights[b, t] the weight of token t in the loss (0 where loss_mask is False)
    advantages[b, t]    only when some sequence has per-token advantages (else advantages[b])

A causal LM predicts token t from the logits at position t - 1, so the trainer computes the logprob
of targets input_ids[:, 1:] from hidden states [:, :-1] and compares them with the [:, 1:] slices of
the other tensors; `shift_for_next_token` returns exactly those slices. Position 0 never carries a
target: every sequence starts with a non-empty prompt (checked in `Sequence`).

Gradient accumulation: token weights are computed over the whole step, so the trainer SUMS the
losses of its micro-batches (no division by the number of micro-batches).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from art_core.train.advantages import TokenAdvantages, describe, teacher_token_advantages
from art_core.trajectory import History, SampledTurn, Trajectory, continues, split_reason

log = logging.getLogger(__name__)

_Row = TypeVar("_Row", bound=Sized)

Retokenize = Callable[[History], Iterable[Any]]
"""Fallback that renders a history without sampled turns into sequence-like items (objects or
mappings with `token_ids`, `mask` and optionally `old_logprobs`)."""


# ---------------------------------------------------------------------------------------------
# 2. Sequences
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sequence:
    """One training sequence: token ids plus, per token, whether it is trained and its old logprob.

    All per-token lists have the same length. `mask[t] == 1` exactly at tokens the engine sampled;
    prompt, tool-result and re-rendered context tokens are 0. `old_logprobs[t]` is the engine's
    sampling logprob where `mask[t] == 1` and 0 elsewhere. `has_old_logprobs` is False only for
    re-tokenized sequences without engine logprobs: the trainer then uses its own detached
    logprobs (ratio 1). `token_weight` is set by `with_token_weights`. `token_advantages`, when
    set, replaces `advantage` with one advantage per token (on-policy distillation: teacher -
    sampler logprob on completion tokens, 0 elsewhere).
    """

    token_ids: list[int]
    mask: list[int]
    old_logprobs: list[float]
    advantage: float
    traj_index: int
    has_old_logprobs: bool = True
    retokenized: bool = False
    token_weight: float = 0.0
    token_advantages: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.mask) != n or len(self.old_logprobs) != n:
            raise ValueError(
                f"sequence of trajectory {self.traj_index}: token_ids ({n}), mask "
                f"({len(self.mask)}) and old_logprobs ({len(self.old_logprobs)}) differ in length"
            )
        if self.token_advantages is not None and len(self.token_advantages) != n:
            raise ValueError(
                f"sequence of trajectory {self.traj_index}: token_ids ({n}) and "
                f"token_advantages ({len(self.token_advantages)}) differ in length")
        if not any(self.mask):
            raise ValueError(f"sequence of trajectory {self.traj_index} has no trained token")
        if self.mask[0]:
            # the first token has no position before it to be predicted from
            raise ValueError(
                f"sequence of trajectory {self.traj_index} starts with a trained token: "
                "the prompt must be non-empty"
            )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.mask)


def build_sequences(
    trajectory: Trajectory,
    advantage: float,
    traj_index: int,
    *,
    retokenize: Retokenize | None = None,
) -> list[Sequence]:
    """Turn one trajectory's sampled turns (every history) into training sequences.

    Within a history, turns are taken in message order. A turn EXTENDS the current sequence when
    its prompt_token_ids start with the current sequence's full token ids (previous prompt +
    previous completion): the new prompt tokens (tool results, the next user message, template
    glue) join as context (mask 0) and its completion as trained tokens (mask 1). Otherwise the
    current sequence is closed and a new one starts from this turn's full prompt (a split; the
    gateway splices turns so that this happens only where the client rewrote its history).
    Histories without sampled turns inside a trainable trajectory are context only and produce
    nothing. Tokens chosen under a tool-call grammar get old logprob NaN (`_sampler_logprobs`).

    A trajectory with no sampled turn at all raises ValueError, unless `retokenize` is given: then
    every history goes through it and the sequences are marked `retokenized`.
    """
    return _build(trajectory, advantage, traj_index, retokenize)[0]


def _build(trajectory: Trajectory, advantage: float, traj_index: int,
           retokenize: Retokenize | None,
           per_token: TokenAdvantages | None = None) -> tuple[list[Sequence], list[_HistoryBuild]]:
    if trajectory.trainable:
        builds = [_history_sequences(history, advantage, traj_index,
                                     None if per_token is None else
                                     (lambda turn, h=h: per_token(traj_index, h, turn)))
                  for h, history in enumerate(trajectory.histories())]
        builds = [b for b in builds if b.sequences]
        return [s for b in builds for s in b.sequences], builds

    if retokenize is None:
        raise ValueError(
            f"trajectory {traj_index} ({describe(trajectory)}) has no sampled turns: none of its "
            "assistant messages carries the token ids the engine produced, so there is nothing to "
            "train on exactly. Record rollouts through the gateway, or set "
            "TrainConfig.allow_retokenize=True to render it through the chat template instead."
        )
    sequences = [
        _coerce(item, advantage, traj_index)
        for history in trajectory.histories()
        for item in retokenize(history)
    ]
    if not sequences:
        raise ValueError(
            f"trajectory {traj_index} ({describe(trajectory)}) has no sampled turns and the "
            "re-tokenizing fallback produced no sequence from it"
        )
    return sequences, []


def build_all_sequences(
    scored: Iterable[tuple[Trajectory, float]],
    *,
    retokenize: Retokenize | None = None,
    teacher: bool = False,
    token_advantages: TokenAdvantages | None = None,
) -> tuple[list[Sequence], dict[str, float]]:
    """`build_sequences` over every (trajectory, advantage); traj_index is the position in `scored`.

    `teacher=True` (on-policy distillation, see `teacher_advantages`): every sequence gets
    `token_advantages`, teacher_logprob - sampler_logprob at each sampled token (0 elsewhere),
    and the trajectory's advantage is unused; every sampled turn must carry `teacher_logprobs`.
    `token_advantages` (per-turn credit, art_core/train/credit.py) likewise gives each sampled
    token its own advantage.

    Metrics: `trajectories_trained`, `sequences`, `trained_tokens`, `tokens`,
    `retokenized_trajectories` and `frac_retokenized` (invariant 1: the fallback is never silent;
    it is also logged as a warning); over the sampled histories: `sequences_per_history` (1.0
    when every conversation trained as one sequence), `redundant_token_ratio` (tokens / unique
    tokens: a split's new prompt states the conversation before it again, and those tokens are
    not unique), `splits_<reason>` per reason a sequence split (`rewritten_history`,
    `unknown_prior_turn`, `template_not_prefix`, ... from the gateway; `not_prefix` when the turn
    carries no reason), `constrained_tokens` (trained with the trainer's own old logprob) and
    `truncated_turns` (finish_reason "length").
    """
    sequences: list[Sequence] = []
    builds: list[_HistoryBuild] = []
    n_trajectories = n_retokenized = 0
    per_token = teacher_token_advantages if teacher else token_advantages
    for traj_index, (trajectory, advantage) in enumerate(scored):
        n_trajectories += 1
        built, histories = _build(trajectory, advantage, traj_index, retokenize, per_token)
        n_retokenized += any(s.retokenized for s in built)
        sequences.extend(built)
        builds.extend(histories)
    if n_retokenized:
        log.warning(
            "%d of %d trajectories had no sampled tokens and were re-rendered through the chat "
            "template: their tokens may differ from what the model sampled",
            n_retokenized,
            n_trajectories,
        )
    tokens = sum(len(s) for s in sequences)
    redundant = sum(b.redundant_tokens for b in builds)
    metrics: dict[str, float] = {
        "trajectories_trained": n_trajectories,
        "sequences": len(sequences),
        "trained_tokens": sum(s.num_trained_tokens for s in sequences),
        "tokens": tokens,
        "retokenized_trajectories": n_retokenized,
        "frac_retokenized": n_retokenized / n_trajectories if n_trajectories else 0.0,
        "sequences_per_history": (sum(len(b.sequences) for b in builds) / len(builds)
                                  if builds else 0.0),
        "redundant_token_ratio": tokens / (tokens - redundant) if tokens > redundant else 0.0,
        "constrained_tokens": sum(b.constrained_tokens for b in builds),
        "truncated_turns": sum(b.truncated_turns for b in builds),
    }
    for b in builds:
        for reason in b.splits:
            metrics[f"splits_{reason}"] = metrics.get(f"splits_{reason}", 0) + 1
    return sequences, metrics


@dataclass
class _HistoryBuild:
    """What `_history_sequences` found in one history, for the step's metrics."""

    sequences: list[Sequence]
    splits: list[str]  # one reason per sequence after the first
    redundant_tokens: int  # tokens of a sequence that the next one's prompt states again
    constrained_tokens: int
    truncated_turns: int


def _history_sequences(history: History, advantage: float, traj_index: int,
                       per_token: Callable[[SampledTurn], list[float]] | None = None
                       ) -> _HistoryBuild:
    """The prefix-extension rule of `build_sequences` for one history; with `per_token`, each
    completion token's own advantage alongside (0 on context tokens)."""
    out = _HistoryBuild([], [], 0, 0, 0)
    tokens: list[int] = []
    mask: list[int] = []
    old: list[float] = []
    adv: list[float] = []  # per token, only kept with `per_token`

    def close() -> None:
        if tokens:
            out.sequences.append(Sequence(list(tokens), list(mask), list(old), advantage,
                                          traj_index,
                                          token_advantages=None if per_token is None
                                          else list(adv)))

    previous: SampledTurn | None = None
    for turn in sorted(history.turns, key=lambda t: t.message_index):
        prompt = turn.prompt_token_ids
        if continues(turn, previous):  # `tokens` is previous's prompt + completion
            context = prompt[len(tokens) :]  # only what came after the previous completion
        else:
            close()
            if not prompt:
                raise ValueError(
                    f"trajectory {traj_index}: the sampled turn of message {turn.message_index} "
                    "has an empty prompt_token_ids"
                )
            if tokens:  # a split: the new prompt re-states the conversation so far
                out.splits.append(split_reason(turn))
                out.redundant_tokens += min(len(tokens), len(prompt))
            tokens, mask, old, adv = [], [], [], []
            context = prompt
        tokens += context
        mask += [0] * len(context)
        old += [0.0] * len(context)
        adv += [0.0] * len(context)
        tokens += turn.completion_token_ids
        mask += [1] * len(turn.completion_token_ids)
        old += _sampler_logprobs(turn)
        if per_token is not None:
            adv += per_token(turn)
        out.truncated_turns += turn.finish_reason == "length"
        if turn.constrained_from is not None:
            out.constrained_tokens += max(0, len(turn.logprobs) - turn.constrained_from)
        previous = turn
    close()
    return out


def _sampler_logprobs(turn: SampledTurn) -> list[float]:
    """The turn's sampling logprobs, NaN from `constrained_from` on: a grammar-chosen token's
    logprob is of the masked, renormalised distribution (vLLM applies the mask before it reports
    even raw logprobs), not the model's, so the trainer uses its own there (ratio 1)."""
    k = turn.constrained_from
    if k is None:
        return list(turn.logprobs)
    return list(turn.logprobs[:k]) + [math.nan] * (len(turn.logprobs) - k)


def _coerce(item: Any, advantage: float, traj_index: int) -> Sequence:
    """A re-tokenizer's item (Sequence, mapping or object with token_ids/mask) as a Sequence."""

    def get(name: str) -> Any:
        if isinstance(item, Mapping):
            return item.get(name)
        return getattr(item, name, None)

    token_ids, mask, old = get("token_ids"), get("mask"), get("old_logprobs")
    if token_ids is None or mask is None:
        raise TypeError(
            f"retokenize returned {type(item).__name__}: expected token_ids and mask fields"
        )
    mask = [int(bool(m)) for m in mask]
    has_old = old is not None
    if has_old:
        old = [float(x) if m else 0.0 for x, m in zip(old, mask, strict=True)]
    else:
        old = [0.0] * len(mask)
    return Sequence(
        list(token_ids),
        mask,
        old,
        advantage,
        traj_index,
        has_old_logprobs=has_old,
        retokenized=True,
    )


# ---------------------------------------------------------------------------------------------
# 3. Weights
# ---------------------------------------------------------------------------------------------


def with_token_weights(sequences: list[Sequence], *, per_sequence: bool = False) -> list[Sequence]:
    """Copies of `sequences` with `token_weight` set so every trajectory weighs the same.

    Token-level losses (ppo, cispo; `per_sequence=False`): each trained token of trajectory j
    weighs 1 / (trained tokens of j over all its sequences) / (number of trajectories).
    Sequence-level loss (gspo; `per_sequence=True`): each sequence is one unit, so a token of
    sequence i of trajectory j weighs 1 / (trained tokens of i) / (sequences of j) / (number of
    trajectories). Either way the weights of a step sum to 1. Same formula as
    `loss.trajectory_token_weights`, but over the whole step, so micro-batches can be summed.
    """
    tokens_per_traj: dict[int, int] = {}
    seqs_per_traj: dict[int, int] = {}
    for s in sequences:
        tokens_per_traj[s.traj_index] = tokens_per_traj.get(s.traj_index, 0) + s.num_trained_tokens
        seqs_per_traj[s.traj_index] = seqs_per_traj.get(s.traj_index, 0) + 1
    n_traj = len(tokens_per_traj)
    out = []
    for s in sequences:
        if per_sequence:
            weight = 1.0 / s.num_trained_tokens / seqs_per_traj[s.traj_index] / n_traj
        else:
            weight = 1.0 / tokens_per_traj[s.traj_index] / n_traj
        out.append(dataclasses.replace(s, token_weight=weight))
    return out


# ---------------------------------------------------------------------------------------------
# 4. Micro-batches
# ---------------------------------------------------------------------------------------------


def micro_batches(
    sequences: list[_Row], max_sequences: int, *, max_tokens: int | None = None
) -> list[list[_Row]]:
    """Split into micro-batches of at most `max_sequences` rows (sequences, or the packed rows
    of art_core/train/packing.py), longest first, to reduce padding.

    Deterministic: ties in length keep the input order. With `max_tokens`, a micro-batch also
    closes before its padded size (sequences x longest length) would exceed it; a single sequence
    longer than that still gets a micro-batch of its own. Longest first means an out-of-memory
    error shows up on the first micro-batch, not the last.
    """
    if max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    order = sorted(range(len(sequences)), key=lambda i: (-len(sequences[i]), i))
    batches: list[list[_Row]] = []
    current: list[_Row] = []
    for i in order:
        s = sequences[i]
        longest = len(current[0]) if current else len(s)  # sorted: the first is the longest
        too_many = len(current) >= max_sequences
        too_big = max_tokens is not None and (len(current) + 1) * longest > max_tokens
        if current and (too_many or too_big):
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches


# ---------------------------------------------------------------------------------------------
# 5. Tensors
# ---------------------------------------------------------------------------------------------


def collate(sequences: list[Sequence], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors, aligned to token positions (see the module docstring for the shift).

    input_ids:        [B, T] long, pad_id after each sequence's end
    attention_mask:   [B, T] long, 1 on real tokens, 0 on padding
    loss_mask:        [B, T] bool, True on sampled completion tokens only
    old_logprobs:     [B, T] float32, sampling logprob of token t where loss_mask, else 0
                      (NaN: grammar-chosen, the trainer uses its own)
    token_weights:    [B, T] float32, Sequence.token_weight where loss_mask, else 0
    advantages:       [B]    float32, or [B, T] when any sequence has token_advantages (the
                      others' advantage at each of their tokens, 0 on padding)
    traj_index:       [B]    long
    has_old_logprobs: [B]    bool, False where old_logprobs must come from the trainer itself
    """
    if not sequences:
        raise ValueError("collate needs at least one sequence")
    b, t = len(sequences), max(len(s) for s in sequences)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, t), dtype=torch.long)
    loss_mask = torch.zeros((b, t), dtype=torch.bool)
    old_logprobs = torch.zeros((b, t), dtype=torch.float32)
    for i, s in enumerate(sequences):
        n = len(s)
        input_ids[i, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(s.mask, dtype=torch.bool)
        old_logprobs[i, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    weights = torch.tensor([s.token_weight for s in sequences], dtype=torch.float32)
    advantages = torch.tensor([s.advantage for s in sequences], dtype=torch.float32)  # [B]
    if any(s.token_advantages is not None for s in sequences):
        advantages = torch.zeros((b, t), dtype=torch.float32)  # [B, T]
        for i, s in enumerate(sequences):
            per_token = s.token_advantages or [s.advantage] * len(s)
            advantages[i, : len(s)] = torch.tensor(per_token, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "token_weights": loss_mask * weights[:, None],
        "advantages": advantages,
        "traj_index": torch.tensor([s.traj_index for s in sequences], dtype=torch.long),
        "has_old_logprobs": torch.tensor([s.has_old_logprobs for s in sequences]),
    }


def shift_for_next_token(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The [B, T-1] slices that line up with logits at positions 0..T-2 (hidden_states[:, :-1]).

    target_ids[b, j] = input_ids[b, j + 1] is predicted from position j; loss_mask, old_logprobs,
    token_weights and per-token advantages are shifted the same way; per-sequence tensors pass
    through unchanged.
    The forward pass itself still takes the full, unshifted input_ids and attention_mask.
    """
    out = {k: v for k, v in batch.items() if v.dim() == 1}
    out["target_ids"] = batch["input_ids"][:, 1:]
    for key in ("loss_mask", "old_logprobs", "token_weights", "advantages"):
        if key in batch and batch[key].dim() == 2:  # per-token advantages: packed, distilled
            out[key] = batch[key][:, 1:]
    return out
