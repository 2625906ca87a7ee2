"""BFCL end to end on the real engine with a tiny random model: items from BFCL's package,
asked through the gateway with forced strict calls, scored by BFCL's checker in the side
environment (benchmarks/bfcl_eval.py), and a GRPO step on the checker's rewards
(examples/bfcl_rl.py), irrelevance items asked with the choice left to the model. The model is
random: what is checked is the wiring, not accuracy."""

from __future__ import annotations

import json

import pytest

from art_bfcl.checker import BfclWorker, unavailable_reason
from art_bfcl.tasks import CATEGORIES, Prompting
from art_core import TrainableModel, TrajectoryGroup
from tests.support.data import load_benchmark, load_example
from tests.support.engine import tiny_config

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=str(unavailable_reason()))]

MAX_TOKENS = 48  # the shortest items' prompts are 385-663 tokens; the tiny engine holds 1,024


@pytest.fixture(scope="module")
def worker():
    with BfclWorker() as w:
        yield w


@pytest.fixture(scope="module")
def items(worker):
    """The two shortest items of each category (they fit the tiny model's context)."""
    return [i for c in CATEGORIES
            for i in sorted(worker.load(c), key=lambda i: len(json.dumps([i.messages, i.tools])))[:2]]


@pytest.fixture(scope="module")
async def tiny(backend, tiny_models):
    model = TrainableModel(name="bfcl-tiny", project="bfcl", base_model=str(tiny_models["llama"]),
                           config=tiny_config())
    await model.register(backend)
    return model


async def test_evaluation_asks_through_the_gateway_and_bfcl_scores(tiny, worker, items, capsys):
    bench = load_benchmark("bfcl_eval")
    attempts = await bench.run(tiny.openai_client(), tiny.name, items, worker,
                               Prompting(max_tokens=MAX_TOKENS))
    assert [a.item.id for a in attempts] == [i.id for i in items]
    for a in attempts:
        choice = a.response.choices[0]
        # a forced strict call: complete calls of the item's tools, or cut by max_tokens
        names = {t["function"]["name"] for t in a.item.tools}
        assert {c["function"]["name"] for c in a.message["tool_calls"]} <= names
        assert choice.finish_reason == ("tool_calls" if a.message["tool_calls"] else "length")
        assert a.verdict.valid or a.verdict.error_type  # BFCL names every failure
        assert choice.model_extra["token_ids"]  # the gateway recorded what it sampled
    out = capsys.readouterr().out
    for category in (*CATEGORIES, "simple_python+multiple", "all"):
        assert f"\n{category} " in out
    assert "95% interval" in out and f"{len(items)} items in" in out


async def test_a_grpo_step_on_the_checkers_rewards(tiny, worker, items, monkeypatch):
    example = load_example("bfcl_rl")
    monkeypatch.setattr(example, "TRAIN", Prompting(temperature=1.0, max_tokens=MAX_TOKENS))
    irrelevant = min(worker.load("irrelevance"), key=lambda i: len(json.dumps([i.messages,
                                                                                 i.tools])))
    groups = []
    for item in [*items[:2], irrelevant]:
        trajs = [await example.attempt(tiny, worker, example.Task(item, held_out=False),
                                       count_credit=0.5, call_credit=0.25) for _ in range(3)]
        for t in trajs:
            # BFCL's pass, else the count credit for as many calls as the ground truth and the
            # call credit for the share of its calls made right
            assert t.reward == (1.0 if t.metrics["passed"] else 0.5 * t.metrics["right_count"]
                                + 0.25 * t.metrics["right_calls"])
            assert 0 <= t.metrics["right_calls"] <= 1
            if item is irrelevant:  # asked "auto" (a forced call would always fail it)
                assert t.metrics["passed"] is not t.metrics["called"]
                assert t.metrics["right_count"] is not t.metrics["called"]
            else:
                assert t.metrics["called"] or t.reward == 0.0
            assert t.metadata["id"] == item.id and t.metadata["category"] == item.category
            assert t.trainable and t.tools == item.tools
        groups.append(TrajectoryGroup(trajectories=trajs))
    before = await tiny.get_step()
    result = await tiny.train(groups)
    assert result.step == before + 1 == await tiny.get_step()
