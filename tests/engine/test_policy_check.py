"""The served-policy check on the real vLLM engine (ARCHITECTURE invariant 9): a normal step's
check passes (what vLLM serves under name@step matches the trainer's probe to float32
numerics); a checkpoint spoiled between the commit and the publish (an adapter whose modules
match nothing, one whose weights are not the trained ones, the previous step's adapter under
the new name) fails it loudly: `train` raises `PolicyMismatch` naming the step, the previous
step keeps serving, `/health` says degraded and the history row says so; the next good step
is published and the health is ok again.

The corruption happens in `train`'s progress callback at the "trained" phase: the checkpoint
is committed, vLLM has not loaded it yet."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from art_core import EngineConfig, ModelConfig, TrainableModel, TrainConfig
from art_core.gather import gather_trajectory_groups
from art_core.inference.policy_check import PolicyMismatch
from tests.support.engine import rollout

pytestmark = pytest.mark.engine

CONFIG = TrainConfig(learning_rate=5e-2, bf16=False)  # moves the probe well past the tolerance
TOLERANCE = 0.01  # float32 on both sides: numerics differ by ~1e-5 on the tiny model


def nothing_matches(checkpoint: Path, previous: Path) -> None:
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    config["target_modules"] = ["no_such_module"]
    (checkpoint / "adapter_config.json").write_text(json.dumps(config))


def other_weights(checkpoint: Path, previous: Path) -> None:
    path = checkpoint / "adapter_model.safetensors"
    tensors = load_file(str(path))
    save_file({k: v * 20 if "lora_B" in k else v for k, v in tensors.items()}, str(path))


def previous_adapter(checkpoint: Path, previous: Path) -> None:
    shutil.copy(previous / "adapter_model.safetensors", checkpoint / "adapter_model.safetensors")


@pytest.fixture(scope="module")
async def policy(backend, tiny_models) -> TrainableModel:
    model = TrainableModel(
        name="policy-tiny", project="policy", base_model=str(tiny_models["llama"]),
        config=ModelConfig(engine=EngineConfig(max_model_len=1024, max_num_seqs=16,
                                               policy_check_tolerance=TOLERANCE)))
    await model.register(backend)
    return model


async def groups(model: TrainableModel) -> list:
    return await gather_trajectory_groups(
        ([rollout(model, i) for i in range(4)] for _ in range(2)), show_progress=False)


async def served_step(model: TrainableModel) -> str:
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    return r.model


async def health(backend) -> dict:
    async with httpx.AsyncClient() as c:
        return (await c.get(backend.base_url.removesuffix("/v1") + "/health")).json()


async def test_a_normal_step_passes_the_check(backend, policy):
    result = await policy.train(await groups(policy), CONFIG)
    m = result.metrics
    print(f"policy check: mean |diff| {m['policy_check_mean_abs']:.2e}, max "
          f"{m['policy_check_max_abs']:.2e}, {1000 * m['policy_check_seconds']:.0f} ms")
    assert m["policy_checked"] == 1.0 and m["policy_check_mean_abs"] < TOLERANCE
    assert await served_step(policy) == f"{policy.name}@{result.step}"
    assert (await health(backend))["status"] == "ok"


@pytest.mark.parametrize("spoil", [nothing_matches, other_weights, previous_adapter],
                         ids=["modules-match-nothing", "other-weights", "previous-adapter"])
async def test_a_spoiled_checkpoint_fails_the_check_and_the_previous_step_serves(
        backend, policy, spoil):
    before = await policy.get_step()
    data = await groups(policy)

    def progress(event: dict) -> None:
        if event["phase"] == "trained":  # committed, not yet loaded by vLLM
            step = event["step"]
            spoil(backend.checkpoint_dir(policy, step), backend.checkpoint_dir(policy, step - 1))

    with pytest.raises(PolicyMismatch, match=rf"{policy.name}@{before + 1}: what vLLM serves"):
        await backend.train(policy, data, CONFIG, progress=progress)
    assert await served_step(policy) == f"{policy.name}@{before}"
    status = await health(backend)
    assert status["status"] == "degraded" and policy.name in status["policy_mismatch"]
    rows = [r for r in backend._dir(policy).read_history() if r["step"] == before + 1]
    assert rows and rows[0]["policy_mismatch"] == 1.0 and rows[0]["policy_check_mean_abs"] > \
        TOLERANCE

    # the next step trains on from the trainer's weights and passes
    good = await policy.train(await groups(policy), CONFIG)
    assert good.metrics["policy_checked"] == 1.0
    assert await served_step(policy) == f"{policy.name}@{good.step}"
    assert (await health(backend))["status"] == "ok"
    assert torch.isfinite(torch.tensor(good.metrics["loss"]))
