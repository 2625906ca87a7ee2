"""Run many rollouts at once and collect their trajectories, tolerating a few failures.

`gather_trajectory_groups(groups)` takes an iterable of groups, each an iterable of awaitables
(usually `rollout(model, scenario)` coroutines) that return a `Trajectory`. The semantics:

- All rollouts of all groups run concurrently. `max_concurrency` caps how many run at the same
  time, across all groups (one semaphore); a rollout waiting for a slot has not started.
- A rollout that raises an `Exception`, or returns something that is not a `Trajectory` (counted
  as a `TypeError`), is a *failure*: it is recorded in its group's `exceptions` as a
  `RolloutError` (type, message, traceback) and the other rollouts go on.
- `max_exceptions` is how many failures are tolerated: an int (or a float >= 1) is a count; a
  float strictly between 0 and 1 is a fraction of all rollouts (floor(fraction x total)). As soon
  as the failures exceed it, every rollout still running or waiting is cancelled and
  `GatherError` is raised, naming the count and the first failure. The default, 0, means the first
  failure raises; `float("inf")` never raises.
- When every rollout of a group has finished, the group is built (trajectories and exceptions in
  the input order of their rollouts, never completion order) and `after_each(group)` is called,
  sync or async. It returns the group to keep (the same one or a changed one) or `None` to drop
  it. It is called for every group, including one whose rollouts all failed (it then has no
  trajectories). An exception raised by `after_each` is not a rollout failure: it cancels
  everything and propagates.
- An item of `groups` that is already a `TrajectoryGroup` is passed through unchanged (no
  `after_each`).
- The result lists the groups in input order, dropped groups omitted.
- `log_to=model` records the result with `model.log(groups, split=log_split)` (default split
  "val"): the run directory and the configured loggers (W&B, Langfuse) get the groups, their
  rewards, RULER's explanations and the exceptions, at the model's current step.
- The progress bar (tqdm, one tick per rollout) shows the running mean reward of the trajectories
  kept so far (rewards as `after_each` left them once a group has passed it), the failure count
  and, with `after_each`, the number of dropped groups.

`gather_trajectories(rollouts)` is the flat form: one iterable of awaitables, the same failure
semantics, and a list of the trajectories that succeeded, in input order.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

from art_core.trajectory import RolloutError, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_core.model import TrainableModel

log = logging.getLogger(__name__)

AfterEach = Callable[[TrajectoryGroup], TrajectoryGroup | None | Awaitable[TrajectoryGroup | None]]
"""`after_each(group)`: return the group to keep (maybe changed) or None to drop it; may be async."""


class GatherError(RuntimeError):
    """More rollouts failed than `max_exceptions` allows; the remaining ones were cancelled."""

    def __init__(self, message: str, exceptions: list[RolloutError]) -> None:
        super().__init__(message)
        self.exceptions = exceptions
        """The failures recorded before gathering stopped, in the order they happened."""


def _allowed_failures(max_exceptions: int | float, total: int) -> float:
    """The number of failures tolerated among `total` rollouts."""
    if isinstance(max_exceptions, bool) or not isinstance(max_exceptions, int | float):
        raise TypeError(f"max_exceptions must be an int or a float, got {max_exceptions!r}")
    if math.isnan(max_exceptions) or max_exceptions < 0:
        raise ValueError(f"max_exceptions must be >= 0, got {max_exceptions!r}")
    if 0 < max_exceptions < 1:
        # round() first so that 0.29 * 100 = 28.999999999999996 still allows 29
        return math.floor(round(max_exceptions * total, 9))
    return max_exceptions


def _collect(groups: Iterable[Any]) -> list[TrajectoryGroup | list[Awaitable[Any]]]:
    """Materialize the input, checking its shape before anything starts."""
    collected: list[TrajectoryGroup | list[Awaitable[Any]]] = []
    try:
        for gi, group in enumerate(groups):
            if isinstance(group, TrajectoryGroup):
                collected.append(group)
                continue
            if inspect.isawaitable(group):
                _close(group)
                raise TypeError(
                    f"group {gi} is a single awaitable; each group is an iterable of rollouts, "
                    "e.g. [rollout(model, scenario) for _ in range(4)]"
                )
            try:
                iterator = iter(group)
            except TypeError:
                raise TypeError(
                    f"group {gi} is a {type(group).__name__}, not an iterable of rollouts"
                ) from None
            items: list[Awaitable[Any]] = []
            collected.append(items)  # before iterating: on an error, what came out is closed
            for item in iterator:
                items.append(item)
            for ri, item in enumerate(items):
                if not inspect.isawaitable(item):
                    raise TypeError(
                        f"rollout {ri} of group {gi} is a {type(item).__name__}, not an awaitable; "
                        "pass the coroutine (rollout(...)), not the function"
                    )
    except BaseException:
        # nothing will await what was collected: close coroutines so Python does not warn
        for items in collected:
            if isinstance(items, list):
                for item in items:
                    _close(item)
        raise
    return collected


def _close(aw: object) -> None:
    if inspect.iscoroutine(aw):
        aw.close()
    elif isinstance(aw, asyncio.Future) and not aw.done():
        aw.cancel()


async def _call_after_each(after_each: AfterEach, group: TrajectoryGroup) -> TrajectoryGroup | None:
    result = after_each(group)
    if inspect.isawaitable(result):
        result = await result
    if result is not None and not isinstance(result, TrajectoryGroup):
        raise TypeError(
            f"after_each returned a {type(result).__name__}; it must return a TrajectoryGroup "
            "or None (to drop the group)"
        )
    return result


async def gather_trajectory_groups(
    groups: Iterable[Iterable[Awaitable[Trajectory]] | TrajectoryGroup],
    *,
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    max_concurrency: int | None = None,
    show_progress: bool = True,
    description: str = "gather",
    log_to: TrainableModel | None = None,
    log_split: str = "val",
) -> list[TrajectoryGroup]:
    """Run every rollout of every group concurrently and return the groups in input order.

    See the module docstring for the exact semantics of failures, `max_exceptions`,
    `after_each` and ordering. Raises `GatherError` when more than `max_exceptions` rollouts fail.
    """
    inputs = _collect(groups)
    total = sum(len(g) for g in inputs if isinstance(g, list))
    try:
        allowed = _allowed_failures(max_exceptions, total)
        if max_concurrency is not None and (
            isinstance(max_concurrency, bool)
            or not isinstance(max_concurrency, int)
            or max_concurrency < 1
        ):
            raise ValueError(
                f"max_concurrency must be None or an int >= 1, got {max_concurrency!r}"
            )
    except BaseException:
        for g in inputs:
            if isinstance(g, list):
                for aw in g:
                    _close(aw)
        raise

    from tqdm.auto import tqdm  # here, not at module level: keeps `import art_core` lean

    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    n_groups = len(inputs)
    results: list[TrajectoryGroup | None] = [None] * n_groups
    # per group: outcome of each rollout (a Trajectory or a RolloutError), None while running
    outcomes: list[list[Trajectory | RolloutError | None]] = [
        [None] * len(g) if isinstance(g, list) else [] for g in inputs
    ]
    remaining = [len(g) if isinstance(g, list) else 0 for g in inputs]
    failures: list[RolloutError] = []  # in the order they happened
    first_exc: BaseException | None = None
    stop: GatherError | None = None  # set once too many failed; then nothing new starts
    # rewards shown in the progress bar: per group (to replace after after_each) and in total
    reward_sum = [0.0] * n_groups
    reward_n = [0] * n_groups
    totals = [0.0, 0]  # sum and count over all groups
    dropped = 0

    # Every task reports its completion here; the loop below waits on this queue.
    done: asyncio.Queue[asyncio.Task[Any]] = asyncio.Queue()
    after_each_of: dict[asyncio.Task[Any], int] = {}  # after_each task -> group index
    rollout_of: dict[asyncio.Task[Any], tuple[int, int]] = {}  # rollout task -> (group, rollout)
    pending: set[asyncio.Task[Any]] = set()

    def spawn(coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        pending.add(task)
        task.add_done_callback(done.put_nowait)
        return task

    bar = tqdm(total=total, desc=description, unit="rollout", disable=not show_progress)

    def show() -> None:
        postfix: dict[str, Any] = {
            "reward": f"{totals[0] / totals[1]:.3f}" if totals[1] else "n/a",
            "exceptions": len(failures),
        }
        if after_each is not None:
            postfix["dropped"] = dropped
        bar.set_postfix(postfix, refresh=False)

    def set_rewards(gi: int, rewards: list[float]) -> None:
        """Make `rewards` the ones group `gi` contributes to the progress bar's mean."""
        totals[0] += sum(rewards) - reward_sum[gi]
        totals[1] += len(rewards) - reward_n[gi]
        reward_sum[gi], reward_n[gi] = sum(rewards), len(rewards)

    def group_finished(gi: int) -> None:
        trajectories = [o for o in outcomes[gi] if isinstance(o, Trajectory)]
        exceptions = [o for o in outcomes[gi] if isinstance(o, RolloutError)]
        group = TrajectoryGroup(trajectories=trajectories, exceptions=exceptions)
        if after_each is None:
            results[gi] = group
        else:
            after_each_of[spawn(_call_after_each(after_each, group))] = gi

    def record(gi: int, ri: int, result: Any, exc: BaseException | None) -> None:
        """Account for one finished rollout. Synchronous, and called before the rollout's
        concurrency slot is released, so no waiting rollout starts once `stop` is set."""
        nonlocal first_exc, stop
        if exc is None and not isinstance(result, Trajectory):
            exc = TypeError(
                f"rollout {ri} of group {gi} returned a {type(result).__name__}; "
                "a rollout must return an art_core.Trajectory"
            )
        if exc is None:
            outcomes[gi][ri] = result
            reward_sum[gi] += result.reward
            reward_n[gi] += 1
            totals[0] += result.reward
            totals[1] += 1
        else:
            error = RolloutError.from_exception(exc)
            outcomes[gi][ri] = error
            failures.append(error)
            first_exc = first_exc or exc
        show()
        bar.update(1)
        if len(failures) > allowed and stop is None:
            first = failures[0]
            stop = GatherError(
                f"{len(failures)} of {total} rollouts failed, more than "
                f"max_exceptions={max_exceptions!r} allows; the remaining rollouts were "
                f"cancelled. First failure: {first.type}: {first.message}",
                list(failures),
            )
        if stop is None:
            remaining[gi] -= 1
            if remaining[gi] == 0:
                group_finished(gi)

    async def run_rollout(gi: int, ri: int, aw: Awaitable[Any]) -> None:
        try:
            async with slots:
                if stop is not None:
                    return  # too many failed while this one waited for a slot: never start it
                try:
                    result = await aw
                except Exception as e:
                    record(gi, ri, None, e)
                else:
                    record(gi, ri, result, None)
        finally:
            # a no-op when `aw` ran; otherwise (cancelled or stopped before it started) it
            # stops Python's "coroutine was never awaited" warning
            _close(aw)

    for gi, g in enumerate(inputs):
        if isinstance(g, TrajectoryGroup):
            results[gi] = g
            set_rewards(gi, g.rewards)
        else:
            for ri, aw in enumerate(g):
                rollout_of[spawn(run_rollout(gi, ri, aw))] = (gi, ri)
    show()
    for gi, g in enumerate(inputs):
        if isinstance(g, list) and not g:
            group_finished(gi)  # an empty group is complete at once

    try:
        while pending and stop is None:
            task = await done.get()
            pending.discard(task)
            if task in after_each_of:
                gi = after_each_of.pop(task)
                kept = task.result()  # an after_each error propagates (see module docstring)
                if kept is None:
                    dropped += 1
                    set_rewards(gi, [])
                else:
                    results[gi] = kept
                    set_rewards(gi, kept.rewards)
                show()
                bar.refresh()
            elif task.cancelled():
                # we cancel nothing before leaving this loop: the rollout raised
                # CancelledError itself (e.g. a cancelled HTTP call inside it)
                gi, ri = rollout_of[task]
                record(
                    gi,
                    ri,
                    None,
                    asyncio.CancelledError(f"rollout {ri} of group {gi} was cancelled"),
                )
            else:
                task.result()  # re-raises a BaseException (KeyboardInterrupt) the rollout raised
        if stop is not None:
            raise stop from first_exc
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        bar.close()

    kept = [g for g in results if g is not None]
    if log_to is not None and kept:
        await log_to.log(kept, split=log_split)
    return kept


async def gather_trajectories(
    rollouts: Iterable[Awaitable[Trajectory]],
    *,
    max_exceptions: int | float = 0,
    max_concurrency: int | None = None,
    show_progress: bool = True,
    description: str = "gather",
) -> list[Trajectory]:
    """Run a flat iterable of rollouts; return the trajectories that succeeded, in input order.

    Failures follow the same `max_exceptions` rule as `gather_trajectory_groups`; failed
    rollouts are omitted from the result and logged as one warning.
    """
    (group,) = await gather_trajectory_groups(
        [rollouts],
        max_exceptions=max_exceptions,
        max_concurrency=max_concurrency,
        show_progress=show_progress,
        description=description,
    )
    if group.exceptions:
        first = group.exceptions[0]
        log.warning(
            "%s: %d of %d rollouts failed and were omitted; first: %s: %s",
            description,
            len(group.exceptions),
            len(group.exceptions) + len(group.trajectories),
            first.type,
            first.message,
        )
    return group.trajectories
