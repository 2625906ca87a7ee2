"""Tiny random models for fast tests and benchmarks (not a user-facing default).

`build_tiny_model(path, arch)` writes a Hugging Face directory (safetensors) that vLLM and
transformers both load, in about a second: a byte-level BPE tokenizer trained in-process on a
small built-in corpus (so decoding ids always gives back the text), the ChatML + tools chat
template we ship, and a random 2-layer model with head_dim 32 (vLLM's CPU attention supports
32, 64, 80, ... but not 16). Architectures: "llama", "qwen3", "qwen2" (Qwen2.5 uses it) and
"gemma3" (Gemma 3's text model): the families users train most.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from art_core.base_models import tools_chat_template

Arch = Literal["llama", "qwen3", "qwen2", "gemma3"]
ARCHS: tuple[Arch, ...] = ("llama", "qwen3", "qwen2", "gemma3")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """
The capital of France is Paris. The capital of Italy is Rome. What is the weather like today?
You are a helpful assistant. Please answer the question briefly and call a tool when needed.
<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>
<tool_response> {"temperature": 21, "unit": "celsius"} </tool_response> <tools> </tools>
system user assistant tool function name arguments description parameters type object string
number integer boolean required properties yes no true false null 0 1 2 3 4 5 6 7 8 9 10 100
Hello! How can I help you? I think the answer is 42. Let me search for that. Done. Thanks.
the of and to in is that for it as was with be by on not he this are or his from at which
"""


def _train_tokenizer(vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None,
    )
    fast.chat_template = tools_chat_template()
    return fast


def build_tiny_model(
    path: str | Path, arch: Arch = "llama", *, seed: int = 0, vocab_size: int = 512,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a tiny random `arch` model with tokenizer and chat template to `path` (atomic)."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
    )

    path = Path(path)
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    tokenizer = _train_tokenizer(vocab_size)
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="bfloat16",
    )
    if arch == "llama":
        config = LlamaConfig(**common)
    elif arch == "qwen3":
        config = Qwen3Config(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "gemma3":
        # Gemma 3 alternates sliding-window and global attention layers; a window shorter
        # than the tests' sequences keeps both kinds of layer exercised.
        config = Gemma3TextConfig(**common, sliding_window=64, query_pre_attn_scalar=32,
                                  layer_types=["sliding_attention", "full_attention"])
    else:
        raise ValueError(f"unknown tiny-model arch {arch!r}; use one of {ARCHS}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-default init so logits are not flat: greedy outputs then depend on weights.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
               "pad_token_id": config.pad_token_id}
        (tmp / "generation_config.json").write_text(json.dumps(gen))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
