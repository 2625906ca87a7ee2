"""Pipelined RL: rollouts keep running while the model trains, with a bound on staleness.

The algorithm of `PipelineTrainer.run(steps)`:

1. Producer: keep up to `max_groups_in_flight` groups running (each: `rollouts_per_group`
   rollouts of one scenario, then `after_each`, e.g. RULER), as long as more groups are
   still needed for the steps left. A completed group is written to the store
   (`groups.jsonl`, art_core/pipeline/store.py) before it joins the pool.
2. Trainer: as soon as the pool holds `groups_per_step` groups, take the oldest and train one
   step (`model.train`). It never waits for a straggler: a rollout still running carries over
   into a later step.
   Dynamic sampling (`oversample`, art_core/sampling.py): a completed group whose rewards are
   all equal carries no signal; it is stored, marked dropped ("no_signal") and another
   scenario is drawn in its place, up to `oversample` x groups_per_step groups completed per
   step; past that budget such groups join the pool (the trainer counts them) and a warning
   says so.
3. Off-policy bound: every sampled turn carries the step of the adapter that sampled it. A
   group whose oldest turn is more than `max_steps_off_policy` steps behind the policy being
   trained is dropped and counted. The loss's importance ratio uses the sampler's own
   logprobs, truncated (CISPO's capped weight, the default loss), so a group one step behind
   is corrected, not trusted blindly. The step's metrics say how stale it was
   (`off_policy_steps_mean`/`_max`, `frac_turns_off_policy`, from the backend).
4. Devices: *collocated* (one device; the default on a CPU or one GPU): during a step the
   gateway holds new requests, rollouts waiting on tools go on, and conversations in flight
   continue on the new adapter after the swap (token in: their earlier turns keep their
   tokens and their step). *Dedicated* (the trainer on devices the engine does not use): the
   engine serves the previous step while the next trains, and holds requests only for the
   swap. `mode="auto"` lets the backend choose from its hardware (LocalBackend's
   `dedicated_training`).
5. Resume: a killed pipeline, run again on the same `run_dir`, finds its completed groups and
   the step it had asked for in the store; that step is asked for again with the same request
   id, so the backend answers with the step if it was committed, or trains it: no group is
   lost, no committed step is trained twice.

A rollout is a plain `async (scenario) -> Trajectory` with model and tools bound, as for
art_core.loop.train_loop: a function of your own, a LangGraph graph with `TrajectoryRecorder`,
or art_mcp's `run_agent`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from art_core.gather import AfterEach, GatherError, gather_trajectory_groups
from art_core.model import TrainableModel
from art_core.pipeline.store import Buffered, PipelineStore
from art_core.sampling import DEFAULT_BUDGET, shuffled_passes, signal_rule
from art_core.trajectory import steps_off_policy

log = logging.getLogger(__name__)

Mode = Literal["auto", "collocated", "dedicated"]
KEEP_SERVING: dict[str, bool | None] = {"auto": None, "collocated": False, "dedicated": True}


@dataclass
class PipelineResult:
    """What `run` did: one row per step it trained, and the groups it dropped or lost."""

    steps: list[dict[str, Any]]
    dropped_stale: int
    cancelled_stale: int  # running groups cancelled because they could only finish too stale
    failed_groups: int
    filtered_groups: int  # dropped by after_each
    skipped_no_signal: int  # completed with all rewards equal: another scenario was drawn
    seconds: float
    step_seconds: list[float] = field(default_factory=list)  # wall time of each step


class PipelineTrainer:
    """Trains `model` on groups of rollouts gathered while it trains (the module docstring)."""

    def __init__(self, model: TrainableModel, rollout: Callable[[Any], Any],
                 scenarios: Sequence[Any], *, run_dir: str | Path, groups_per_step: int = 4,
                 rollouts_per_group: int = 4, max_steps_off_policy: int = 1,
                 max_groups_in_flight: int | None = None, after_each: AfterEach | None = None,
                 train_config: Any = None, mode: Mode = "auto", seed: int = 0,
                 max_exceptions: int | float = 0.5, max_failed_groups_in_a_row: int = 8,
                 oversample: float | None = DEFAULT_BUDGET, show_progress: bool = True,
                 on_step: Callable[[dict[str, Any]], str | None] | None = None,
                 print_fn: Callable[[str], None] = print) -> None:
        """`max_steps_off_policy`: the oldest turn of a trained group may be this many steps
        behind the policy (1, as prime-rl's default: one step of overlap; 0 trains only on
        groups sampled wholly by the current policy). `max_groups_in_flight` (default 2 x
        groups_per_step): groups running at once; more keeps the engine busier while others
        wait on tools, but each takes longer to finish and may go stale. `max_exceptions`:
        failed rollouts a group tolerates (as gather_trajectory_groups takes it); a group
        beyond it is counted failed, and `max_failed_groups_in_a_row` failed groups in a row
        stop the run (every rollout failing is a bug, not bad luck). `run_dir`: the store of
        completed groups (resume). `oversample`: groups completed per step at most, as a multiple
        of groups_per_step, while groups without signal are replaced (dynamic sampling; None
        trains every completed group). `on_step(row)` returns the line printed after each step."""
        for name, value, least in (("groups_per_step", groups_per_step, 1),
                                   ("rollouts_per_group", rollouts_per_group, 2),
                                   ("max_steps_off_policy", max_steps_off_policy, 0),
                                   ("max_failed_groups_in_a_row", max_failed_groups_in_a_row, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if max_groups_in_flight is None:
            max_groups_in_flight = 2 * groups_per_step
        if isinstance(max_groups_in_flight, bool) or not isinstance(max_groups_in_flight, int) \
                or max_groups_in_flight < 1:
            raise ValueError(f"max_groups_in_flight must be an integer >= 1, got "
                             f"{max_groups_in_flight!r}")
        if oversample is not None and (isinstance(oversample, bool) or
                                       not isinstance(oversample, int | float) or oversample < 1):
            raise ValueError(f"oversample must be None or a number >= 1, got {oversample!r}")
        if mode not in KEEP_SERVING:
            raise ValueError(f"mode must be one of {list(KEEP_SERVING)}, got {mode!r}")
        scenarios = list(scenarios)
        if not scenarios:
            raise ValueError("scenarios is empty: the pipeline needs at least one to draw")
        self.model, self.rollout, self.scenarios = model, rollout, scenarios
        self.store = PipelineStore(run_dir)
        self.groups_per_step, self.rollouts_per_group = groups_per_step, rollouts_per_group
        self.max_steps_off_policy = max_steps_off_policy
        self.max_groups_in_flight = max_groups_in_flight
        self.after_each, self.train_config, self.mode = after_each, train_config, mode
        self._has_signal = signal_rule(train_config)  # the trainer's rule for this config
        self.seed, self.max_exceptions = seed, max_exceptions
        self.max_failed_in_a_row = max_failed_groups_in_a_row
        self.oversample = oversample
        self.show_progress, self.on_step, self.print_fn = show_progress, on_step, print_fn

    # ---- state of one run --------------------------------------------------------------------

    def _reset(self, pool: list[Buffered], steps: int) -> None:
        self._pool = pool
        self._policy = 0
        self._left = steps  # steps still to train in this run
        self._in_flight: dict[asyncio.Task[None], int] = {}  # -> the policy when it started
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._failed_in_a_row = 0
        self.dropped_stale = self.failed_groups = self.filtered_groups = 0
        self.cancelled_stale = self.skipped_no_signal = 0
        self._dropped_since_step = self._cancelled_since_step = self._skipped_since_step = 0
        self._budget_warned = False

    def _notify(self) -> None:
        """Wake everything waiting for a change (the producer, the trainer)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait_for(self, ready: Callable[[], bool]) -> None:
        # no await between the check and the wait: a change cannot slip in between
        while not ready():
            await self._changed.wait()

    def _scenario_stream(self, offset: int) -> Iterator[Any]:
        """Scenarios in shuffled passes (each equally often), seeded: a resumed run goes on
        from the number of groups it had completed."""
        return shuffled_passes(self.scenarios, self.seed, offset)

    def _skip_no_signal(self) -> bool:
        """Whether a completed group without signal is replaced (within this step's budget)."""
        if self.oversample is None:
            return False
        extra = round((self.oversample - 1) * self.groups_per_step)
        if self._skipped_since_step < extra:
            return True
        if not self._budget_warned:
            self._budget_warned = True
            log.warning("pipeline: %d groups without signal replaced since the last step "
                        "(oversample=%s); the next ones are trained as they are", extra,
                        self.oversample)
        return False

    # ---- producer ----------------------------------------------------------------------------

    def _wanted(self) -> int:
        """Groups still to start: enough for the steps left, counting those ready or running."""
        return self._left * self.groups_per_step - len(self._pool) - len(self._in_flight)

    async def _produce(self, scenarios: Iterator[Any], bar: Any) -> None:
        while True:
            await self._wait_for(lambda: len(self._in_flight) < self.max_groups_in_flight
                                 and self._wanted() > 0)
            task = asyncio.ensure_future(self._one_group(next(scenarios), bar))
            self._in_flight[task] = self._policy
            self._show(bar)

    async def _one_group(self, scenario: Any, bar: Any) -> None:
        """Run one group; a completed one is stored, then joins the pool."""
        task = asyncio.current_task()
        started = self._policy
        try:
            groups = await gather_trajectory_groups(
                [[self.rollout(scenario) for _ in range(self.rollouts_per_group)]],
                max_exceptions=self.max_exceptions, after_each=self.after_each,
                show_progress=False)
            self._failed_in_a_row = 0
            if not groups or not groups[0].trajectories:
                self.filtered_groups += 1
                return
            item = Buffered(self.store.new_group_id(), started, groups[0])
            item.group.metadata["pipeline_group"] = item.id
            await asyncio.to_thread(self.store.add, item)  # on disk before it can be trained
            if not self._has_signal(item.group) and self._skip_no_signal():
                await asyncio.to_thread(self.store.dropped, [item], "no_signal", self._policy)
                self.skipped_no_signal += 1
                self._skipped_since_step += 1
                return
            self._pool.append(item)
        except GatherError as e:
            self.failed_groups += 1
            self._failed_in_a_row += 1
            if self._failed_in_a_row >= self.max_failed_in_a_row:
                self._error = RuntimeError(
                    f"{self._failed_in_a_row} groups in a row failed (more than "
                    f"max_exceptions={self.max_exceptions!r} of their rollouts each); the "
                    f"last: {e}")
        except Exception as e:  # after_each or the store failed: it would again; stop
            self._error = e
        finally:
            self._in_flight.pop(task, None)  # type: ignore[arg-type]
            self._notify()
            self._show(bar)

    # ---- trainer -----------------------------------------------------------------------------

    def _cancel_doomed(self) -> None:
        """Cancel running groups that can only finish too stale. A group's first turn is
        sampled by the policy it started under, or by the next one if it was held through a
        swap; once the policy is more than `max_steps_off_policy` + 1 steps past its start,
        it would be dropped, and it only takes the engine from fresher groups."""
        for task, started in list(self._in_flight.items()):
            if self._policy - started - 1 > self.max_steps_off_policy and not task.done():
                task.cancel()
                self.cancelled_stale += 1
                self._cancelled_since_step += 1

    def _drop_stale(self) -> None:
        stale = [b for b in self._pool
                 if steps_off_policy(b.group, self._policy) > self.max_steps_off_policy]
        if stale:
            self._pool = [b for b in self._pool if b not in stale]
            self.store.dropped(stale, "stale", self._policy)
            self.dropped_stale += len(stale)
            self._dropped_since_step += len(stale)

    async def _next_batch(self, bar: Any) -> list[Buffered]:
        def ready() -> bool:
            if self._error is not None:
                return True
            self._drop_stale()
            return len(self._pool) >= self.groups_per_step

        await self._wait_for(ready)
        if self._error is not None:
            raise self._error
        self._show(bar)
        # the oldest policy first: the groups closest to going stale (sorted is stable)
        self._pool.sort(key=lambda b: b.started_step)
        batch = self._pool[:self.groups_per_step]
        self._pool = self._pool[self.groups_per_step:]
        return batch

    async def _train(self, batch: list[Buffered], request_id: str, waited: float,
                     started: float, bar: Any) -> dict[str, Any]:
        in_flight, ready = len(self._in_flight), len(self._pool)
        t0 = time.perf_counter()
        result = await self.model.train([b.group for b in batch], self.train_config,
                                        request_id=request_id,
                                        keep_serving=KEEP_SERVING[self.mode])
        m = result.metrics
        row: dict[str, Any] = {
            "step": result.step, "seconds": time.perf_counter() - started,
            "wait_seconds": waited, "train_call_seconds": time.perf_counter() - t0,
            "groups": len(batch), "groups_in_flight": in_flight, "groups_ready": ready,
            "dropped_stale": self._dropped_since_step,
            "cancelled_stale": self._cancelled_since_step,
            "skipped_no_signal": self._skipped_since_step,
            "groups_started_behind": sum(self._policy - b.started_step for b in batch)
            / len(batch),
        }
        for k in ("reward_mean", "loss", "off_policy_steps_mean", "off_policy_steps_max",
                  "frac_turns_off_policy", "seconds"):
            if k in m:
                row["train_seconds" if k == "seconds" else k] = m[k]
        self._dropped_since_step = self._cancelled_since_step = self._skipped_since_step = 0
        self._budget_warned = False
        await asyncio.to_thread(self.store.committed, request_id, result.step, row)
        self._policy = max(self._policy, result.step)
        self._cancel_doomed()
        self._notify()
        self._show(bar)
        return row

    def _show(self, bar: Any) -> None:
        bar.set_postfix({"step": self._policy, "in flight": len(self._in_flight),
                         "ready": len(self._pool), "stale": self.dropped_stale,
                         "failed": self.failed_groups}, refresh=False)
        bar.refresh()

    def _report(self, row: dict[str, Any]) -> None:
        line = self.on_step(row) if self.on_step is not None else step_line(row)
        if line:
            self.print_fn(line)

    async def run(self, steps: int) -> PipelineResult:
        """Train `steps` more steps (a step asked for before a kill and committed meanwhile
        does not count); returns a row per step and the drop counts."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
        from tqdm.auto import tqdm  # here: keeps `import art_core` lean

        pool, pending = await asyncio.to_thread(self.store.recover)
        self._reset(pool, steps)
        self._policy = await self.model.get_step()
        rows: list[dict[str, Any]] = []
        t_start = last = time.perf_counter()
        bar = tqdm(total=steps, desc="pipeline", unit="step", disable=not self.show_progress)
        producer: asyncio.Task[None] | None = None
        try:
            if pending is not None and pending.groups:
                # asked for before a kill: the backend answers with it if it was committed
                before = self._policy
                row = await self._train(pending.groups, pending.request_id, 0.0, last, bar)
                if row["step"] > before:
                    rows.append(row)
                    self._left -= 1
                    bar.update(1)
                    self._report(row)
                last = time.perf_counter()
            scenarios = self._scenario_stream(
                await asyncio.to_thread(self.store.completed_groups))
            producer = asyncio.ensure_future(self._produce(scenarios, bar))
            while self._left > 0:
                t_wait = time.perf_counter()
                batch = await self._next_batch(bar)
                waited = time.perf_counter() - t_wait
                request_id = self.store.new_request_id()
                await asyncio.to_thread(self.store.train, request_id, batch, self._policy)
                self._left -= 1  # the producer starts no group for this step any more
                row = await self._train(batch, request_id, waited, last, bar)
                last = time.perf_counter()
                rows.append(row)
                bar.update(1)
                self._report(row)
        finally:
            if producer is not None:
                producer.cancel()
            running = [*self._in_flight, *([producer] if producer else [])]
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
            bar.close()
        return PipelineResult(steps=rows, dropped_stale=self.dropped_stale,
                              cancelled_stale=self.cancelled_stale,
                              failed_groups=self.failed_groups,
                              filtered_groups=self.filtered_groups,
                              skipped_no_signal=self.skipped_no_signal,
                              seconds=time.perf_counter() - t_start,
                              step_seconds=[r["seconds"] for r in rows])


def step_line(row: dict[str, Any]) -> str:
    """The default line printed after each step."""
    def num(key: str, spec: str) -> str:
        return "n/a" if row.get(key) is None else format(float(row[key]), spec)

    return (f"step {row['step']}: train reward {num('reward_mean', '.3f')}  loss "
            f"{num('loss', '+.4f')}  {row['seconds']:.1f} s (waited {row['wait_seconds']:.1f} s)"
            f"  off-policy {num('off_policy_steps_mean', '.2f')} (max "
            f"{num('off_policy_steps_max', '.0f')})  dropped stale {row['dropped_stale']}")
