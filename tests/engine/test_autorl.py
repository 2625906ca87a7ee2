"""examples/autorl.py in its smallest setting on the embedded model (tests/unit/test_autorl.py
checks the pipeline against a scripted server)."""

from __future__ import annotations

import pytest

from art_core import TrainableModel
from tests.support.data import load_example

pytestmark = pytest.mark.engine


@pytest.mark.nightly  # tests/unit/test_autorl.py runs the same pipeline on a scripted server
async def test_the_example_cpu_smoke_trains_on_the_embedded_model(backend, smollm2_path, tmp_path):
    """The real thing, smallest setting: SmolLM2 writes the scenarios and prompts, answers,
    judges itself (yesno from logprobs) and takes one GRPO step."""
    example = load_example("autorl")
    lines: list[str] = []
    result = await example.run(example.CPU_SMOKE, model=TrainableModel(
        name="ex-autorl", project="examples"), backend=backend, print_fn=lines.append)
    assert result.after.step == result.before.step + example.CPU_SMOKE.steps
    assert result.train_scenarios >= 2 and result.held_out_scenarios == 2
    assert "RULER score (mean)" in result.table and "example " in result.table
    assert any(line.startswith("RULER rubric") for line in lines)
