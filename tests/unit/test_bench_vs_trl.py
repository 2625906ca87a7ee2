"""benchmarks/vs_trl.py: its report format, and its TRL half in the tiniest setting. No timing is
asserted (a benchmark's numbers belong to the machine, not to a test)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.data import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vs_trl.py"


def load_bench():
    return load_benchmark("vs_trl")


def result(system: str, length: int, step_s: list[float], tokens: int, error: str | None = None
           ) -> dict:
    return {"system": system, "model": "smollm2", "max_tokens": length, "peak_rss_gib": 1.5,
            "setup_s": 1.0, "error": error,
            "steps": [{"step_s": s, "gen_s": s / 2, "train_s": s / 2, "sampled_tokens": tokens,
                       "trained_tokens": tokens} for s in step_s]}


def test_report_table_ratios_and_last_line() -> None:
    bench = load_bench()
    lines = bench.format_report([
        result("trl", 64, [8.0, 9.0, 10.0], 512), result("ours", 64, [4.0, 4.5, 6.0], 512),
        result("trl", 256, [30.0, 33.0, 36.0], 2048), result("ours", 256, [20.0, 22.0, 24.0], 2048),
    ])
    text = "\n".join(lines)
    assert "step s" in lines[0] and "peak RSS GiB" in lines[0]
    assert "4.50 (4.00-6.00)" in text  # median (min-max) of our step time at 64 tokens
    assert "ours/trl: full-step throughput x2.00" in text  # 9.0 / 4.5
    assert "ours/trl: full-step throughput x1.50" in text  # 33 / 22
    assert lines[-1] == "ratio: 1.50"  # the smallest configuration's ratio


def test_the_last_line_is_the_default_system_when_it_ran() -> None:
    bench = load_bench()
    lines = bench.format_report([
        result("trl", 64, [8.0], 512), result("ours-lora", 64, [16.0], 512),
        result("ours", 64, [4.0], 512),
        result("trl", 256, [30.0], 2048), result("ours-lora", 256, [40.0], 2048),
        result("ours", 256, [24.0], 2048),
    ])
    assert "ours/trl: full-step throughput x2.00" in "\n".join(lines)
    assert lines[-2] == "smallest ratio to trl: ours-lora 0.50, ours 1.25 (the last line is " \
                        "ours)"
    assert lines[-1] == "ratio: 1.25"


def test_report_without_a_pair_or_with_a_failure() -> None:
    bench = load_bench()
    lines = bench.format_report([result("trl", 64, [2.0], 64),
                                 result("ours", 64, [], 0, error="EngineError: no vllm")])
    assert any("failed: EngineError: no vllm" in ln for ln in lines)
    assert lines[-1] == "ratio: n/a"


def test_prompts_and_reward_are_the_same_for_both_systems() -> None:
    bench = load_bench()
    assert bench.step_prompts(0, 2) != bench.step_prompts(1, 2)
    assert bench.step_prompts(3, 1) == bench.step_prompts(3, 1)
    assert bench.reward("a bb longer words here") == pytest.approx(3 / 5)
    assert bench.reward("") == 0.0


@pytest.mark.slow  # starts processes: make test runs it, make unit does not
def test_trl_half_runs_in_the_tiniest_setting(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    env = dict(os.environ, ART_HOME=os.environ.get("ART_HOME", str(tmp_path)))
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--systems", "trl", "--models", "tiny-qwen3",
         "--max-tokens", "8", "--steps", "1", "--warmup", "0", "--micro-batch", "8"],
        env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    row = next(ln for ln in lines if ln.startswith("tiny-qwen3") and " trl " in ln)
    assert "failed" not in row, row
    assert lines[-1] == "ratio: n/a"  # only one system ran
