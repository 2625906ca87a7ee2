"""Helpers for tests against the real vLLM engine (the session's `backend` fixture)."""

from __future__ import annotations

import httpx

from art_core import TrainableModel, Trajectory


async def release_engine(backend, base_model: str) -> None:
    """Stop the session backend's engine of a base model that no later test uses (a module's
    own tiny model), with the models it serves: each engine holds 2-4 GB, and the suite's
    peak, with `art serve`'s engines beside the session's, came within 1 GB of the 24 GB."""
    import asyncio

    engine = backend._engines.pop(base_model)
    backend.gateway.engines.pop(engine.served_name, None)
    for name in [n for n, m in backend.gateway.models.items() if m.engine is engine]:
        del backend.gateway.models[name]
    await asyncio.to_thread(engine.stop)


def tiny_config(max_model_len: int = 1024):
    """Engine settings for tiny models: short context, fast start."""
    from art_core import EngineConfig, ModelConfig

    return ModelConfig(engine=EngineConfig(max_model_len=max_model_len, max_num_seqs=16))


async def rollout(model: TrainableModel, i: int) -> Trajectory:
    t = Trajectory(messages=[{"role": "user", "content": f"Tell me a number, {i}"}])
    r = await model.openai_client().chat.completions.create(
        model=model.name, messages=t.messages, max_tokens=8, temperature=1.0)
    t.add_completion(r)
    t.reward = float(len(r.choices[0].message.content or ""))  # any reward that varies
    return t


def check_against_ledger(traj: Trajectory, base_url: str) -> int:
    """Every assistant turn's tokens are exactly the ledger's record of its response."""
    n = 0
    for h in traj.histories():
        assert {t.message_index for t in h.turns} == {
            i for i, m in enumerate(h.messages) if m["role"] == "assistant"}
        for turn in h.turns:
            rec = httpx.get(f"{base_url}/art/completions/{turn.response_id}").json()
            assert turn.prompt_token_ids == rec["prompt_token_ids"]
            assert turn.completion_token_ids == rec["choices"][0]["token_ids"]
            assert turn.logprobs == rec["choices"][0]["logprobs"]
            n += 1
    return n
