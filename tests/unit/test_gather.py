"""gather_trajectory_groups / gather_trajectories: failures, thresholds, after_each, order, limits."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import warnings

import pytest

from art_core.gather import GatherError, gather_trajectories, gather_trajectory_groups
from art_core.trajectory import Trajectory, TrajectoryGroup

# a rollout coroutine left un-awaited (a leak in gather) makes the test that collects it fail
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


async def ok(reward: float, delay: float = 0.0) -> Trajectory:
    await asyncio.sleep(delay)
    return Trajectory(reward=reward, metadata={"r": reward})


async def flaky_rollout(message: str, delay: float = 0.0) -> Trajectory:
    await asyncio.sleep(delay)
    raise ValueError(message)


async def gather(groups, **kwargs) -> list[TrajectoryGroup]:
    kwargs.setdefault("show_progress", False)
    return await gather_trajectory_groups(groups, **kwargs)


async def test_order_is_input_order_not_completion_order():
    # later rollouts and later groups finish first
    groups = [[ok(10 * g + r, delay=0.002 * (12 - 4 * g - r)) for r in range(4)] for g in range(3)]
    result = await gather(groups)
    assert [g.rewards for g in result] == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]
    assert all(not g.exceptions for g in result)


async def test_exceptions_are_recorded_in_input_order_with_type_message_traceback():
    groups = [
        [ok(1.0), flaky_rollout("second", delay=0.0), flaky_rollout("first", delay=0.0)],
        [ok(2.0)],
    ]
    # "first" is listed last but fails... at the same time; order must still follow the input
    result = await gather(groups, max_exceptions=2)
    assert [g.rewards for g in result] == [[1.0], [2.0]]
    errors = result[0].exceptions
    assert [(e.type, e.message) for e in errors] == [
        ("ValueError", "second"),
        ("ValueError", "first"),
    ]
    assert "in flaky_rollout" in errors[0].traceback
    assert errors[0].traceback.rstrip().endswith("ValueError: second")
    assert result[1].exceptions == []


# (max_exceptions, rollouts, failures, raises)
THRESHOLDS = [
    (0, 4, 0, False),
    (0, 4, 1, True),
    (1, 4, 1, False),
    (1, 4, 2, True),
    (3, 6, 3, False),
    (3, 6, 4, True),
    (1.0, 4, 1, False),  # a float >= 1 is a count
    (2.5, 4, 2, False),
    (2.5, 4, 3, True),
    (0.25, 8, 2, False),  # a fraction of all rollouts: floor(0.25 * 8) = 2
    (0.25, 8, 3, True),
    (0.5, 6, 3, False),
    (0.5, 6, 4, True),
    (0.3, 4, 1, False),  # floor(1.2) = 1
    (0.3, 4, 2, True),
    (0.1, 5, 1, True),  # floor(0.5) = 0: any failure raises
    (0.29, 100, 29, False),  # 0.29 * 100 = 28.999999999999996 in floats
    (0.29, 100, 30, True),
    (math.inf, 4, 4, False),
]


@pytest.mark.parametrize(("max_exceptions", "n", "n_fail", "raises"), THRESHOLDS)
async def test_max_exceptions(max_exceptions, n, n_fail, raises):
    # two groups; the last n_fail rollouts fail at once (in input order), the rest take a moment
    fail_from = n - n_fail

    def rollout(i: int):
        return flaky_rollout(f"boom {i}") if i >= fail_from else ok(float(i), delay=0.01)

    half = n // 2
    groups = [[rollout(i) for i in range(half)], [rollout(i) for i in range(half, n)]]
    if raises:
        with pytest.raises(GatherError) as info:
            await gather(groups, max_exceptions=max_exceptions)
        message = str(info.value)
        failed = len(info.value.exceptions)
        assert (
            failed
            == math.floor(max_exceptions if max_exceptions >= 1 else round(max_exceptions * n, 9))
            + 1
        )
        assert f"{failed} of {n} rollouts failed" in message
        assert f"ValueError: boom {fail_from}" in message  # the first failure
        assert isinstance(info.value, RuntimeError)
        assert isinstance(info.value.__cause__, ValueError)
    else:
        result = await gather(groups, max_exceptions=max_exceptions)
        assert [len(g) + len(g.exceptions) for g in result] == [half, n - half]
        assert sum(len(g.exceptions) for g in result) == n_fail
        assert [t.reward for g in result for t in g] == [float(i) for i in range(fail_from)]
        messages = [e.message for g in result for e in g.exceptions]
        assert messages == [f"boom {i}" for i in range(fail_from, n)]


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan])
async def test_invalid_max_exceptions(bad):
    coro = ok(1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="max_exceptions"):
            await gather([[coro]], max_exceptions=bad)
        del coro
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


async def test_exceeding_cancels_the_rest_and_leaves_no_unawaited_coroutine():
    started, cancelled, finished = [], [], []

    async def slow(i: int) -> Trajectory:
        started.append(i)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        finished.append(i)
        return Trajectory()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = [[slow(0), slow(1)], [flaky_rollout("x", delay=0.01)], [slow(2), slow(3)]]
        with pytest.raises(GatherError, match="1 of 5 rollouts failed"):
            # 4 slots: slow(3) waits for a slot and never starts
            await asyncio.wait_for(gather(groups, max_concurrency=4), timeout=5)
        del groups
        gc.collect()
    assert sorted(started) == sorted(cancelled) == [0, 1, 2]
    assert finished == []
    assert not [w for w in caught if "never awaited" in str(w.message)]


async def test_non_trajectory_return_is_a_failure():
    async def returns_dict() -> dict:
        return {"reward": 1.0}

    async def returns_none() -> None:
        return None

    result = await gather([[ok(1.0), returns_dict(), returns_none()]], max_exceptions=2)
    (group,) = result
    assert group.rewards == [1.0]
    assert [e.type for e in group.exceptions] == ["TypeError", "TypeError"]
    assert "returned a dict" in group.exceptions[0].message
    assert "returned a NoneType" in group.exceptions[1].message
    assert "must return an art_core.Trajectory" in group.exceptions[0].message

    with pytest.raises(GatherError, match="TypeError: rollout 0 of group 0 returned a dict"):
        await gather([[returns_dict()]])


def _keep_high_double_reward(group: TrajectoryGroup) -> TrajectoryGroup | None:
    if group.rewards and group.rewards[0] < 0.5:
        return None
    return TrajectoryGroup(
        trajectories=[t.model_copy(update={"reward": 2 * t.reward}) for t in group],
        exceptions=group.exceptions,
        metadata={"scored": True},
    )


def _sync_after_each(calls):
    def after_each(group: TrajectoryGroup) -> TrajectoryGroup | None:
        calls.append(group.rewards)
        return _keep_high_double_reward(group)

    return after_each


def _async_after_each(calls):
    async def after_each(group: TrajectoryGroup) -> TrajectoryGroup | None:
        await asyncio.sleep(0.001)
        calls.append(group.rewards)
        return _keep_high_double_reward(group)

    return after_each


def _in_place_after_each(calls):
    def after_each(group: TrajectoryGroup) -> TrajectoryGroup | None:
        calls.append(group.rewards)
        if group.rewards and group.rewards[0] < 0.5:
            return None
        for t in group:
            t.reward *= 2
        group.metadata["scored"] = True
        return group

    return after_each


@pytest.mark.parametrize("make", [_sync_after_each, _async_after_each, _in_place_after_each])
async def test_after_each_drops_and_modifies(make):
    calls: list[list[float]] = []
    groups = [
        [ok(0.6, delay=0.02), ok(0.7, delay=0.01)],
        [ok(0.1), ok(0.2)],  # dropped
        [ok(0.8), flaky_rollout("x")],
        [flaky_rollout("y"), flaky_rollout("z")],  # all failed: still passed to after_each
    ]
    result = await gather(groups, after_each=make(calls), max_exceptions=3)
    assert [g.rewards for g in result] == [[1.2, 1.4], [1.6], []]
    assert all(g.metadata == {"scored": True} for g in result)
    assert [len(g.exceptions) for g in result] == [0, 1, 2]
    # called once per group, each with its trajectories in input order
    assert sorted(calls) == sorted([[0.6, 0.7], [0.1, 0.2], [0.8], []])


async def test_after_each_returning_wrong_type_raises():
    with pytest.raises(TypeError, match="after_each returned a list"):
        await gather([[ok(1.0)]], after_each=lambda g: list(g))


async def slow(cancelled: list[bool]) -> Trajectory:
    """A rollout that only ends by cancellation, which it records."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        cancelled.append(True)
        raise
    return Trajectory()


