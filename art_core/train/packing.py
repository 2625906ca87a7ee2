"""Shared prompt prefixes trained once: the sequences of a group packed into one row.

Every trajectory of a GRPO group starts from the same prompt (system prompt, worked examples,
the task), and in an agent that prompt is most of each sequence: 8 episodes of the demo's
lookup agent forward ~4,900 tokens of which ~3,400 are the same prompt eight times. Packing
forwards it once:

    row      = P + S_1 + S_2 + ... + S_k     P: the shared prefix, S_i: the rest of sequence i
    position = 0..|P|-1, then every S_i continues at |P| (each sequence sees its own positions)
    attend   = a token of P sees P causally; a token of S_i sees all of P and S_i causally,
               never another S_j

so the logits at every token of S_i are those of sequence i alone (same tokens before it, same
positions), and so are the loss and its gradient. The shared prefix holds untrained tokens only
and stops one token short of where the sequences part: each S_i starts with that last common
token, whose hidden state predicts S_i's first own token. The next-token shift then needs no
special case: the last token of S_i is followed in the row by the first token of S_{i+1}, which
is never trained, so the shifted loss mask is 0 there.

What may share: sequences with sampler logprobs (re-rendered ones keep a row of their own) whose
common untrained prefix is at least `MIN_SHARED` tokens, greedily, in sorted order so that equal
prefixes are neighbours. A row never exceeds `max_tokens` (the trainer passes micro_batch_size x
the step's longest sequence, the padded size a micro-batch already had, capped at
`MAX_ROW_TOKENS`), so packing never needs more activation memory than the batch it replaces; the
[T, T] mask is its only new cost. Models whose attention takes no 4-D mask, or whose sliding
window would bind, are not packed (`can_pack`).

Tensors of `collate` (B rows, T positions), as `batch.collate` plus:

    position_ids    [B, T]       long, restarting at |P| for each S_i
    attention_mask  [B, 1, T, T] the 4-D mask above, True = may attend (bool for sdpa; for eager
                                 attention 0 / dtype-min additive, see `mask_for`)
    advantages      [B, T]       per token: the rows mix trajectories (and a distilled
                                 sequence's `token_advantages` vary along it)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from art_core.train.batch import Sequence

MIN_SHARED = 16
"""Shortest prefix shared. Below a chat template's own framing (~10-20 tokens) the sequences
share nothing of their content, and the saving would not pay for the masked attention kernel."""


@dataclass(frozen=True)
class Packed:
    """Sequences trained in one row over their shared, untrained prefix of `prefix` tokens."""

    prefix: int
    sequences: tuple[Sequence, ...]

    def __post_init__(self) -> None:
        if len(self.sequences) < 2:
            raise ValueError("a packed row needs at least two sequences")
        if self.prefix < 1:
            raise ValueError(f"a packed row needs a shared prefix, got {self.prefix} tokens")
        first = self.sequences[0]
        for s in self.sequences:
            if len(s) <= self.prefix or s.token_ids[: self.prefix] != first.token_ids[: self.prefix]:
                raise ValueError("the sequences of a packed row must share its prefix")
            if any(s.mask[: self.prefix + 1]):
                raise ValueError("a packed row's prefix and the token after it must be untrained")

    def __len__(self) -> int:
        return self.prefix + sum(len(s) - self.prefix for s in self.sequences)

    @property
    def num_trained_tokens(self) -> int:
        return sum(s.num_trained_tokens for s in self.sequences)


Row = Sequence | Packed


def _shared(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of a and b in which neither has a trained token."""
    n = 0
    for x, y, ma, mb in zip(a.token_ids, b.token_ids, a.mask, b.mask, strict=False):
        if x != y or ma or mb:
            break
        n += 1
    return n


def share_prefixes(sequences: Seq[Sequence], max_tokens: int) -> list[Row]:
    """The sequences as rows: packed where they share a prefix (module docstring), else alone.

    Deterministic. Every input sequence is in exactly one row. A row's length (tokens forwarded)
    is at most `max_tokens`, unless one sequence alone is longer.
    """
    order = sorted(range(len(sequences)), key=lambda i: (sequences[i].token_ids, i))
    rows: list[Row] = []
    members: list[Sequence] = []
    prefix = 0  # the shared prefix of `members` (one short of their common untrained tokens)

    def close() -> None:
        if len(members) > 1:
            rows.append(Packed(prefix, tuple(members)))
        else:
            rows.extend(members)

    for i in order:
        s = sequences[i]
        if members and s.has_old_logprobs and members[0].has_old_logprobs:
            shared = _shared(members[0], s) - 1  # lcp(m_j, s) >= min(lcp(m_0, m_j), lcp(m_0, s))
            p = shared if len(members) == 1 else min(prefix, shared)
            length = p + sum(len(m) - p for m in members) + len(s) - p
            if p >= MIN_SHARED and length <= max_tokens:
                members.append(s)
                prefix = p
                continue
        close()
        members, prefix = [s], 0
    close()
    return rows


