"""The trainer's side of the served-policy check (ARCHITECTURE invariant 9).

After each step the trainer scores a small fixed probe (a short conversation in the model's own
chat template, a few dozen tokens) with the adapter it just trained, and writes the token ids
and the logprob of each token given the ones before it into the checkpoint as `probe.json`: a
manifest of what this step's policy says, which travels with the checkpoint. Before the
checkpoint's name is published, the gateway asks vLLM for the same tokens' prompt logprobs
under that name and compares (art_core/inference/policy_check.py).

The logprobs are of the raw (temperature 1) distribution, computed in float32 without
autocast, as vLLM's prompt logprobs are (its default logprobs mode).
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


def write_probe(checkpoint: Path, token_ids: list[int], logprobs: list[float]) -> None:
    """The manifest, beside the adapter (written before the checkpoint is committed)."""
    (Path(checkpoint) / PROBE_FILE).write_text(
        json.dumps({"token_ids": token_ids, "logprobs": logprobs}))
