"""On-policy distillation: the student samples, the teacher grades every token it sampled.

The algorithm (Agarwal et al. 2024, "On-Policy Distillation of Language Models" / GKD; Thinking
Machines, "On-Policy Distillation", 2025), one step:

1. the student runs the rollouts (`gather_trajectory_groups`, the same `rollout(scenario)` as
   art_core/loop.py); every assistant turn records the sampled ids and the sampler's logprobs;
2. `score_with_teacher`: the teacher reads each turn's prompt + completion ids in one forward
   pass and returns its logprob of every completion token (vLLM's `prompt_logprobs`, asked with
   `max_tokens=1`: nothing worth generating); they go into `SampledTurn.teacher_logprobs`;
3. `model.train(groups, TrainConfig(advantage="teacher"))`: the GRPO loss with, per token,
   A_t = teacher_logprob_t - sampler_logprob_t = -(log p_student - log p_teacher)(x_t), the
   negative single-sample estimate of the reverse KL(student || teacher) at that position. A
   token the teacher finds likelier than the student did is pushed up, a less likely one down;
   the importance ratio against the sampler's logprobs and its clipping are the loss's own.
   Rewards from the rollout are logged, not used: the teacher is the only signal, dense, on
   every token.

Because the advantage travels in the trajectories and the step is an ordinary `train` call,
this works through every backend (local, remote, multi-GPU), is journaled before the step and
replays after a crash like any GRPO step.

The teacher must share the student's tokenizer: it scores the student's token ids as they
are. A teacher on our own gateway (a checkpoint `name@k`, another model on the same base, or the
base model by name) or any `vllm serve` endpoint returns prompt logprobs; OpenAI's API does not,
and `score_with_teacher` says so instead of training on nothing. Both logprobs are of the raw
(temperature 1) distributions, vLLM's default logprobs mode, as the trainer's are.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from art_core.gather import gather_trajectory_groups
from art_core.trajectory import SampledTurn, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from art_core.config import TrainConfig
    from art_core.model import Model, TrainableModel, TrainResult

MAX_CONCURRENCY = 1
"""Scoring requests in flight at once. One: vLLM 0.32 (CPU) crashes its engine when requests
with `prompt_logprobs` meet in a batch with LoRA enabled (einsum error in `bgmv_shrink`;
FIELD-NOTES, and tests/engine/test_distill_on_policy.py hit it with 6 at once through `name@0`),
and every name on our engine is served through LoRA. Raise it for a teacher served without
LoRA."""


class TeacherError(RuntimeError):
    """The teacher endpoint cannot score the student's tokens (no prompt logprobs, another
    vocabulary, or it refused the request)."""


async def score_with_teacher(groups: Sequence[TrajectoryGroup], teacher: Model, *,
                             max_concurrency: int = MAX_CONCURRENCY) -> list[TrajectoryGroup]:
    """Copies of `groups` whose every sampled turn carries `teacher_logprobs`: the teacher's
    logprob of each completion token given the turn's prompt and the tokens before it.

    `teacher` is any `Model` behind an OpenAI-compatible `/v1/completions` that returns vLLM's
    `prompt_logprobs`, e.g. `Model(name="agent@3", base_url=student.base_url)` for an earlier
    checkpoint on our gateway. Raises `TeacherError` when it returns none, or returns logprobs
    that do not line up with the student's tokens (another tokenizer).
    """
    client = teacher.openai_client()
    slots = asyncio.Semaphore(max_concurrency)

    async def score(turn: SampledTurn) -> SampledTurn:
        async with slots:
            logprobs = await teacher_logprobs(client, teacher, turn)
        return SampledTurn.model_validate({**turn.model_dump(), "teacher_logprobs": logprobs})

    out = [g.model_copy(deep=True) for g in groups]
    histories = [h for g in out for t in g.trajectories for h in t.histories() if h.turns]
    scored = await asyncio.gather(*(asyncio.gather(*(score(turn) for turn in h.turns))
                                    for h in histories))
    for history, turns in zip(histories, scored, strict=True):
        history.turns = list(turns)  # assignment: History validates the new records
    return out


async def teacher_logprobs(client: AsyncOpenAI, teacher: Model, turn: SampledTurn) -> list[float]:
    """The teacher's logprob of each of `turn`'s completion tokens, in one prompt-scoring call."""
    import openai

    prompt = turn.prompt_token_ids + turn.completion_token_ids
    where = f"teacher {teacher.name!r} at {teacher.base_url}"
    try:
        response = await client.completions.create(
            model=teacher.name, prompt=prompt, max_tokens=1,
            extra_body={"prompt_logprobs": 0})  # vLLM: the logprob of each prompt token itself
    except openai.BadRequestError as e:
        raise TeacherError(
            f"{where} refused to score a sequence of {len(prompt)} token ids: {e.message}. The "
            "teacher must serve /v1/completions with vLLM's prompt_logprobs (our gateway, "
            "`vllm serve`) and share the student's tokenizer") from e
    data = response.model_dump()
    choice = (data.get("choices") or [{}])[0]
    positions = choice.get("prompt_logprobs") or data.get("prompt_logprobs")
    if not positions:
        raise TeacherError(
            f"{where} returned no prompt_logprobs: on-policy distillation needs the teacher's "
            "logprob of every token the student sampled, which only an endpoint that returns "
            "prompt logprobs can give (a vLLM server: our gateway, or `vllm serve`; not OpenAI's "
            "API)")
    if len(positions) != len(prompt):
        raise TeacherError(
            f"{where} returned prompt logprobs for {len(positions)} positions of a "
            f"{len(prompt)}-token prompt: does it share the student's tokenizer?")
    start = len(turn.prompt_token_ids)
    return [_logprob_of(positions[start + j], token, where)
            for j, token in enumerate(turn.completion_token_ids)]


def _logprob_of(position: Any, token: int, where: str) -> float:
    """vLLM's entry for one prompt position, {token id: {"logprob": x, ...}} (the ids are JSON
    strings), always holds the actual token, whatever top-k was asked."""
    entry = (position or {}).get(str(token)) or (position or {}).get(token)
    value = entry.get("logprob") if isinstance(entry, dict) else entry
    if not isinstance(value, int | float) or math.isnan(value):
        raise TeacherError(f"{where} returned no logprob for token id {token} at its position: "
                           "does it share the student's tokenizer?")
    return max(float(value), -9999.0)  # vLLM's own floor for -inf, and JSON has no infinity


RolloutFn = Callable[[Any], Awaitable[Trajectory]]
"""One rollout of one scenario by the student (model and tools bound), as in art_core/loop.py."""


async def distill_on_policy(student: TrainableModel, teacher: Model, rollout: RolloutFn,
                            scenarios: Sequence[Any], *, steps: int, groups_per_step: int = 4,
                            rollouts_per_group: int = 4, config: TrainConfig | None = None,
                            seed: int = 0, max_concurrency: int | None = None,
                            max_exceptions: int | float = 0.5) -> list[TrainResult]:
    """`steps` steps of on-policy distillation of `teacher` into `student` (module docstring).

    Each step draws `groups_per_step` scenarios (seeded by the step, so a resumed run draws
    what an uninterrupted one would have), runs `rollouts_per_group` student rollouts of each,
    scores them with the teacher and trains one step with `advantage="teacher"` (the other
    settings from `config`).
    """
    from art_core.config import TrainConfig

    config = (config or TrainConfig()).model_copy(update={"advantage": "teacher"})
    TrainConfig.model_validate(config.model_dump())  # e.g. gspo cannot take per-token advantages
    start = await student.get_step()
    results = []
    for i in range(steps):
        rng = random.Random(f"{seed}-{start + i}")
        picked = rng.sample(list(scenarios), min(groups_per_step, len(scenarios)))
        groups = await gather_trajectory_groups(
            ([rollout(s) for _ in range(rollouts_per_group)] for s in picked),
            max_exceptions=max_exceptions, max_concurrency=max_concurrency,
            description=f"step {start + i + 1} rollouts")
        groups = await score_with_teacher(groups, teacher)
        results.append(await student.train(groups, config))
    return results