async def test_after_each_error_propagates_and_cancels_rollouts():
    cancelled = []

    def boom(group: TrajectoryGroup) -> TrajectoryGroup:
        raise KeyError("judge down")

    with pytest.raises(KeyError, match="judge down"):
        await asyncio.wait_for(gather([[ok(1.0)], [slow(cancelled)]], after_each=boom), timeout=5)
    assert cancelled == [True]


@pytest.mark.parametrize(("limit", "expected_max"), [(1, 1), (3, 3), (None, 10), (50, 10)])
async def test_concurrency_limit(limit, expected_max):
    in_flight = 0
    peak = 0

    async def tracked(i: int) -> Trajectory:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.005)
        in_flight -= 1
        return Trajectory(reward=i)

    groups = [[tracked(5 * g + r) for r in range(5)] for g in range(2)]
    result = await gather(groups, max_concurrency=limit)
    assert peak == expected_max
    assert [g.rewards for g in result] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
async def test_invalid_max_concurrency(bad):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="max_concurrency"):
            await gather([[ok(1.0)]], max_concurrency=bad)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


async def test_rollout_cancelling_itself_is_a_failure():
    async def self_cancelled() -> Trajectory:
        raise asyncio.CancelledError()

    (group,) = await gather([[ok(1.0), self_cancelled()]], max_exceptions=1)
    assert group.rewards == [1.0]
    assert [e.type for e in group.exceptions] == ["CancelledError"]
    assert "rollout 1 of group 0 was cancelled" in group.exceptions[0].message


