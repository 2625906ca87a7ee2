"""From scored groups to tensors: advantages, sequences from sampled turns, weights, collate."""

from __future__ import annotations

import logging
import math

import pytest

torch = pytest.importorskip("torch")

from art_core.train.advantages import compute_advantages  # noqa: E402
from art_core.train.batch import (  # noqa: E402
    Sequence,
    build_all_sequences,
    build_sequences,
    collate,
    micro_batches,
    shift_for_next_token,
    with_token_weights,
)
from art_core.train.loss import trajectory_token_weights  # noqa: E402
from art_core.trajectory import (  # noqa: E402
    History,
    SampledTurn,
    Trajectory,
    TrajectoryGroup,
)

# ---------------------------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------------------------

S = math.sqrt(2 / 3)  # population std of (1, 2, 3)


def traj(reward: float = 0.0, **kw) -> Trajectory:
    return Trajectory(messages=[{"role": "user", "content": "hi"}], reward=reward, **kw)


@pytest.mark.parametrize(
    "groups,scale,expected,stats",
    [
        pytest.param([[1.0, 0.0, 0.5]], False, [0.5, -0.5, 0.0], {"groups": 1}, id="unscaled"),
        pytest.param(
            [[1.0, 2.0, 3.0]], True, [-1 / S, 0.0, 1 / S], {"reward_mean": 2.0}, id="scaled"
        ),
        pytest.param(
            [[0.5, 0.5, 0.5], [1.0, 0.0]],
            True,
            [1.0, -1.0],
            # all 5 rewards count: mean 2.5 / 5 = 0.5, deviations (0, 0, 0, .5, -.5): var 0.1
            {"groups": 2, "groups_zero_variance": 1, "frac_groups_zero_variance": 0.5,
             "groups_too_small": 0, "trajectories": 5, "trajectories_kept": 2,
             "reward_mean": 0.5, "reward_std": math.sqrt(0.1)},
            id="zero-variance-dropped",
        ),
        pytest.param(
            [[2.0], [0.0, 1.0]],
            False,
            [-0.5, 0.5],
            {"groups": 2, "groups_zero_variance": 0, "groups_too_small": 1,
             "trajectories": 3, "trajectories_kept": 2, "reward_mean": 1.0, "reward_std": S},
            id="single-trajectory-dropped",
        ),
        pytest.param(
            [[1.0, 1.0 + 1e-9]], True, [], {"groups_zero_variance": 1}, id="equal-within-1e-8"
        ),
        pytest.param(
            [], True, [], {"groups": 0, "frac_groups_zero_variance": 0.0, "reward_mean": 0.0},
            id="empty",
        ),
    ],
)
def test_compute_advantages(groups, scale, expected, stats):
    trajectories = [[traj(r) for r in group] for group in groups]
    wrapped = [TrajectoryGroup(trajectories=group) for group in trajectories]
    scored, got = compute_advantages(wrapped, scale_rewards=scale)
    # 1e-5: scaled advantages divide by std + 1e-6
    assert [a for _, a in scored] == pytest.approx(expected, abs=1e-5)
    kept = [t for group in trajectories for t in group if any(t is s for s, _ in scored)]
    assert [t for t, _ in scored] == kept  # group order, the same objects
    for key, value in stats.items():
        assert got[key] == pytest.approx(value), key


# ---------------------------------------------------------------------------------------------
# sequences
# ---------------------------------------------------------------------------------------------

TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
MESSAGES = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},  # index 2
    {"role": "tool", "tool_call_id": "c1", "content": "r"},
    {"role": "assistant", "content": "done"},  # index 4
]


def turn(index: int, prompt: list[int], completion: list[int], logprobs: list[float]) -> SampledTurn:
    return SampledTurn(
        message_index=index,
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        logprobs=logprobs,
    )


# prompt of turn 1 = [1, 2, 3]; completion [10, 11]; tool result tokens [20, 21]
T1 = turn(2, [1, 2, 3], [10, 11], [-0.1, -0.2])
T2_EXTENDS = turn(4, [1, 2, 3, 10, 11, 20, 21], [12, 13, 14], [-0.3, -0.4, -0.5])
T2_RERENDERED = turn(4, [1, 2, 3, 10, 99, 20, 21], [12, 13, 14], [-0.3, -0.4, -0.5])


