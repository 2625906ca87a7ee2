"""Per-turn credit (art_core/train/credit.py): hand-made numbers, the baseline's unbiasedness by
exact enumeration, and a trainer step that moves each turn the way its own credit says."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from art_core import LoraConfig, TrainConfig, Trajectory, TrajectoryGroup
from art_core.train.credit import group_turn_advantages, turn_advantages, turn_rewards
from art_core.train.trainer import Trainer
from tests.support.data import lora_state


@pytest.mark.parametrize(("rewards", "expected"), [
    # one turn each: leave-one-out on the episode reward
    ([[1.0], [0.0]], [[1.0], [-1.0]]),
    ([[1.0], [0.0], [0.5]], [[0.75], [-0.75], [0.0]]),
    # returns-to-go [1, 0] and [1, 1]: equal first turns, the second turns differ
    ([[1.0, 0.0], [0.0, 1.0]], [[0.0, -1.0], [0.0, 1.0]]),
    # the short episode has ended by turn 1 and counts with a return of 0 there
    ([[0.5, 0.5], [1.0]], [[0.0, 0.5], [0.0]]),
    ([[0.0, 0.0, 2.0], [1.0, 0.0], [0.0]], [[1.5, 2.0, 2.0], [0.0, -1.0], [-1.5]]),
])
def test_advantages_on_hand_made_numbers(rewards, expected):
    got = group_turn_advantages(rewards)
    assert [[round(a, 12) for a in row] for row in got] == expected


def turns(n: int) -> list[dict]:
    return [{"message_index": 2 * k + 1, "prompt_token_ids": [1] * (2 * k + 1),
             "completion_token_ids": [5], "logprobs": [-1.0]} for k in range(n)]


def conversation(n: int) -> list[dict]:
    out = [{"role": "user", "content": "go"}]
    for k in range(n):
        out += [{"role": "assistant", "content": str(k)}, {"role": "user", "content": "more"}]
    return out[:-1]


@pytest.mark.parametrize(("own", "reward", "expected"), [
    ([None, None, None], 2.0, [0.0, 0.0, 2.0]),  # no turn rewards: the episode's on the last
    ([0.5, None, 0.25], 0.75, [0.5, 0.0, 0.25]),  # the turns account for the whole reward
    ([0.5, None, 0.25], 1.75, [0.5, 0.0, 1.25]),  # a final bonus the turns do not explain
])
def test_turn_rewards_put_what_the_turns_leave_on_the_last(own, reward, expected):
    t = Trajectory(messages=conversation(3), turns=turns(3), reward=reward)
    for k, r in enumerate(own):
        if r is not None:
            t.set_turn_reward(k, r)
    assert turn_rewards(t) == expected
    assert turn_rewards(Trajectory(messages=[{"role": "user", "content": "x"}], reward=3.0)) == [
        3.0]


def test_the_baseline_keeps_the_policy_gradient_unbiased():
    """A two-turn problem with a logistic policy per turn, enumerated exactly over every joint
    outcome of a group of three: the expected estimate equals the true gradient of the expected
    return; GRPO's baseline (the group mean, trajectory included) shrinks it by (n - 1) / n."""
    p0, p1, n = 0.3, 0.6, 3
    # a0 = 0 ends the episode with 0.3; a0 = 1 earns 0, then a1 = 1 earns 1 and a1 = 0 -0.5
    outcomes = [((0,), [0.3], (1 - p0)), ((1, 0), [0.0, -0.5], p0 * (1 - p1)),
                ((1, 1), [0.0, 1.0], p0 * p1)]
    true = [p0 * (1 - p0) * (p1 * 1.0 + (1 - p1) * -0.5 - 0.3), p0 * p1 * (1 - p1) * 1.5]

    def expected_estimate(advantages_of) -> list[float]:
        total = [0.0, 0.0]
        for group in itertools.product(outcomes, repeat=n):
            prob = math.prod(o[2] for o in group)
            advantages = advantages_of([o[1] for o in group])
            for (actions, _, _), row in zip(group, advantages, strict=True):
                for k, (a, adv) in enumerate(zip(actions, row, strict=True)):
                    total[k] += prob * (a - (p0, p1)[k]) * adv / n  # d log pi / d theta_k
        return total

    ours = expected_estimate(group_turn_advantages)
    assert ours == pytest.approx(true, abs=1e-12)

    def with_self_in_the_mean(rewards):
        returns = [[sum(r[k:]) for k in range(len(r))] for r in rewards]
        return [[g - sum(rr[k] if k < len(rr) else 0.0 for rr in returns) / n
                 for k, g in enumerate(row)] for row in returns]

    grpo = expected_estimate(with_self_in_the_mean)
    assert grpo == pytest.approx([(n - 1) / n * g for g in true], abs=1e-12)
    assert abs(grpo[0] - true[0]) > 1e-3


