"""EngineConfig.serve_merged on the real vLLM engine: after a step, vLLM samples from the merged
weights of exactly that step (its logprobs are the trained policy's, not the base's), and every
other name (an older step, the base by name, a second model on the same base) answers through a
delta LoRA with the logprobs transformers + peft compute for that checkpoint, also after a
further step and after vLLM is killed and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from art_core import EngineConfig, ModelConfig, TrainableModel, TrainConfig
from art_core.gather import gather_trajectory_groups
from art_core.testing.tiny import build_tiny_model
from art_core.train.trainer import Trainer
from tests.support.engine import release_engine, rollout

pytestmark = pytest.mark.engine

IDS = [1, 7, 12, 30, 41, 5, 19, 63, 2, 27, 11, 50]


def merged_config() -> ModelConfig:
    return ModelConfig(engine=EngineConfig(max_model_len=1024, max_num_seqs=16,
                                           serve_merged=True))


async def engine_logprobs(model: TrainableModel, name: str) -> torch.Tensor:
    """vLLM's logprob of each token of IDS given the ones before it: [len(IDS) - 1]."""
    async with httpx.AsyncClient(timeout=120) as c:
        r = await c.post(f"{model.base_url}/completions", json={
            "model": name, "prompt": IDS, "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    rows = r.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([row[str(t)]["logprob"] for row, t in zip(rows, IDS[1:], strict=True)])


def reference_logprobs(base: str, adapter=None) -> torch.Tensor:
    """transformers (float32), with the step's peft adapter if given: [len(IDS) - 1]."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([IDS])).logits[0, :-1]  # [T-1, V]
    return logits.log_softmax(-1).gather(-1, torch.tensor(IDS[1:])[:, None])[:, 0]


async def test_merged_serving_samples_the_trained_step(backend, tmp_path_factory, monkeypatch):
    base = str(build_tiny_model(tmp_path_factory.mktemp("merged") / "qwen3", "qwen3"))
    threads = []  # where the trainers were built (2) and stepped (3): one thread, one OpenMP team
    for method in ("__init__", "step"):
        original = getattr(Trainer, method)

        def recorded(self, *args, _original=original, **kwargs):
            threads.append(threading.current_thread().name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(Trainer, method, recorded)
    try:
        await check_merged_serving(backend, base)
        assert len(threads) == 5 and all(t.startswith("art-trainer") for t in threads), threads
    finally:  # this base is the module's own: free its engine's memory for the tests after
        if base in backend._engines:
            await release_engine(backend, base)


async def train_one_step(model: TrainableModel) -> int:
    groups = await gather_trajectory_groups(
        ([rollout(model, i) for i in range(4)] for _ in range(2)), show_progress=False)
    return (await model.train(groups, TrainConfig(learning_rate=5e-2, bf16=False))).step


async def greedy_logprobs(model: TrainableModel, name: str, n: int) -> list[float]:
    async with httpx.AsyncClient(timeout=300) as c:
        r = await c.post(f"{model.base_url}/completions", json={
            "model": name, "prompt": IDS, "max_tokens": n, "temperature": 0, "logprobs": 0,
            "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["token_logprobs"]


async def check_never_batched_beside_deltas(backend, model: TrainableModel,
                                            deltas: list[str]) -> None:
    """The latest step (vLLM's base weights) asked while delta LoRAs decode answers as it does
    alone: vLLM-CPU adds the last LoRA slot to a request without one in a mixed batch, so the
    gateway lets the two kinds take turns (art_core/inference/lora_turns.py). Without the
    turns the latest's logprobs moved by ~0.2 nats here."""
    alone = await greedy_logprobs(model, model.name, 8)
    busy = [asyncio.create_task(greedy_logprobs(model, name, 48)) for name in deltas * 2]
    await asyncio.sleep(0.5)  # the deltas are decoding when the latest arrives
    beside = await greedy_logprobs(model, model.name, 8)
    await asyncio.gather(*busy)
    off = max(abs(a - b) for a, b in zip(alone, beside, strict=True))
    assert off < 1e-3, f"{model.name} beside delta LoRAs is served {off:.4f} away from alone"
    assert backend.gateway.turns.waits(backend._engines[model.base_model]) > 0


async def check_merged_serving(backend, base: str) -> None:
    model = TrainableModel(name="merged-policy", project="merged", base_model=base,
                           config=merged_config())
    await model.register(backend)
    base_lp = reference_logprobs(base)
    at_start = await engine_logprobs(model, model.name)
    assert await train_one_step(model) == 1
    policy = {1: reference_logprobs(base, backend.checkpoint_dir(model, 1))}
    moved = (policy[1] - base_lp).abs().mean().item()
    assert moved > 0.05, f"the step barely changed the policy ({moved:.4f}): test too weak"
    assert (at_start - base_lp).abs().mean().item() < moved / 5  # step 0 is the base

    async def check(served: dict[str, torch.Tensor]) -> None:
        for name, want in served.items():
            off = (await engine_logprobs(model, name) - want).abs().mean().item()
            assert off < moved / 5, f"{name} is served {off:.4f} away (a step moved {moved:.4f})"

    engine = backend._engines[base]
    assert engine.merged == f"{model.name}@1"
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.model == f"{model.name}@1"
    await check({model.name: policy[1], f"{model.name}@0": base_lp, base: base_lp})

    # a second model on the same base: served as a delta from the first one's merged weights
    other = TrainableModel(name="merged-other", project="merged", base_model=base,
                           config=merged_config())
    await other.register(backend)
    assert await train_one_step(other) == 1
    other_lp = reference_logprobs(base, backend.checkpoint_dir(other, 1))
    assert engine.merged == f"{model.name}@1"
    await check({other.name: other_lp})

    # a step changes what `name` serves and leaves name@1 (now a delta) as it was
    assert await train_one_step(model) == 2
    policy[2] = reference_logprobs(base, backend.checkpoint_dir(model, 2))
    assert (policy[2] - policy[1]).abs().mean().item() > moved / 5
    assert engine.merged == f"{model.name}@2"
    served = {model.name: policy[2], f"{model.name}@1": policy[1], base: base_lp,
              other.name: other_lp}
    await check(served)
    await check_never_batched_beside_deltas(backend, model, [f"{model.name}@1", base, other.name])

    # vLLM killed: the supervisor restarts it from the base, merges step 2 in again, and
    # every other name is served again from its delta
    os.killpg(engine._proc.pid, signal.SIGKILL)
    await asyncio.sleep(1)
    await asyncio.to_thread(engine.wait_ready, 240)
    assert engine.restarts == 1
    await asyncio.wait_for(check(served), 240)
    assert await model.get_step() == 2