@pytest.mark.parametrize(
    "turns,expected",
    [
        pytest.param(
            [T1, T2_EXTENDS],
            [([1, 2, 3, 10, 11, 20, 21, 12, 13, 14],
              [0, 0, 0, 1, 1, 0, 0, 1, 1, 1],
              [0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, -0.5])],
            id="turn-2-extends-turn-1",
        ),
        pytest.param(
            [T2_EXTENDS, T1],  # records out of order: message order decides
            [([1, 2, 3, 10, 11, 20, 21, 12, 13, 14],
              [0, 0, 0, 1, 1, 0, 0, 1, 1, 1],
              [0, 0, 0, -0.1, -0.2, 0, 0, -0.3, -0.4, -0.5])],
            id="records-out-of-order",
        ),
        pytest.param(
            [T1, T2_RERENDERED],  # turn 1's completion was re-rendered differently: no prefix
            [([1, 2, 3, 10, 11], [0, 0, 0, 1, 1], [0, 0, 0, -0.1, -0.2]),
             ([1, 2, 3, 10, 99, 20, 21, 12, 13, 14],
              [0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
              [0, 0, 0, 0, 0, 0, 0, -0.3, -0.4, -0.5])],
            id="turn-2-does-not-extend",
        ),
        pytest.param(
            [T2_EXTENDS],  # the first assistant message is context only
            [([1, 2, 3, 10, 11, 20, 21, 12, 13, 14],
              [0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
              [0, 0, 0, 0, 0, 0, 0, -0.3, -0.4, -0.5])],
            id="only-last-turn-sampled",
        ),
    ],
)
def test_build_sequences(turns, expected):
    trajectory = Trajectory(messages=MESSAGES, turns=turns, reward=1.0)
    sequences = build_sequences(trajectory, advantage=0.7, traj_index=4)
    got = [(s.token_ids, s.mask, s.old_logprobs) for s in sequences]
    assert [(t, m) for t, m, _ in got] == [(t, m) for t, m, _ in expected]
    for (_, _, old), (_, _, want) in zip(got, expected, strict=True):
        assert old == pytest.approx(want)
    assert all(s.advantage == 0.7 and s.traj_index == 4 for s in sequences)
    assert all(s.has_old_logprobs and not s.retokenized for s in sequences)


def test_additional_histories_train_alike():
    sub = History(
        messages=[{"role": "user", "content": "sub"}, {"role": "assistant", "content": "x"}],
        turns=[turn(1, [5, 6], [7], [-0.9])],
    )
    context_only = History(messages=[{"role": "user", "content": "no turns here"}])
    trajectory = Trajectory(
        messages=MESSAGES, turns=[T1, T2_EXTENDS], additional_histories=[sub, context_only]
    )
    sequences = build_sequences(trajectory, advantage=-0.25, traj_index=2)
    assert [s.token_ids for s in sequences] == [
        [1, 2, 3, 10, 11, 20, 21, 12, 13, 14],
        [5, 6, 7],
    ]
    assert sequences[1].mask == [0, 0, 1]
    assert sequences[1].old_logprobs == pytest.approx([0, 0, -0.9])
    assert {(s.traj_index, s.advantage) for s in sequences} == {(2, -0.25)}


def test_only_an_additional_history_sampled_is_trainable():
    sub = History(
        messages=[{"role": "user", "content": "sub"}, {"role": "assistant", "content": "x"}],
        turns=[turn(1, [5, 6], [7], [-0.9])],
    )
    trajectory = Trajectory(messages=MESSAGES, additional_histories=[sub])
    assert [s.token_ids for s in build_sequences(trajectory, 1.0, 0)] == [[5, 6, 7]]


def test_trajectory_without_sampled_turns_is_rejected():
    trajectory = Trajectory(messages=MESSAGES, reward=0.5, metadata={"scenario": "s-17"})
    with pytest.raises(ValueError, match=r"trajectory 3 .*s-17.* has no sampled turns"):
        build_sequences(trajectory, advantage=1.0, traj_index=3)
    with pytest.raises(ValueError, match="trajectory 0 .* no sampled turns"):
        build_all_sequences([(trajectory, 1.0)])


def test_retokenize_fallback_is_counted_and_warned(caplog):
    untrained = Trajectory(messages=MESSAGES)
    sampled = Trajectory(messages=MESSAGES, turns=[T1, T2_EXTENDS])
    seen: list[History] = []

    def retokenize(history: History) -> list[dict]:
        seen.append(history)
        return [{"token_ids": [1, 2, 3, 4], "mask": [0, 0, 1, 1]}]

    with caplog.at_level(logging.WARNING, logger="art_core.train.batch"):
        sequences, metrics = build_all_sequences(
            [(sampled, 1.0), (untrained, -1.0)], retokenize=retokenize
        )
    assert seen == [untrained]  # only the trajectory without sampled turns goes through it
    assert metrics["retokenized_trajectories"] == 1
    assert metrics["frac_retokenized"] == 0.5
    assert metrics["trajectories_trained"] == 2 and metrics["sequences"] == 2
    assert metrics["trained_tokens"] == 5 + 2 and metrics["tokens"] == 10 + 4
    fallback = sequences[1]
    assert fallback.retokenized and not fallback.has_old_logprobs
    assert (fallback.traj_index, fallback.advantage) == (1, -1.0)
    assert fallback.old_logprobs == [0.0] * 4
    assert "re-rendered through the chat template" in caplog.text


def test_empty_prompt_is_rejected():
    trajectory = Trajectory(messages=MESSAGES, turns=[turn(2, [], [10], [-0.1])])
    with pytest.raises(ValueError, match="empty prompt_token_ids"):
        build_sequences(trajectory, 1.0, 0)


@pytest.mark.parametrize(
    "tokens,mask,old,message",
    [
        ([1, 2], [0, 1], [0.0], "differ in length"),
        ([1, 2], [0, 0], [0.0, 0.0], "no trained token"),
        ([1, 2], [1, 1], [-0.1, -0.2], "prompt must be non-empty"),
    ],
)
def test_sequence_checks_itself(tokens, mask, old, message):
    with pytest.raises(ValueError, match=message):
        Sequence(tokens, mask, old, advantage=1.0, traj_index=0)


# ---------------------------------------------------------------------------------------------
# weights, micro-batches, collate
# ---------------------------------------------------------------------------------------------


def two_trajectories() -> list[Sequence]:
    """Trajectory 0 in two sequences (2 + 3 trained tokens), trajectory 1 in one (1 token)."""
    first = Trajectory(messages=MESSAGES, turns=[T1, T2_RERENDERED])
    second = Trajectory(messages=MESSAGES, turns=[turn(4, [8, 9], [30], [-1.0])])
    sequences, _ = build_all_sequences([(first, 0.5), (second, -0.5)])
    return sequences


@pytest.mark.parametrize(
    "per_sequence,expected",
    [
        (False, [1 / 5 / 2, 1 / 5 / 2, 1 / 1 / 2]),  # 1 / trajectory tokens / trajectories
        (True, [1 / 2 / 2 / 2, 1 / 3 / 2 / 2, 1 / 1 / 1 / 2]),  # 1 / seq tokens / seqs / trajs
    ],
)
def test_token_weights_agree_with_the_loss_helper(per_sequence, expected):
    sequences = with_token_weights(two_trajectories(), per_sequence=per_sequence)
    assert [s.token_weight for s in sequences] == pytest.approx(expected)
    batch = collate(sequences, pad_id=0)
    helper = trajectory_token_weights(
        batch["loss_mask"], batch["traj_index"], per_sequence=per_sequence
    )
    torch.testing.assert_close(batch["token_weights"], helper)
    assert batch["token_weights"].sum().item() == pytest.approx(1.0)


def test_collate_pads_right_and_aligns_to_token_positions():
    sequences = with_token_weights(two_trajectories())
    batch = collate(sequences, pad_id=99)
    b, t = 3, 10
    shapes = {k: tuple(v.shape) for k, v in batch.items()}
    assert shapes == {
        "input_ids": (b, t), "attention_mask": (b, t), "loss_mask": (b, t),
        "old_logprobs": (b, t), "token_weights": (b, t), "advantages": (b,),
        "traj_index": (b,), "has_old_logprobs": (b,),
    }
    assert batch["input_ids"][0].tolist() == [1, 2, 3, 10, 11] + [99] * 5
    assert batch["input_ids"][2].tolist() == [8, 9, 30] + [99] * 7
    assert batch["attention_mask"].sum(-1).tolist() == [5, 10, 3]
    assert batch["loss_mask"][0].tolist() == [False] * 3 + [True] * 2 + [False] * 5
    assert batch["loss_mask"].dtype == torch.bool
    torch.testing.assert_close(
        batch["old_logprobs"][2], torch.tensor([0, 0, -1.0] + [0] * 7, dtype=torch.float32)
    )
    assert batch["advantages"].tolist() == [0.5, 0.5, -0.5]
    assert batch["traj_index"].tolist() == [0, 0, 1]
    assert batch["has_old_logprobs"].tolist() == [True] * 3
    assert not batch["loss_mask"][:, 0].any()  # position 0 never carries a target

    shifted = shift_for_next_token(batch)
    assert shifted["target_ids"][2, :2].tolist() == [9, 30]  # predicted from positions 0, 1
    assert shifted["loss_mask"][2, :3].tolist() == [False, True, False]  # 30 at index 1
    assert shifted["old_logprobs"][2, 1].item() == -1.0
    assert shifted["token_weights"].shape == (b, t - 1)
    assert shifted["advantages"] is batch["advantages"]
    assert "input_ids" not in shifted and "attention_mask" not in shifted


def seq_of_length(n: int, index: int) -> Sequence:
    return Sequence([1] * n, [0] + [1] * (n - 1), [0.0] * n, advantage=0.0, traj_index=index)


@pytest.mark.parametrize(
    "max_sequences,max_tokens,expected",
    [
        (2, None, [[1, 3], [2, 0], [4]]),  # longest first, ties keep input order
        (10, None, [[1, 3, 2, 0, 4]]),
        (1, None, [[1], [3], [2], [0], [4]]),
        # padded size cap 12: 7+7 -> 14 no; 5+3 -> 10 yes; 5+3+2 -> 15 no
        (4, 12, [[1], [3], [2, 0], [4]]),
        (4, 5, [[1], [3], [2], [0], [4]]),  # longer than the cap: alone, not dropped
    ],
)
def test_micro_batches(max_sequences, max_tokens, expected):
    sequences = [seq_of_length(n, i) for i, n in enumerate([3, 7, 5, 7, 2])]
    batches = micro_batches(sequences, max_sequences, max_tokens=max_tokens)
    assert [[s.traj_index for s in mb] for mb in batches] == expected
