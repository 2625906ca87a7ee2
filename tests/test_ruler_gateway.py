"""RULER with real litellm against the real gateway, SmolLM2 as the judge (no network)."""

from __future__ import annotations

import asyncio

import pytest

import ruler
from art_core import TrainableModel, Trajectory, TrajectoryGroup

pytestmark = pytest.mark.engine

QUESTION = [{"role": "system", "content": "Answer the question."},
            {"role": "user", "content": "What is the capital of France?"}]
ANSWERS = ["The capital of France is Paris.", "It is Lyon.", "Paris, I think, or maybe Rome.",
           "I like turtles."]


@pytest.fixture(scope="module")
async def judge_model(backend, smollm2_path):
    model = TrainableModel(name="judge", project="ruler")
    await model.register(backend)
    return model


async def test_smollm2_judge_scores_a_group_or_fails_validation(judge_model, tmp_path):
    group = TrajectoryGroup(trajectories=[
        Trajectory(messages=[*QUESTION, {"role": "assistant", "content": a}]) for a in ANSWERS])
    kwargs = dict(judge=f"openai/{judge_model.name}", api_base=judge_model.base_url,
                  api_key="none", max_retries=2, cache_dir=tmp_path, timeout=120,
                  temperature=0.0, max_tokens=400)
    try:
        scored = await asyncio.wait_for(ruler.score_group(group, **kwargs), 600)
    except ruler.RulerError as e:  # a 135M judge may never produce a valid answer: bounded
        assert "attempt" in str(e).lower()
        print(f"outcome: RulerError after bounded retries: {str(e)[:200]}")
        return
    print(f"outcome: scores {[round(t.reward, 3) for t in scored]}")
    assert scored is not None and len(scored) == 4
    for t in scored:
        assert 0.0 <= t.reward <= 1.0 and t.metrics["ruler_score"] == t.reward
        assert t.logs, "the judge's explanation is kept"
    # the second identical call is served by the cache: no judge request
    again = await ruler.score_group(group, **kwargs)
    assert [t.reward for t in again] == [t.reward for t in scored]
    assert all(t.metrics["ruler_cache_hit"] == 1 for t in again)
