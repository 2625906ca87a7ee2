"""On-policy distillation without an engine: per-token advantages teacher - sampler logprob,
a trainer step that moves a tiny student towards its teacher, and the teacher's scoring call
against a fake OpenAI-compatible endpoint (with and without vLLM's prompt_logprobs)."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from art_core import LoraConfig, Model, TrainConfig, Trajectory, TrajectoryGroup
from art_core.distill import TeacherError, score_with_teacher
from art_core.train import advantages as A
from art_core.train import batch as B
from art_core.train import packing as P
from art_core.train.trainer import Trainer
from tests.support.data import make_group


def turn(prompt: list[int], completion: list[int], logprobs: list[float],
         teacher: list[float] | None = None, **extra) -> dict:
    return {"message_index": 1, "prompt_token_ids": prompt, "completion_token_ids": completion,
            "logprobs": logprobs, "teacher_logprobs": teacher, **extra}


def trajectory(*turns: dict, reward: float = 0.0) -> Trajectory:
    return Trajectory(messages=[{"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a"}],
                      turns=list(turns), reward=reward)


# ---- data: the per-token advantages ---------------------------------------------------------


def test_sequences_carry_teacher_minus_sampler_per_token():
    t = trajectory(turn([5, 6, 7], [8, 9, 10], [-1.0, -2.0, -0.5], [-0.5, -3.0, -0.5]))
    scored, stats = A.teacher_advantages([[t], [t.model_copy()]])  # one-trajectory groups too
    assert len(scored) == 2 and stats["trajectories_kept"] == 2  # nothing is dropped
    assert stats["groups_zero_variance"] == 0
    assert stats["teacher_tokens"] == 6
    assert stats["teacher_kl"] == pytest.approx((-0.5 + 1.0 + 0.0) / 3)  # sampler - teacher
    sequences, _ = B.build_all_sequences(scored, teacher=True)
    s = sequences[0]
    assert s.token_advantages == [0.0, 0.0, 0.0, 0.5, -1.0, 0.0]
    batch = B.collate(B.with_token_weights(sequences), pad_id=0)
    assert batch["advantages"].shape == batch["input_ids"].shape  # [B, T]
    shifted = B.shift_for_next_token(batch)
    assert shifted["advantages"][0].tolist() == [0.0, 0.0, 0.5, -1.0, 0.0]
    assert shifted["loss_mask"][0].tolist() == [False, False, True, True, True]


def test_grammar_chosen_tokens_are_not_distilled():
    t = trajectory(turn([5, 6], [8, 9, 10], [-1.0, -0.1, -0.1], [-0.5, -4.0, -4.0],
                        constrained_from=1))
    scored, stats = A.teacher_advantages([[t]])
    assert stats["teacher_tokens"] == 1 and stats["teacher_kl"] == pytest.approx(-0.5)
    sequences, _ = B.build_all_sequences(scored, teacher=True)
    assert sequences[0].token_advantages == [0.0, 0.0, 0.5, 0.0, 0.0]


def test_packed_rows_keep_each_sequences_token_advantages():
    prompt = list(range(1, 21))  # a shared prefix longer than packing.MIN_SHARED
    ts = [trajectory(turn(prompt, [30 + i, 40 + i], [-1.0, -1.0], [-1.0 + i, -2.0]))
          for i in range(2)]
    sequences, _ = B.build_all_sequences(A.teacher_advantages([ts])[0], teacher=True)
    rows = P.share_prefixes(B.with_token_weights(sequences), max_tokens=1000)
    assert len(rows) == 1 and isinstance(rows[0], P.Packed)
    batch = P.collate(rows, pad_id=0)
    trained = batch["advantages"][batch["loss_mask"]].tolist()  # in row order
    assert sorted(trained) == sorted([0.0, -1.0, 1.0, -1.0])


@pytest.mark.parametrize("turns", [[], [turn([5], [8], [-1.0])]], ids=["no turn", "unscored"])
def test_a_trajectory_without_teacher_logprobs_is_an_error(turns):
    t = Trajectory(messages=[{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "a"}], turns=turns)
    with pytest.raises(ValueError, match="score_with_teacher"):
        A.teacher_advantages([[t]])


def test_teacher_logprobs_are_validated():
    with pytest.raises(ValueError, match="same length"):
        trajectory(turn([5], [8, 9], [-1.0, -1.0], [-1.0]))
    with pytest.raises(ValueError, match="NaN"):
        trajectory(turn([5], [8], [-1.0], [math.nan]))


def test_gspo_cannot_take_per_token_advantages():
    with pytest.raises(ValueError, match="gspo"):
        TrainConfig(advantage="teacher", loss="gspo")


# ---- the trainer: the student moves towards the teacher --------------------------------------


@pytest.fixture
def trainer(tiny_models) -> Trainer:
    return Trainer(str(tiny_models["llama"]), LoraConfig(rank=4), device="cpu")


def completion_logprobs(model, t: Trajectory) -> list[float]:
    """The model's logprob of each completion token of t's one turn (float32, no grad)."""
    tr = t.turns[0]
    ids = torch.tensor([tr.prompt_token_ids + tr.completion_token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]
    lp = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]  # [T-1]
    return lp[len(tr.prompt_token_ids) - 1:].tolist()


def on_policy(trainer: Trainer, group: TrajectoryGroup, teacher) -> TrajectoryGroup:
    """`group` as if the student sampled it (sampler logprobs = its own) and the teacher,
    `teacher(trajectory index, student logprobs)`, scored it."""
    out = []
    for i, t in enumerate(group.trajectories):
        own = completion_logprobs(trainer.model, t)
        tr = t.turns[0].model_copy(update={"logprobs": own, "teacher_logprobs": teacher(i, own)})
        out.append(t.model_copy(update={"turns": [tr]}))
    return TrajectoryGroup(trajectories=out)


def test_a_step_moves_the_student_towards_the_teachers_logprobs(trainer):
    """The teacher likes the first two replies 1 nat more than the student and the last two
    1 nat less: after a few steps the student's logprobs rose on the first and fell on the
    last, with every reward equal (GRPO would drop the group and learn nothing)."""
    group = make_group(trainer.tokenizer)
    for t in group.trajectories:
        t.reward = 1.0
    group = on_policy(trainer, group, lambda i, own: [x + (1.0 if i < 2 else -1.0) for x in own])
    before = [sum(completion_logprobs(trainer.model, t)) for t in group.trajectories]
    config = TrainConfig(learning_rate=1e-2, bf16=False, advantage="teacher")
    for _ in range(3):
        metrics = trainer.step([group], config)
    assert metrics["trajectories_kept"] == 4 and metrics["groups_zero_variance"] == 0
    lengths = [len(t.turns[0].logprobs) for t in group]
    assert metrics["teacher_tokens"] == sum(lengths)
    # the mean of sampler - teacher over tokens: -1 on the first two replies, +1 on the others
    want = (sum(lengths[2:]) - sum(lengths[:2])) / sum(lengths)
    assert metrics["teacher_kl"] == pytest.approx(want, abs=1e-5)
    after = [sum(completion_logprobs(trainer.model, t)) for t in group.trajectories]
    moved = [a - b for a, b in zip(after, before, strict=True)]
    assert moved[0] > 0 and moved[1] > 0 and moved[2] < 0 and moved[3] < 0, moved


def test_steps_close_the_gap_to_a_different_teacher_model(trainer, tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    from art_core.testing.tiny import build_tiny_model

    # same tokenizer (trained deterministically), other random weights
    teacher = AutoModelForCausalLM.from_pretrained(
        str(build_tiny_model(tmp_path / "teacher", "llama", seed=1)), dtype=torch.float32)
    group = make_group(trainer.tokenizer)

    def score() -> TrajectoryGroup:  # the student's current logprobs as the sampler's
        return on_policy(trainer, group,
                         lambda i, own: completion_logprobs(teacher, group.trajectories[i]))

    def gap() -> float:
        diffs = [abs(s - t) for tr in score() for s, t in zip(
            tr.turns[0].logprobs, tr.turns[0].teacher_logprobs, strict=True)]
        return sum(diffs) / len(diffs)

    start = gap()
    config = TrainConfig(learning_rate=1e-2, bf16=False, advantage="teacher")
    for _ in range(5):
        scored = score()
        metrics = trainer.step([scored], config)
        assert metrics["teacher_kl"] == pytest.approx(sum(
            s - t for tr in scored for s, t in zip(tr.turns[0].logprobs,
                                                    tr.turns[0].teacher_logprobs, strict=True))
            / metrics["teacher_tokens"], abs=1e-5)
    end = gap()
    assert end < 0.5 * start, (start, end)  # measured: 0.98 -> 0.24 nats


def test_the_trainer_refuses_unscored_groups(trainer):
    with pytest.raises(ValueError, match="teacher_logprobs"):
        trainer.step([make_group(trainer.tokenizer)],
                     TrainConfig(bf16=False, advantage="teacher"))


# ---- the teacher's scoring call ------------------------------------------------------------


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A fake /v1/completions: model "vllm-like" returns prompt_logprobs (-0.1 * token id),
    "openai-like" none, "short" fewer positions than the prompt, "refuses" a 400."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["prompt"]
            assert body["max_tokens"] == 1 and body["prompt_logprobs"] == 0
            choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
            status = 200
            if body["model"] == "vllm-like":
                choice["prompt_logprobs"] = [None] + [
                    {str(t): {"logprob": -0.1 * t, "rank": 1, "decoded_token": "x"}}
                    for t in prompt[1:]]
            elif body["model"] == "short":
                choice["prompt_logprobs"] = [None]
            elif body["model"] == "refuses":
                status = 400
            data = ({"id": "c", "object": "text_completion", "created": 0,
                     "model": body["model"], "choices": [choice]} if status == 200 else
                    {"error": {"message": "token id 99999 is out of vocabulary",
                               "type": "BadRequestError", "code": 400}})
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def scored_group() -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[
        trajectory(turn([5, 6, 7], [8, 9], [-1.0, -1.0])),
        trajectory(turn([5, 6], [3], [-2.0])),
    ])


async def test_score_with_teacher_reads_the_completion_tokens_prompt_logprobs(endpoint):
    group = scored_group()
    [out] = await score_with_teacher([group], Model(name="vllm-like", base_url=endpoint))
    assert [t.turns[0].teacher_logprobs for t in out] == [
        pytest.approx([-0.8, -0.9]), pytest.approx([-0.3])]
    assert all(t.turns[0].teacher_logprobs is None for t in group)  # the input is left as it was


@pytest.mark.parametrize(("name", "message"), [
    ("openai-like", "returned no prompt_logprobs.*vLLM server"),
    ("short", "share the student's tokenizer"),
    ("refuses", "refused to score.*out of vocabulary"),
])
async def test_a_teacher_that_cannot_score_is_a_clear_error(endpoint, name, message):
    with pytest.raises(TeacherError, match=message) as e:
        await score_with_teacher([scored_group()], Model(name=name, base_url=endpoint))
    assert name in str(e.value) and endpoint in str(e.value)
