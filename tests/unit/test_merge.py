"""art_core.inference.merge: a LoRA checkpoint merged into its base computes what base + LoRA computes, for
each model family, and adapters that do not fit are refused by name (transformers + peft, no
vLLM; tests/engine/test_merged_serving.py serves merged weights from the engine)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from art_core import LoraConfig
from art_core.inference.merge import (
    MergeError,
    merge_lora,
    merged_weights,
    stochastic_bf16,
    write_delta,
)
from art_core.testing.tiny import ARCHS, build_tiny_model
from art_core.train.trainer import Trainer


def trained_adapter(base, out, seed: int = 0):
    """A saved adapter whose B is not zero (a fresh LoRA would merge to the base exactly)."""
    torch.manual_seed(seed)
    trainer = Trainer(str(base), LoraConfig(rank=4, alpha=8), device="cpu")
    with torch.no_grad():
        for name, p in trainer.lora_params.items():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    trainer.save_adapter(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_merged_weights_compute_what_base_plus_lora_computes(arch, tmp_path):
    base = build_tiny_model(tmp_path / "base", arch)
    trained_adapter(base, tmp_path / "adapter")
    merged_dir = merge_lora(base, tmp_path / "adapter", tmp_path / "merged")

    ids = torch.tensor([[1, 5, 9, 17, 33, 2, 8, 40]])
    peft_model = PeftModel.from_pretrained(  # float32 base + the saved adapter
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        str(tmp_path / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits  # [1, T, V]
        got = merged(input_ids=ids).logits
        before = plain(input_ids=ids).logits
    effect = (want - before).abs().mean()
    assert effect > 1e-2, "the adapter should change the output"
    # the base is stored in bf16, so W + BA is rounded to bf16: close, not equal
    assert (got - want).abs().mean() < effect / 10, ((got - want).abs().mean(), effect)

    reference = PeftModel.from_pretrained(  # peft's own merge, in the checkpoint's dtype
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16),
        str(tmp_path / "adapter")).merge_and_unload().state_dict()
    base_t = {k: v for f in base.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    out_t = {k: v for f in merged_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert out_t.keys() == base_t.keys()
    changed = {k for k in base_t if not torch.equal(base_t[k], out_t[k])}
    assert changed and all(k.rsplit(".", 2)[-2] in LoraConfig().target_modules for k in changed)
    assert all(out_t[k].dtype == base_t[k].dtype for k in base_t)
    for k in changed:  # peft rounds to nearest; ours stochastically: one bf16 step at most
        gap = (out_t[k].float() - reference[k].float()).abs()
        assert (gap <= reference[k].float().abs() * 2**-7 + 1e-30).all(), k
        assert (gap == 0).float().mean() > 0.5, f"{k}: most elements round as peft's do"
    assert (merged_dir / "config.json").exists()
    assert not (tmp_path / "merged.tmp").exists()


def _edit_adapter(adapter, tensors=None, config=None):
    if tensors is not None:
        path = adapter / "adapter_model.safetensors"
        save_file(tensors(load_file(str(path))), str(path))
    if config is not None:
        path = adapter / "adapter_config.json"
        path.write_text(json.dumps(config(json.loads(path.read_text()))))


def _rename_module(t):
    key = next(k for k in t if k.endswith("q_proj.lora_A.weight"))
    stem = key[: -len("q_proj.lora_A.weight")]
    out = dict(t)
    for part in ("lora_A", "lora_B"):
        out[f"{stem}nonexistent_proj.{part}.weight"] = out.pop(f"{stem}q_proj.{part}.weight")
    return out


def _wrong_shape(t):
    key = next(k for k in t if k.endswith("q_proj.lora_A.weight"))
    return {**t, key: torch.zeros(t[key].shape[0], t[key].shape[1] + 3)}


@pytest.mark.parametrize("case, tensors, config, message", [
    ("a module the base lacks", _rename_module, None, "have no weight in"),
    ("an A of the wrong width", _wrong_shape, None, "does not fit"),
    ("a lora_A without its B", lambda t: {k: v for k, v in t.items()
                                          if not k.endswith("q_proj.lora_B.weight")},
     None, "has no matching lora_B"),
    ("rsLoRA scaling", None, lambda c: {**c, "use_rslora": True}, "only plain LoRA"),
    ("no LoRA weights", lambda t: {"other.weight": torch.zeros(2, 2)}, None, "no LoRA weights"),
])
def test_adapters_that_do_not_fit_are_refused_and_leave_nothing(case, tensors, config, message,
                                                                 tmp_path):
    base = build_tiny_model(tmp_path / "base", "llama")
    trained_adapter(base, tmp_path / "adapter")
    _edit_adapter(tmp_path / "adapter", tensors, config)
    previous = tmp_path / "merged"
    previous.mkdir()
    (previous / "marker").write_text("the last good merge")
    with pytest.raises(MergeError, match=message):
        merge_lora(base, tmp_path / "adapter", previous)
    assert (previous / "marker").read_text() == "the last good merge", case
    assert not (tmp_path / "merged.tmp").exists()
    # the stream vLLM's worker reloads from is refused at the call, before any tensor flows
    with pytest.raises(MergeError, match=message):
        merged_weights(base, tmp_path / "adapter")


def test_the_stream_vllm_reloads_is_the_checkpoint_merge_lora_writes(tmp_path):
    base = build_tiny_model(tmp_path / "base", "qwen3")
    trained_adapter(base, tmp_path / "adapter")
    written = merge_lora(base, tmp_path / "adapter", tmp_path / "merged")
    on_disk = {k: v for f in written.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    streamed = dict(merged_weights(base, tmp_path / "adapter"))
    assert streamed.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(streamed[name], tensor), name
    base_t = {k: v for f in base.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert any(not torch.equal(streamed[k], base_t[k]) for k in base_t)  # something was merged


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path):
    base = build_tiny_model(tmp_path / "base", "llama")
    with pytest.raises(MergeError, match="not a readable LoRA checkpoint"):
        merge_lora(base, tmp_path, tmp_path / "merged")


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_bf16_keeps_in_expectation_the_update_round_to_nearest_drops(sign):
    """0.05 sits in [2^-5, 2^-4), where a bf16 step is 2^-12; an update of a tenth of it
    vanishes under round-to-nearest, and survives on average under stochastic rounding."""
    step = 2.0**-12
    w = torch.full((200_000,), sign * 0.05).to(torch.bfloat16).float()  # bf16-exact
    x = w + sign * 0.1 * step
    assert torch.equal(x.to(torch.bfloat16).float(), w)  # round to nearest: the update is gone
    y = stochastic_bf16(x, seed=0)
    assert y.dtype == torch.bfloat16
    assert set(y.float().unique().tolist()) == {w[0].item(), w[0].item() + sign * step}
    assert abs(y.float().mean().item() - x[0].item()) < 0.05 * 0.1 * step  # unbiased
    assert torch.equal(stochastic_bf16(x, seed=0), y)  # a merge is reproducible
    assert not torch.equal(stochastic_bf16(x, seed=1), y)
    assert torch.equal(stochastic_bf16(w, seed=0).float(), w)  # exact values stay exact
    special = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0])
    assert torch.equal(stochastic_bf16(special, seed=0).float(), special)
    assert stochastic_bf16(torch.tensor([float("nan")]), seed=0).isnan().all()


def test_a_float32_merge_keeps_the_delta_that_bf16_rounds_away(tmp_path):
    """Served in float32 (a CPU without native bf16), the merged tensors are stored in float32:
    the served model then matches base + LoRA far more closely than a bf16 merge."""
    base = build_tiny_model(tmp_path / "base", "llama")
    trained_adapter(base, tmp_path / "adapter")
    wide = merge_lora(base, tmp_path / "adapter", tmp_path / "wide", dtype="float32")
    narrow = merge_lora(base, tmp_path / "adapter", tmp_path / "narrow")
    base_t = {k: v for f in base.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    wide_t = {k: v for f in wide.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    targets = {k for k in base_t if k.rsplit(".", 2)[-2] in LoraConfig().target_modules}
    assert targets and all(wide_t[k].dtype == torch.float32 for k in targets)
    assert all(wide_t[k].dtype == base_t[k].dtype for k in base_t if k not in targets)

    ids = torch.tensor([[1, 5, 9, 17, 33, 2, 8, 40]])
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
        str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        errors = [(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(
            input_ids=ids).logits - want).abs().mean() for d in (wide, narrow)]
    assert errors[0] < 1e-4 and errors[0] < errors[1] / 10, errors


def _logits(model_dir, adapter=None):
    ids = torch.tensor([[1, 5, 9, 17, 33, 2, 8, 40]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits  # [1, T, V]


@pytest.mark.parametrize("served", ["older step", "the base", "another model"])
def test_a_delta_lora_on_merged_weights_computes_the_other_adapter(served, tmp_path):
    """write_delta: merged step n (float32, so that only the delta's own error is measured)
    plus the delta LoRA computes what base + adapter k computes; for the base, the base."""
    base = build_tiny_model(tmp_path / "base", "llama")
    trained_adapter(base, tmp_path / "step2", seed=2)
    merged = merge_lora(base, tmp_path / "step2", tmp_path / "merged", dtype="float32")
    if served == "older step":
        trained_adapter(base, tmp_path / "target", seed=1)
    elif served == "another model":  # another rank and fewer modules than the merged one
        torch.manual_seed(3)
        trainer = Trainer(str(base), LoraConfig(rank=2, alpha=16, target_modules=["q_proj",
                                                "v_proj", "up_proj"]), device="cpu")
        with torch.no_grad():
            for name, p in trainer.lora_params.items():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        trainer.save_adapter(tmp_path / "target")
    target = None if served == "the base" else tmp_path / "target"
    delta = write_delta(tmp_path / "step2", target, tmp_path / "delta")

    want = _logits(base, target)
    got = _logits(merged, delta)
    moved = (want - _logits(merged)).abs().mean()  # what the delta has to undo
    assert moved > 1e-2
    assert (got - want).abs().mean() < moved / 100, ((got - want).abs().mean(), moved)
    cfg = json.loads((delta / "adapter_config.json").read_text())
    rank = 4 + {"older step": 4, "the base": 0, "another model": 2}[served]
    assert (cfg["r"], cfg["lora_alpha"]) == (rank, rank)
