"""art_core.loop, the one evaluate-train-evaluate loop, with a counting stand-in for the model
(get_step / train): what is evaluated when, what is cached across a resume, what is drawn."""

from __future__ import annotations

from typing import Any

import pytest

from art_core import Trajectory, TrajectoryGroup
from art_core.loop import EvalStats, Rate, load_eval_groups, train_loop
from tests.support.counting import CountingModel


def traj(reward: float, **metrics: Any) -> Trajectory:
    return Trajectory(messages=[{"role": "user", "content": "q"}], reward=reward, metrics=metrics)


def test_stats_count_boolean_metrics_as_rates_and_average_the_rest():
    groups = [TrajectoryGroup(trajectories=[traj(1.0, success=True, turns=2),
                                            traj(0.2, success=False, turns=4)]),
              TrajectoryGroup(trajectories=[traj(1.0, success=True, turns=3)],
                              exceptions=[{"type": "E", "message": "m", "traceback": "t"}])]
    s = EvalStats.from_groups(3, groups)
    assert (s.step, s.scenarios, s.rollouts, s.failed) == (3, 2, 3, 1)
    assert s.reward == pytest.approx(2.2 / 3)
    assert (s.rates["success"].k, s.rates["success"].n) == (2, 3)
    assert (s.rates["solved"].k, s.rates["solved"].n) == (2, 3)
    assert s.means == {"turns": pytest.approx(3.0)}
    assert s.rate("absent").text() == "0.00 [0.00, 0.56]"
    assert EvalStats.from_row(s.row()) == s


@pytest.mark.parametrize(("k", "n", "lo", "hi"), [
    (0, 48, 0.0, 0.074), (24, 48, 0.364, 0.636), (48, 48, 0.926, 1.0), (3, 10, 0.108, 0.603)])
def test_rate_interval_is_wilson(k, n, lo, hi):
    assert Rate(k, n).ci == pytest.approx((lo, hi), abs=1e-3)


async def run(model: CountingModel, run_dir, evaluated: list, steps: int = 2, **kw: Any):
    async def rollout(scenario: str) -> Trajectory:
        if scenario.startswith("held"):
            evaluated.append((model.step, scenario))
        t = traj(float(len(scenario) % 3 == 0), success=scenario.endswith("1"))
        t.metadata["scenario"] = scenario
        return t

    return await train_loop(model, rollout, [f"train-{i}" for i in range(6)],
                            ["held-0", "held-1"], run_dir, steps=steps, groups_per_step=2,
                            rollouts_per_group=2, eval_rollouts=1, print_fn=lambda s: None, **kw)


async def test_evaluates_before_and_after_and_a_resume_reuses_the_cache(tmp_path):
    model, evaluated = CountingModel(), []
    result = await run(model, tmp_path, evaluated)
    assert (result.before.step, result.after.step) == (0, 2)
    assert sorted(evaluated) == [(0, "held-0"), (0, "held-1"), (2, "held-0"), (2, "held-1")]
    assert [len(step) for step in model.trained] == [2, 2]
    assert [t.metadata["scenario"] for g in load_eval_groups(tmp_path, 2) for t in g] == \
        ["held-0", "held-1"]

    evaluated.clear()
    again = await run(model, tmp_path, evaluated, steps=1)  # resumed: step 2 was evaluated
    assert sorted(evaluated) == [(3, "held-0"), (3, "held-1")]
    assert again.before == result.after and again.after.step == 3


async def test_draws_per_step_are_the_same_after_a_resume(tmp_path):
    straight = CountingModel()
    await run(straight, tmp_path / "a", [], steps=3)
    resumed = CountingModel()
    await run(resumed, tmp_path / "b", [], steps=1)
    await run(resumed, tmp_path / "b", [], steps=2)
    assert resumed.trained == straight.trained


async def test_eval_every_gives_a_curve_and_old_rows_are_evaluated_again(tmp_path):
    (tmp_path / "eval.jsonl").write_text('{"step": 0, "successes": 3, "episodes": 4}\n'
                                         '{"step": 1, "rew')  # an older format, a torn line
    model, evaluated = CountingModel(), []
    result = await run(model, tmp_path, evaluated, steps=3, eval_every=1)
    assert sorted(result.evals) == [0, 1, 2, 3]
    assert sorted({s for s, _ in evaluated}) == [0, 1, 2, 3]
