"""SFT on the real engine (tiny random llama): an SFT step is served like an RL step (the
name follows it, what it serves changed towards the data), and RL continues from it.
`art serve` + RemoteBackend: tests/engine/test_server.py. Without an engine:
tests/unit/test_sft.py."""

from __future__ import annotations

import pytest

from art_core import SFTConfig, TrainableModel, TrainConfig
from art_core.gather import gather_trajectory_groups
from art_core.storage import ModelDir
from tests.support.engine import rollout, tiny_config

pytestmark = pytest.mark.engine

PROMPT = [{"role": "user", "content": "Say the word."}]
ANSWER = "apple apple apple"
DATA = [{"messages": [*PROMPT, {"role": "assistant", "content": ANSWER}]}] * 4


async def top_token(model: TrainableModel) -> tuple[str, float]:
    """The served model's most likely first answer token and its logprob."""
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=PROMPT, max_tokens=1, temperature=0.0, logprobs=True)
    lp = r.choices[0].logprobs.content[0]
    return lp.token, lp.logprob


async def test_an_sft_step_is_served_and_rl_continues_from_it(backend, tiny_models):
    model = TrainableModel(name="sft-tiny", project="sft", base_model=str(tiny_models["llama"]),
                           config=tiny_config())
    await model.register(backend)
    before = await top_token(model)
    r = await model.train_sft(DATA, SFTConfig(epochs=12, batch_size=4, learning_rate=1e-2,
                                              schedule="constant", bf16=False))
    assert r.step == 1 and r.metrics["loss"] < r.metrics["loss_first_epoch"]
    after = await top_token(model)
    # the served model now starts the answer it was taught (the tiny tokenizer splits words)
    assert after[0] and ANSWER.startswith(after[0]) and after != before, (before, after)

    groups = await gather_trajectory_groups([[rollout(model, i) for i in range(3)]],
                                            show_progress=False)
    r2 = await model.train(groups, TrainConfig(learning_rate=1e-3, bf16=False))
    md = ModelDir(backend.root, model.project, model.name)
    assert r2.step == 2 and [md.step_record(s)["kind"] for s in (1, 2)] == ["sft", "rl"]
    assert {turn.step for g in groups for t in g.trajectories for turn in t.turns} == {1}
