"""One BFCL multi-turn episode with the embedded SmolLM2 through the real gateway, scored by
BFCL's multi-turn checker: the wiring of art_bfcl/multi_turn_rollout.py on a real model (the
episode's logic on scripted answers is tests/unit/test_bfcl_multi_turn.py).

`nightly`: an entry's tool docs are ~4k tokens, so this needs its own 8,192-token engine and
pays CPU prefill on every call (~1-2 min)."""

from __future__ import annotations

import pytest

from art_bfcl import BfclWorker, multi_turn_episode, unavailable_reason
from art_core import EngineConfig, ModelConfig, TrainableModel
from tests.support.engine import release_engine

pytestmark = [pytest.mark.engine, pytest.mark.nightly,
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=str(unavailable_reason()))]

ENTRY = "multi_turn_base_100"  # one class (TradingBot), two user turns, one call each


@pytest.fixture
def smol_8k(smollm2_path, tmp_path):
    """SmolLM2 under a path of its own: the session's SmolLM2 engine serves 4,096 tokens and
    one base is served with one engine configuration."""
    base = tmp_path / "smollm2-8k"
    base.mkdir()
    for f in smollm2_path.iterdir():
        (base / f.name).symlink_to(f)
    return base


async def test_a_smollm2_episode_on_a_one_class_entry_returns_a_verdict(backend, smol_8k):
    model = TrainableModel(name="bfcl-mt", project="bfcl", base_model=str(smol_8k),
                           config=ModelConfig(engine=EngineConfig(max_model_len=8192)))
    await model.register(backend)
    try:
        with BfclWorker() as worker:
            item = next(i for i in worker.multi_turn() if i.id == ENTRY)
            assert item.classes == ("TradingBot",) and len(item.turns) == 2
            traj = await multi_turn_episode(model.openai_client(), model.name, item, worker,
                                            max_tokens=64)
    finally:
        await release_engine(backend, str(smol_8k))
    assert traj.metrics["turns"] == 2.0
    assert traj.metrics["passed"] in (0.0, 1.0)
    assert traj.reward == pytest.approx(traj.metrics["turns_passed"] / 2)
    assert traj.turns and all(t.completion_token_ids for t in traj.turns)  # sampled, recorded
    assert [m["content"] for m in traj.messages if m["role"] == "user"] == \
        [t[0]["content"] for t in item.turns]