async def test_error_inside_a_group_generator_is_not_masked():
    def rollouts():
        yield ok(1.0)
        raise TypeError("bug in the user's generator")

    with pytest.raises(TypeError, match="bug in the user's generator"):
        await gather([rollouts()])


async def test_trajectory_group_items_pass_through_unchanged():
    ready = TrajectoryGroup(trajectories=[Trajectory(reward=5.0)], metadata={"ready": True})
    seen = []
    result = await gather([[ok(1.0)], ready, []], after_each=lambda g: seen.append(len(g)) or g)
    assert result[1] is ready
    assert [g.rewards for g in result] == [[1.0], [5.0], []]
    assert sorted(seen) == [0, 1]  # after_each ran for the two gathered groups only


async def test_empty_input():
    assert await gather([]) == []
    assert await gather_trajectories([], show_progress=False) == []


@pytest.mark.parametrize(
    ("groups", "match"),
    [
        (lambda: [ok(1.0)], "group 0 is a single awaitable"),
        (lambda: [[ok(1.0)], 3], "group 1 is a int, not an iterable"),
        (lambda: [[ok(1.0), ok]], "rollout 1 of group 0 is a function, not an awaitable"),
    ],
)
async def test_bad_input_shape_is_rejected_before_anything_runs(groups, match):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match=match):
            await gather(groups())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


async def test_cancelling_the_gather_cancels_rollouts():
    cancelled = []

    task = asyncio.create_task(gather([[slow(cancelled), slow(cancelled)], [slow(cancelled)]]))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled == [True, True, True]


async def test_progress_bar_shows_mean_reward_exceptions_and_drops(capsys):
    groups = [[ok(1.0), ok(0.0)], [ok(0.25), flaky_rollout("x")], [ok(0.1)]]
    result = await gather_trajectory_groups(
        groups,
        max_exceptions=1,
        after_each=lambda g: None if g.rewards == [0.1] else g,
        description="eval",
    )
    assert len(result) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1].split("\r")[-1]
    assert last.startswith("eval: 100%")
    assert "5/5" in last
    # mean of the kept trajectories: (1.0 + 0.0 + 0.25) / 3
    assert "reward=0.417" in last
    assert "exceptions=1" in last
    assert "dropped=1" in last


async def test_gather_trajectories_flat(caplog):
    rollouts = [ok(3.0, delay=0.01), flaky_rollout("bad"), ok(1.0), ok(2.0, delay=0.005)]
    with caplog.at_level(logging.WARNING, logger="art_core.gather"):
        result = await gather_trajectories(rollouts, max_exceptions=1, show_progress=False)
    assert [t.reward for t in result] == [3.0, 1.0, 2.0]
    assert "1 of 4 rollouts failed and were omitted; first: ValueError: bad" in caplog.text

    with pytest.raises(GatherError, match="2 of 3 rollouts failed"):
        await gather_trajectories(
            [flaky_rollout("a"), flaky_rollout("b"), ok(1.0)],
            max_exceptions=0.5,
            show_progress=False,
        )


async def test_gather_trajectories_respects_concurrency():
    in_flight = peak = 0

    async def tracked() -> Trajectory:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.002)
        in_flight -= 1
        return Trajectory()

    result = await gather_trajectories(
        (tracked() for _ in range(6)), max_concurrency=2, show_progress=False
    )
    assert len(result) == 6 and peak == 2