def forwarded_tokens(rows: Seq[Row]) -> int:
    """Tokens the forward pass runs over (the shared prefixes once)."""
    return sum(len(r) for r in rows)


def mask_for(allowed: torch.Tensor, attn_implementation: str) -> torch.Tensor:
    """The 4-D mask in the form the attention implementation takes (transformers passes a 4-D
    mask through unchanged): bool for sdpa, additive float32 for eager (it adds the mask to the
    scores, then softmaxes in float32). Others (flash attention) take no custom mask; the trainer
    does not pack for them (`PACKABLE_ATTENTION`)."""
    if attn_implementation == "sdpa":
        return allowed
    if attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(torch.float32).min)
    raise ValueError(f"no 4-D attention mask for attn_implementation={attn_implementation!r}")


PACKABLE_ATTENTION = ("sdpa", "eager")

MAX_ROW_TOKENS = 8192
"""Longest packed row: its [T, T] mask is T^2 bytes (64 MiB here), and an attention kernel that
takes a custom mask may hold [heads, T, T] scores where the causal kernel holds none."""


def can_pack(model_config: Any, longest: int) -> bool:
    """Whether rows can be packed for this model: its attention takes a 4-D mask, and no sliding
    window binds (the mask here is full attention; a window shorter than the longest sequence
    would make packed and unpacked logits differ)."""
    if getattr(model_config, "_attn_implementation", None) not in PACKABLE_ATTENTION:
        return False
    window = getattr(model_config, "sliding_window", None)
    if not window or getattr(model_config, "use_sliding_window", True) is False:
        return True
    types = getattr(model_config, "layer_types", None)
    return (types is not None and "sliding_attention" not in types) or longest <= window


def collate(rows: Seq[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors of rows (module docstring); the 4-D mask is boolean here, see
    `mask_for` for the form a model takes. A plain Sequence is a row of one segment."""
    if not rows:
        raise ValueError("collate needs at least one row")
    b, t = len(rows), max(len(r) for r in rows)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    position_ids = torch.zeros((b, t), dtype=torch.long)
    allowed = torch.zeros((b, 1, t, t), dtype=torch.bool)
    loss_mask = torch.zeros((b, t), dtype=torch.bool)
    old_logprobs = torch.zeros((b, t), dtype=torch.float32)
    token_weights = torch.zeros((b, t), dtype=torch.float32)
    advantages = torch.zeros((b, t), dtype=torch.float32)
    has_old = torch.zeros(b, dtype=torch.bool)
    causal = torch.ones((t, t), dtype=torch.bool).tril()
    # padding attends to itself only: a query that may attend to nothing gives NaN in softmax,
    # and NaN reaches the LoRA gradients through backward even where no loss is taken
    allowed[:, 0] = torch.eye(t, dtype=torch.bool)
    for i, row in enumerate(rows):
        p, members = (row.prefix, row.sequences) if isinstance(row, Packed) else (0, (row,))
        has_old[i] = all(s.has_old_logprobs for s in members)
        input_ids[i, :p] = torch.tensor(members[0].token_ids[:p], dtype=torch.long)
        position_ids[i, :p] = torch.arange(p)
        allowed[i, 0, :p, :p] = causal[:p, :p]
        start = p
        for s in members:
            n = len(s) - p
            seg = slice(start, start + n)
            input_ids[i, seg] = torch.tensor(s.token_ids[p:], dtype=torch.long)
            position_ids[i, seg] = torch.arange(p, len(s))
            loss_mask[i, seg] = torch.tensor(s.mask[p:], dtype=torch.bool)
            old_logprobs[i, seg] = torch.tensor(s.old_logprobs[p:], dtype=torch.float32)
            token_weights[i, seg] = loss_mask[i, seg] * s.token_weight
            advantages[i, seg] = (s.advantage if s.token_advantages is None
                                  else torch.tensor(s.token_advantages[p:], dtype=torch.float32))
            allowed[i, 0, seg, seg] = causal[:n, :n]
            allowed[i, 0, seg, :p] = True
            start += n
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": allowed,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "token_weights": token_weights,
        "advantages": advantages,
        "has_old_logprobs": has_old,
    }
