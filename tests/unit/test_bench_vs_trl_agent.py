"""benchmarks/vs_trl_agent.py: its report format, and that both systems are given the same
prompts (its task and reward: test_bench_agent_task.py). Nothing is started (no vLLM, no TRL training) and no timing is asserted
(a benchmark's numbers belong to the machine, not to a test)."""

from __future__ import annotations

from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

from art_langgraph import demo
from art_langgraph.messages import to_openai_message
from tests.support.data import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vs_trl_agent.py"


def load_bench():
    return load_benchmark("vs_trl_agent")


@pytest.fixture(scope="module")
def bench():
    return load_bench()


# ---- the report ---------------------------------------------------------------------------


def result(system: str, step_s: list[float], calls: float = 2.0, reward: float = 0.5,
           error: str | None = None) -> dict:
    return {"system": system, "model": "smollm2", "max_tokens": 64, "peak_rss_gib": 1.5,
            "setup_s": 1.0, "error": error,
            "steps": [{"step_s": s, "gen_s": s / 2, "train_s": s / 2, "sampled_tokens": 512,
                       "trained_tokens": 512, "calls": calls + i / 2, "reward": reward,
                       "tokens": 2048.0, "forwarded": 1024.0, "swap_s": 0.25}
                      for i, s in enumerate(step_s)]}


def test_report_cells_are_median_min_max(bench) -> None:
    lines = bench.format_report([result("trl", [8.0, 9.0, 10.0], calls=1.0, reward=0.2),
                                 result("ours", [4.0, 4.5, 6.0], calls=3.0, reward=0.9)])
    assert "step s" in lines[0] and "calls/ep" in lines[0] and "reward" in lines[0]
    assert "peak RSS GiB" in lines[0]
    trl = next(ln for ln in lines if ln.startswith("trl "))
    ours = next(ln for ln in lines if ln.startswith("ours "))
    assert "9.00 (8.00-10.00)" in trl  # median (min-max) of TRL's step time
    assert "4.50 (4.00-5.00)" in trl  # rollout s: half of it
    assert "1.50 (1.00-2.00)" in trl  # calls/ep over the steps: 1.0, 1.5, 2.0
    assert "0.20 (0.20-0.20)" in trl  # reward
    assert "4.50 (4.00-6.00)" in ours
    assert "3.50 (3.00-4.00)" in ours
    assert "0.90 (0.90-0.90)" in ours
    assert ours.endswith("1.50")  # peak RSS GiB
    assert "trl/ours: step time x2.00 (model calls per episode: trl 1.50, ours 3.50)" in lines
    assert lines[-1] == "ratio: 2.00"  # 9.0 / 4.5


def test_rates_are_per_step_rollout_and_forwarded_training(bench) -> None:
    m = bench.summarize(result("ours", [4.0, 8.0, 10.0]))
    # rollout: 512 sampled tokens over gen_s = 2, 4, 5 s; training: 1024 forwarded tokens over
    # train_s - swap_s = 1.75, 3.75, 4.75 s
    assert m["rollout_tps"] == pytest.approx((128.0, 102.4, 256.0))
    assert m["train_tps"] == pytest.approx((1024 / 3.75, 1024 / 4.75, 1024 / 1.75))
    assert m["forwarded"] == (1024.0, 1024.0, 1024.0)


def test_report_has_a_line_per_system_against_trl(bench) -> None:
    lines = bench.format_report([  # out of order: the trl/ lines follow SYSTEMS
        result("ours-merged", [5.0]), result("ours", [4.0]), result("trl", [8.0]),
        result("ours-lora", [16.0]),
    ])
    pairs = [ln for ln in lines if ln.startswith("trl/")]
    assert [ln.split(":")[0] for ln in pairs] == ["trl/ours", "trl/ours-lora", "trl/ours-merged"]
    assert pairs[0].startswith("trl/ours: step time x2.00")
    assert pairs[1].startswith("trl/ours-lora: step time x0.50")
    assert pairs[2].startswith("trl/ours-merged: step time x1.60")
    assert lines[-1] == "ratio: 2.00"  # always ours, the default, against trl


@pytest.mark.parametrize(("results", "failed", "pairs"), [
    pytest.param([result("trl", [2.0]), result("ours", [], error="EngineError: no vllm")],
                 ("ours", "EngineError: no vllm"), [], id="ours failed"),
    pytest.param([result("trl", [2.0]), result("ours", [])],
                 ("ours", "no steps counted"), [], id="ours counted no step"),
    pytest.param([result("trl", [2.0]), result("ours-lora", [1.0])], None,
                 ["trl/ours-lora"], id="ours missing"),
    pytest.param([result("trl", [], error="ImportError: no trl"), result("ours", [1.0])],
                 ("trl", "ImportError: no trl"), [], id="trl failed"),
    pytest.param([result("ours", [1.0]), result("ours-lora", [1.0])], None, [],
                 id="trl missing"),
    pytest.param([], None, [], id="nothing ran"),
])
def test_ratio_is_na_without_both_trl_and_ours(bench, results: list[dict],
                                               failed: tuple[str, str] | None,
                                               pairs: list[str]) -> None:
    lines = bench.format_report(results)
    if failed:
        system, why = failed
        assert f"{system:<12} failed: {why}" in lines
    assert [ln.split(":")[0] for ln in lines if ln.startswith("trl/")] == pairs
    assert lines[-1] == "ratio: n/a"


# ---- the same prompts for both systems ----------------------------------------------------


@pytest.mark.parametrize("task", ["single", "multi"])
@pytest.mark.parametrize("groups", [1, 2])
def test_both_systems_get_the_same_prompts_per_step(bench, task: str, groups: int) -> None:
    """run_trl puts every step's questions into one unshuffled dataset, `groups` prompts per
    optimizer step; run_ours asks step_tasks step by step: both read the same sequence, and
    each prompt is the demo's, the question last."""
    steps = 4
    dataset = [t for s in range(steps) for t in bench.step_tasks(task, s, groups)]  # run_trl's
    for step in range(steps):
        ours = bench.step_tasks(task, step, groups)  # run_ours'
        assert dataset[step * groups:(step + 1) * groups] == ours
        for t in ours:
            msgs = demo.prompt(t)
            trl_row = [to_openai_message(m) for m in msgs]  # TRL's row, OpenAI format
            assert [m["content"] for m in trl_row] == [m.content or None for m in msgs]
            assert isinstance(msgs[0], SystemMessage) and msgs[0].content == demo.SYSTEM
            assert isinstance(msgs[-1], HumanMessage) and msgs[-1].content == t.text
            assert trl_row[-1] == {"role": "user", "content": t.text}
            assert demo.this_question(msgs) == []  # no turn of its own yet
            assert sum(m["role"] == "assistant" for m in trl_row) == 2 * len(demo.EXAMPLES)