def test_groups_without_credit_are_dropped_and_counted():
    same = TrajectoryGroup(trajectories=[
        Trajectory(messages=conversation(1), turns=turns(1), reward=1.0) for _ in range(2)])
    alone = TrajectoryGroup(trajectories=[Trajectory(messages=conversation(1), turns=turns(1))])
    a, b = (Trajectory(messages=conversation(2), turns=turns(2), reward=1.0) for _ in range(2))
    a.set_turn_reward(0, 1.0)
    b.set_turn_reward(1, 1.0)  # equal episodes, different turns: credit where 'group' has none
    scored, stats, per_token = turn_advantages([same, alone, TrajectoryGroup(trajectories=[a, b])])
    assert stats["groups_zero_variance"] == 1 and stats["groups_too_small"] == 1
    assert stats["trajectories_kept"] == len(scored) == 2
    assert per_token(0, 0, a.turns[1]) == [-1.0] and per_token(1, 0, b.turns[1]) == [1.0]
    assert per_token(0, 0, a.turns[0]) == [0.0] and stats["turn_advantage_abs_mean"] == 0.5


def test_a_step_moves_each_turn_by_its_own_credit(tiny_models):
    """Two two-turn trajectories with equal episode rewards ('group' trains nothing): the one
    whose second turn earned the reward gets that turn's tokens pushed up, the other's down."""
    trainer = Trainer(str(tiny_models["llama"]), LoraConfig(rank=4), device="cpu")
    tok = trainer.tokenizer
    prompt = tok.encode("Pick a colour.")

    def trajectory(first: str, second: str, rewards: tuple[float, float]) -> Trajectory:
        c0, ctx, c1 = tok.encode(first), tok.encode(" and?"), tok.encode(second)
        t = Trajectory(messages=[{"role": "user", "content": "Pick a colour."},
                                 {"role": "assistant", "content": first},
                                 {"role": "user", "content": "and?"},
                                 {"role": "assistant", "content": second}],
                       turns=[{"message_index": 1, "prompt_token_ids": prompt,
                               "completion_token_ids": c0, "logprobs": [-3.0] * len(c0)},
                              {"message_index": 3, "prompt_token_ids": prompt + c0 + ctx,
                               "completion_token_ids": c1, "logprobs": [-3.0] * len(c1)}],
                       reward=sum(rewards))
        for k, r in enumerate(rewards):
            t.set_turn_reward(k, r)
        return t

    up = trajectory(" red", " blue sky", (0.0, 1.0))
    down = trajectory(" green", " dark night", (1.0, 0.0))
    group = TrajectoryGroup(trajectories=[up, down])

    def second_turn_logprob(t: Trajectory) -> float:
        turn = t.turns[1]
        ids = torch.tensor([turn.prompt_token_ids + turn.completion_token_ids])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits.float()
        logprobs = torch.log_softmax(logits[0, :-1], -1)
        targets = ids[0, 1:]
        picked = logprobs.gather(-1, targets[:, None])[:, 0]
        return float(picked[-len(turn.completion_token_ids):].sum())

    assert trainer.step([group], TrainConfig(learning_rate=1e-2, bf16=False))[
        "trajectories_kept"] == 0  # 'group': equal episode rewards, nothing to learn
    before = {id(t): second_turn_logprob(t) for t in (up, down)}
    params = lora_state(trainer)
    config = TrainConfig(learning_rate=1e-2, bf16=False, advantage="turn")
    for _ in range(3):
        metrics = trainer.step([group], config)
    assert metrics["trajectories_kept"] == 2 and metrics["turn_advantage_abs_mean"] == 0.5
    assert any(not torch.equal(params[n], p) for n, p in lora_state(trainer).items())
    assert second_turn_logprob(up) > before[id(up)]
    assert second_turn_logprob(down) < before[id(down)]


def test_turn_credit_refuses_gspo():
    with pytest.raises(ValueError, match="advantage='turn' gives one advantage per token"):
        TrainConfig(advantage="turn", loss="gspo")


def test_turn_rewards_survive_the_journal_a_resume_and_the_remote_wire(tmp_path):
    """What a resumed step replays (the journal) and what RemoteBackend sends (the groups' JSON,
    parsed by the server as TrajectoryGroup) keep each turn's reward, unset ones as unset."""
    from art_core.storage import ModelDir

    a, b = (Trajectory(messages=conversation(3), turns=turns(3), reward=1.0) for _ in range(2))
    a.set_turn_reward(0, 0.25)
    a.set_turn_reward(2, 0.75)
    b.set_turn_reward(1, -1.0)
    group = TrajectoryGroup(trajectories=[a, b])
    want = [[0.25, None, 0.75], [None, -1.0, None]]

    run = ModelDir(tmp_path, "p", "m")
    run.journal_groups(3, [group])
    replayed = ModelDir(tmp_path, "p", "m").journaled(3)  # a new process, as after a restart
    assert replayed is not None
    assert [t.turn_rewards for t in replayed[0]] == want

    wire = TrajectoryGroup.model_validate_json(group.model_dump_json())  # RemoteBackend's body
    assert [t.turn_rewards for t in wire] == want
