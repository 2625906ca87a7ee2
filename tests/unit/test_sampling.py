"""Dynamic sampling (art_core/sampling.py): a step that asks for N groups with signal gets N
while the budget allows, stops at the budget with a warning, counts what it skipped, keeps the
draw order; the loop and the pipeline use it and a resumed run draws the same scenarios."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from art_core import Trajectory, TrajectoryGroup
from art_core.loop import train_loop
from art_core.sampling import gather_signal_groups, round_size, shares, shuffled_passes
from art_core.storage import read_jsonl
from tests.support.counting import CountingModel

ALIKE, MIXED = "alike", "mixed"  # a scenario's group scores all alike, or not


def traj(reward: float, scenario: Any) -> Trajectory:
    t = Trajectory(messages=[{"role": "user", "content": str(scenario)}], reward=reward)
    t.metadata["scenario"] = str(scenario)
    return t


async def rollout(scenario: tuple[str, int], i: int) -> Trajectory:
    """Scenario (kind, index): an 'alike' group scores 1.0 every time, a 'mixed' one 0 and 1."""
    await asyncio.sleep(0.001 * ((scenario[1] * 7 + i) % 5))  # finish out of order
    kind, _ = scenario
    return traj(1.0 if kind == ALIKE else float(i % 2), scenario)


def make_group(scenario: tuple[str, int], size: int = 4) -> list[Any]:
    return [rollout(scenario, i) for i in range(size)]


def stream(kinds: str) -> list[tuple[str, int]]:
    """'AAM...' -> [(alike, 0), (alike, 1), (mixed, 2), ...]."""
    return [(ALIKE if k == "A" else MIXED, i) for i, k in enumerate(kinds)]


@pytest.mark.parametrize(("kinds", "asked", "budget", "got", "drawn", "skipped", "rounds"), [
    ("MMM", 3, 9, 3, 3, 0, 1),              # all with signal: one round, nothing wasted
    ("AMAMMA" + "M" * 20, 3, 9, 3, 8, 3, 2),  # round 1: 1 of 3; round 2 draws ceil(2 / (2/5))
    ("A" * 20, 2, 6, 0, 6, 6, 2),           # nothing with signal: stops at the budget
    ("AAMAAAAAM", 2, 9, 2, 9, 7, 2),       # none in round 1: round 2 takes the whole budget
    ("AM", 2, 6, 1, 2, 1, 1),               # the scenarios run out
])
async def test_asks_for_n_with_signal_and_stops_at_the_budget(kinds, asked, budget, got, drawn,
                                                             skipped, rounds, caplog):
    with caplog.at_level(logging.WARNING, logger="art_core.sampling"):
        out = await gather_signal_groups(make_group, stream(kinds), asked, max_groups=budget,
                                         show_progress=False, description="step 1")
    assert (len(out.groups), out.drawn, len(out.skipped), out.rounds) == (got, drawn, skipped,
                                                                           rounds)
    assert all(g.has_signal for g in out.groups) and not any(g.has_signal for g in out.skipped)
    assert out.scenarios == stream(kinds)[:drawn]  # a prefix of the stream, in order
    m = out.metrics()
    assert m["sampling_groups_drawn"] == drawn and m["sampling_budget_used"] == drawn / budget
    assert m["sampling_groups_skipped"] == skipped
    warned = [r for r in caplog.records if "groups with signal after drawing" in r.message]
    assert bool(warned) == (got < asked)
    if warned:
        assert "step 1" in warned[0].message


async def test_keeps_the_first_n_in_draw_order_and_counts_the_surplus():
    # round 1: 2 scenarios, 1 with signal (the second); round 2 draws ceil(1 / (2/4)) = 2,
    # both with signal: the first is kept, the other is surplus
    out = await gather_signal_groups(make_group, stream("AMMM"), 2, max_groups=6,
                                     show_progress=False)
    assert [g.trajectories[0].metadata["scenario"] for g in out.groups] == \
        [str((MIXED, 1)), str((MIXED, 2))]
    assert (out.surplus, out.metrics()["sampling_groups_with_signal"]) == (1, 3)


async def test_groups_dropped_by_after_each_count_as_drawn_without_signal():
    def drop_odd(group: TrajectoryGroup) -> TrajectoryGroup | None:
        return None if group.trajectories[0].metadata["scenario"].endswith("1)") else group

    out = await gather_signal_groups(make_group, stream("MMMM"), 2, max_groups=4,
                                     after_each=drop_odd, show_progress=False)
    # round 1: 1 of 2 (the other dropped); round 2 draws 2 at rate 2/4, one is surplus
    assert (len(out.groups), out.dropped, out.drawn, out.surplus) == (2, 1, 4, 1)
    assert out.metrics()["sampling_groups_skipped"] == 1


async def test_reward_mean_covers_everything_sampled():
    out = await gather_signal_groups(make_group, stream("AM"), 1, max_groups=3,
                                     show_progress=False)
    assert out.metrics()["sampling_reward_mean"] == pytest.approx((4 * 1.0 + 2 * 1.0) / 8)


@pytest.mark.parametrize(("asked", "found", "drawn", "budget", "size"), [
    (6, 0, 0, 18, 6),    # first round: what was asked for
    (6, 1, 6, 18, 12),   # rate 2/8: 20 wanted, 12 left in the budget
    (6, 3, 6, 18, 6),    # rate 4/8: 3 more need 6
    (6, 5, 8, 18, 2),    # rate 6/10: 1 more needs 2
    (4, 0, 12, 12, 0),   # budget spent
])
def test_round_size(asked, found, drawn, budget, size):
    assert round_size(asked, found, drawn, budget) == size


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n_groups": 0}, "n_groups must be an integer >= 1"),
    ({"n_groups": 3, "max_groups": 2}, "max_groups must be an integer >= n_groups"),
    ({"n_groups": True}, "n_groups must be an integer"),
])
async def test_bad_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        await gather_signal_groups(make_group, stream("MM"), show_progress=False, **kwargs)


def strata(**kinds: str) -> dict[str, list[tuple[str, int]]]:
    """strata(x="MA", y="AA"): per stratum a stream, indices 100 apart to tell them apart."""
    return {k: [(s[0], 100 * n + s[1]) for s in stream(v)]
            for n, (k, v) in enumerate(kinds.items())}


@pytest.mark.parametrize(("kinds", "asked", "budget", "kept", "drawn", "warned"), [
    # an even share each, one round
    ({"x": "MMMM", "y": "MMMM"}, 4, 8, {"x": 2, "y": 2}, 4, False),
    # y never varies: once its share of the budget (4) is spent its places go to x
    ({"x": "MMMMMMMM", "y": "AAAAAAAA"}, 4, 8, {"x": 4, "y": 0}, 8, False),
    # y runs out of scenarios: its place goes to x, which draws once more
    ({"x": "MMM", "y": "A"}, 2, 4, {"x": 2, "y": 0}, 3, False),
    # x's round 2 finds one more than its share; with nothing left to draw it fills y's place
    ({"x": "MAMM", "y": "AAAA"}, 4, 8, {"x": 3, "y": 0}, 8, True),
    # an uneven share: the first stratum gets the odd place
    ({"x": "MMM", "y": "MMM"}, 3, 6, {"x": 2, "y": 1}, 3, False),
])
async def test_strata_share_the_step_and_hand_on_what_they_cannot_fill(
        kinds, asked, budget, kept, drawn, warned, caplog):
    with caplog.at_level(logging.WARNING, logger="art_core.sampling"):
        out = await gather_signal_groups(make_group, strata(**kinds), asked, max_groups=budget,
                                         show_progress=False, description="step 1")
    assert (out.by_stratum, out.drawn) == (kept, drawn)
    assert len(out.groups) == sum(kept.values()) and all(g.has_signal for g in out.groups)
    per = {k: sum(g.trajectories[0].metadata["scenario"] in {str(s) for s in v}
                  for g in out.groups) for k, v in strata(**kinds).items()}
    assert per == kept  # the groups are the ones reported per stratum
    m = out.metrics()
    assert {k: m[f"sampling_signal_{k}"] for k in kinds} == kept
    messages = [r.message for r in caplog.records if "groups with signal" in r.message]
    assert bool(messages) == warned
    if warned:
        assert "per stratum x 3/2 of 4, y 0/2 of 4" in messages[0]


@pytest.mark.parametrize(("total", "weights", "turns"), [
    # equal parts: the first ones one more, then the others
    (6, 4, [[2, 2, 1, 1], [1, 1, 2, 2], [2, 2, 1, 1]]),
    (6, [1, 1, 1, 1], [[2, 2, 1, 1], [1, 1, 2, 2]]),
    # 2.4 of 6 for the weight of 2: 3, 2, 2, 2, 3 over five turns, 12 of 30
    (6, [1, 1, 2, 1], [[1, 1, 3, 1], [2, 1, 2, 1], [1, 2, 2, 1], [1, 1, 2, 2], [1, 1, 3, 1]]),
    (5, [1, 2, 1, 1], [[1, 2, 1, 1]] * 3),  # exact: the same every turn
    (18, [1, 1, 1, 2, 1], [[3, 3, 3, 6, 3]]),
    (1, [1, 3], [[0, 1], [1, 0], [0, 1], [0, 1]]),  # the heavier first; 1 in 4 to the other
    (0, [1, 2], [[0, 0], [0, 0]]),
    (7, [0.5, 1.5], [[2, 5], [2, 5]]),  # 1.75, 5.25
])
def test_shares_split_in_proportion_to_the_weights_over_the_turns(total, weights, turns):
    for turn, parts in enumerate(turns):
        assert shares(total, weights, turn) == parts, turn
    n = len(weights) if isinstance(weights, list) else weights
    w = weights if isinstance(weights, list) else [1] * n
    over = [sum(col) for col in zip(*(shares(total, w, t) for t in range(int(sum(w)))),
                                    strict=True)]
    if all(isinstance(x, int) for x in w):  # over sum(w) turns: exactly in proportion
        assert over == [total * x for x in w]


@pytest.mark.parametrize(("kinds", "weights", "asked", "budget", "kept", "drawn"), [
    # x weighs twice y: 2 of 3 places and 4 of 6 draws
    ({"x": "MMMM", "y": "MMMM"}, {"x": 2}, 3, 6, {"x": 2, "y": 1}, 3),
    ({"x": "MMMM", "y": "MMMM"}, {"x": 1, "y": 3}, 4, 8, {"x": 1, "y": 3}, 4),
    # z never varies: its place goes to x, which weighs twice y
    ({"x": "MMMMMM", "y": "MMMMMM", "z": "AAAAAA"}, {"x": 2, "y": 1, "z": 1}, 4, 8,
     {"x": 3, "y": 1, "z": 0}, 7),
])
async def test_weighted_strata_get_their_share_of_the_places_and_the_budget(
        kinds, weights, asked, budget, kept, drawn):
    out = await gather_signal_groups(make_group, strata(**kinds), asked, max_groups=budget,
                                     weights=weights, show_progress=False)
    assert (out.by_stratum, out.drawn) == (kept, drawn)
    assert all(g.has_signal for g in out.groups)


@pytest.mark.parametrize(("scenarios", "weights", "message"), [
    (strata(x="MM", y="MM"), {"w": 2}, "weights: 'w' is not a stratum"),
    (strata(x="MM", y="MM"), {"x": 0}, "the weight of 'x' must be a positive number, got 0"),
    (strata(x="MM", y="MM"), {"x": -1.5}, "must be a positive number, got -1.5"),
    (strata(x="MM", y="MM"), {"x": "2"}, "must be a positive number, got '2'"),
    (stream("MM"), {"x": 2}, "scenarios must map strata to streams to weight them"),
])
async def test_bad_weights_are_refused_by_name(scenarios, weights, message):
    with pytest.raises(ValueError, match=message):
        await gather_signal_groups(make_group, scenarios, 2, weights=weights,
                                   show_progress=False)


async def test_strata_keep_their_places_when_after_each_drops_a_group():
    def drop_first(group: TrajectoryGroup) -> TrajectoryGroup | None:
        return None if group.trajectories[0].metadata["scenario"] == str((MIXED, 0)) else group

    out = await gather_signal_groups(make_group, strata(x="MMMM", y="MMMM"), 4, max_groups=8,
                                     after_each=drop_first, show_progress=False)
    # x's first group dropped: x draws again; y's two are y's
    assert (out.by_stratum, out.dropped) == ({"x": 2, "y": 2}, 1)
    assert sorted(g.trajectories[0].metadata["scenario"] for g in out.groups) == \
        sorted(str(s) for s in [(MIXED, 1), (MIXED, 2), (MIXED, 100), (MIXED, 101)])


def test_shuffled_passes_visit_each_once_per_pass_and_resume_at_an_offset():
    items = list(range(5))
    draws = [x for x, _ in zip(shuffled_passes(items, 3), range(15), strict=False)]
    assert all(sorted(draws[i:i + 5]) == items for i in (0, 5, 10))
    assert draws != list(range(15)) and draws[:5] != draws[5:10]
    resumed = [x for x, _ in zip(shuffled_passes(items, 3, offset=7), range(8), strict=False)]
    assert resumed == draws[7:]
    with pytest.raises(ValueError, match="no scenarios"):
        next(shuffled_passes([], 0))


# ---- the loop ----------------------------------------------------------------------------------


async def loop(model: CountingModel, run_dir, steps: int, **kw: Any):
    counts: dict[Any, int] = {}

    async def one(scenario: tuple[str, int]) -> Trajectory:
        # rollouts of a mixed scenario alternate 0 and 1: any group of 4 holds both
        counts[scenario] = counts.get(scenario, -1) + 1
        return await rollout(scenario, counts[scenario])

    return await train_loop(model, one, stream("AAM" * 4), [(MIXED, 100)], run_dir,
                            steps=steps, groups_per_step=2, rollouts_per_group=4,
                            eval_rollouts=1, print_fn=lambda s: None, **kw)


async def test_the_loop_trains_only_groups_with_signal_and_records_the_cost(tmp_path):
    model = CountingModel()
    result = await loop(model, tmp_path, steps=2)
    mixed = {str(s) for s in stream("AAM" * 4) if s[0] == MIXED}
    assert [len(step) for step in model.trained] == [2, 2]
    assert all(s in mixed for step in model.trained for s in step)
    drawn = [row["sampling_groups_drawn"] for row in result.steps]
    assert min(drawn) >= 2 and max(drawn) > 2  # 1 in 3 has signal: some step drew more
    rows = read_jsonl(tmp_path / "sampling.jsonl")
    assert [r["step"] for r in rows] == [1, 2]


async def test_a_resumed_loop_draws_what_an_uninterrupted_one_draws(tmp_path):
    straight = CountingModel()
    await loop(straight, tmp_path / "a", steps=3)
    resumed = CountingModel()
    await loop(resumed, tmp_path / "b", steps=1)
    await loop(resumed, tmp_path / "b", steps=2)
    assert resumed.trained == straight.trained


async def test_the_loop_without_dynamic_sampling_trains_what_it_drew(tmp_path):
    model = CountingModel()
    result = await loop(model, tmp_path, steps=1, oversample=None)
    assert len(model.trained[0]) == 2 and "sampling_groups_drawn" not in result.steps[0]
    with pytest.raises(ValueError, match="oversample must be None or a number >= 1"):
        await loop(model, tmp_path, steps=1, oversample=0.5)


async def stratified_loop(model: CountingModel, run_dir, steps: int, **kw: Any):
    """Scenarios (stratum, index): 10 of stratum 'a' for each of 'b', every group mixed."""
    train = [("a" if i % 11 else "b", i) for i in range(44)]
    counts: dict[Any, int] = {}

    async def one(scenario: tuple[str, int]) -> Trajectory:
        counts[scenario] = counts.get(scenario, -1) + 1
        return traj(float(counts[scenario] % 2), scenario)  # 0, 1, 0, ...: every group mixed

    kw = {"groups_per_step": 2, "stratify": lambda s: s[0], **kw}
    return await train_loop(model, one, train, [("a", 100)], run_dir, steps=steps,
                            rollouts_per_group=8, eval_rollouts=1, print_fn=lambda s: None, **kw)


@pytest.mark.parametrize("oversample", [3.0, None])
async def test_the_loop_shares_each_step_over_the_strata(tmp_path, oversample):
    model = CountingModel()
    await stratified_loop(model, tmp_path, steps=4, oversample=oversample)
    # 'b' is 1 in 11 of the scenarios, yet every step trains one group of each
    assert [sorted(x[2] for x in step) for step in model.trained] == [["a", "b"]] * 4
    assert len({x for step in model.trained for x in step}) > 2  # each step draws anew
    resumed = CountingModel()
    await stratified_loop(resumed, tmp_path / "r", steps=1, oversample=oversample)
    await stratified_loop(resumed, tmp_path / "r", steps=3, oversample=oversample)
    assert resumed.trained == model.trained  # a resumed run draws the same strata streams


@pytest.mark.parametrize("oversample", [3.0, None])
async def test_a_weighted_stratum_gets_its_share_of_every_step(tmp_path, oversample):
    model = CountingModel()
    await stratified_loop(model, tmp_path, steps=3, oversample=oversample,
                          groups_per_step=3, stratum_weights={"b": 2})
    # 'b' is 1 in 11 of the scenarios and weighs 2: two of every step's three groups
    assert [sorted(x[2] for x in step) for step in model.trained] == [["a", "b", "b"]] * 3
    model = CountingModel()
    await stratified_loop(model, tmp_path / "2", steps=3, oversample=oversample,
                          groups_per_step=2, stratum_weights={"b": 2})
    # 4 of 6 places over three steps: one step gives its odd place to 'a'
    assert sorted(sorted(x[2] for x in step) for step in model.trained) == [
        ["a", "b"], ["a", "b"], ["b", "b"]]


@pytest.mark.parametrize(("kw", "message"), [
    ({"stratum_weights": {"b": 2}, "stratify": None}, "stratum_weights: needs stratify"),
    ({"stratum_weights": {"c": 2}}, "weights: 'c' is not a stratum"),
])
async def test_the_loop_refuses_weights_it_cannot_use(tmp_path, kw, message):
    model = CountingModel()
    with pytest.raises(ValueError, match=message):
        await stratified_loop(model, tmp_path, steps=1, **kw)
    assert model.trained == [] and not (tmp_path / "eval.jsonl").exists()


async def test_no_budget_means_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="art_core.sampling"):
        out = await gather_signal_groups(make_group, stream("AAA"), 3, max_groups=3,
                                         show_progress=False)
    assert (len(out.groups), len(out.skipped), out.rounds) == (0, 3, 1)
    assert not caplog.records  # oversample 1 asked for no replacement: nothing to warn about


def turned(turn_rewards: list[float | None], reward: float) -> Trajectory:
    """A trajectory of len(turn_rewards) sampled turns, each with its own reward (None: none)."""
    n = len(turn_rewards)
    messages = [{"role": "user", "content": "go"}]
    for k in range(n):
        messages += [{"role": "assistant", "content": str(k)}, {"role": "user", "content": "more"}]
    t = Trajectory(messages=messages[:-1], reward=reward, turns=[
        {"message_index": 2 * k + 1, "prompt_token_ids": [1] * (2 * k + 1),
         "completion_token_ids": [5], "logprobs": [-1.0]} for k in range(n)])
    for k, r in enumerate(turn_rewards):
        if r is not None:
            t.set_turn_reward(k, r)
    return t


@pytest.mark.parametrize(("group", "by_reward", "by_turn"), [
    # equal episode rewards, earned at different turns: signal only for per-turn credit
    ([([0.3, 0.0], 0.3), ([0.0, 0.3], 0.3)], False, True),
    # rewards that differ: signal for both
    ([([0.3, 0.0], 0.3), ([0.0, 0.0], 0.0)], True, True),
    # the same turns and rewards: signal for neither
    ([([0.0, 0.3], 0.3), ([0.0, 0.3], 0.3)], False, False),
    # one trajectory: no baseline, no signal
    ([([0.3], 0.3)], False, False),
])
def test_the_signal_rule_follows_the_trainers_advantage(group, by_reward, by_turn):
    """Dynamic sampling keeps the groups the trainer trains: under `advantage="turn"` a group
    whose episode rewards are equal but whose turns earned them differently has signal."""
    from art_core import TrainConfig
    from art_core.sampling import signal_rule

    g = TrajectoryGroup(trajectories=[turned(r, reward) for r, reward in group])
    assert signal_rule()(g) is by_reward
    assert signal_rule(TrainConfig(advantage="group"))(g) is by_reward
    assert signal_rule(TrainConfig(advantage="turn"))(g) is by_turn
    assert signal_rule("turn")(g) is by_turn and signal_rule("group")(g) is by_reward


async def test_gather_keeps_groups_by_the_rule_it_is_given():
    async def one(scenario: int, i: int) -> Trajectory:
        # scenario 0: equal rewards earned at different turns; scenario 1: all the same
        if scenario == 0:
            return turned([0.3, 0.0] if i % 2 else [0.0, 0.3], 0.3)
        return turned([0.0, 0.3], 0.3)

    def make(scenario: int) -> list[Any]:
        return [one(scenario, i) for i in range(4)]

    from art_core import TrainConfig
    from art_core.sampling import signal_rule

    by_reward = await gather_signal_groups(make, [0, 1], 1, max_groups=2, show_progress=False)
    by_turn = await gather_signal_groups(make, [0, 1], 1, max_groups=2, show_progress=False,
                                         signal=signal_rule(TrainConfig(advantage="turn")))
    assert (len(by_reward.groups), len(by_reward.skipped)) == (0, 2)
    assert (len(by_turn.groups), by_turn.drawn) == (1, 1)
