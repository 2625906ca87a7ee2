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


@pytest.mark.nightly  # 3 x 400 free tokens; the logprob modes below are the fast check
async def test_smollm2_judge_scores_a_group_or_fails_validation(judge_model, tmp_path):
    group = TrajectoryGroup(trajectories=[
        Trajectory(messages=[*QUESTION, {"role": "assistant", "content": a}]) for a in ANSWERS])
    kwargs = dict(judge=f"openai/{judge_model.name}", api_base=judge_model.base_url,
                  api_key="none", max_retries=2, cache_dir=tmp_path, timeout=120,
                  temperature=0.0, max_tokens=400, mode="listwise")
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


@pytest.mark.parametrize("mode", ["auto", "pairwise"])
async def test_smollm2_judge_logprob_modes_always_answer(judge_model, tmp_path, mode):
    """Through the real gateway the judge's top logprobs arrive, so every answer is usable."""
    group = TrajectoryGroup(trajectories=[
        Trajectory(messages=[*QUESTION, {"role": "assistant", "content": a}]) for a in ANSWERS])
    scored = await asyncio.wait_for(ruler.score_group(
        group, f"openai/{judge_model.name}", mode=mode, api_base=judge_model.base_url,
        api_key="none", cache_dir=tmp_path, timeout=120), 600)
    rewards = [t.reward for t in scored]
    print(f"{mode}: scores {[round(r, 3) for r in rewards]}")
    expected_mode = ruler.LOCAL_DEFAULT_MODE if mode == "auto" else mode  # a loopback judge
    assert all(f"[{expected_mode}]" in t.logs[-1] for t in scored)
    assert all(0.0 <= r <= 1.0 for r in rewards) and len(set(rewards)) > 1
    metrics = scored.trajectories[0].metrics
    assert metrics["ruler_rating_mass"] > 0.2  # the judge does answer with the rating tokens
    if expected_mode == "yesno":  # measured 0.18 against 0.085: the right answer above the joke
        assert rewards[0] > rewards[3]
    assert metrics["ruler_judge_calls"] == {"pairwise": 12}.get(expected_mode, 4)
