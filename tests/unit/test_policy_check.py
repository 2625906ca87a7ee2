"""The served-policy check's logic (art_core/inference/policy_check.py, Gateway.publish) with
an engine stand-in that answers chosen prompt logprobs: within the tolerance the step is
published; beyond it the publish fails, the previous step keeps serving (re-merged when the
merge had replaced it), the step is forgotten and /health says degraded until a later step
passes. The trainer's manifest comes from the real trainer on the tiny model. The real engine
(an adapter that matches nothing, a corrupted adapter): tests/engine/test_policy_check.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_core import EngineConfig, LoraConfig, TrainConfig
from art_core.inference.gateway import Gateway
from art_core.inference.policy_check import PolicyMismatch, check_served, compare, tolerance_for
from art_core.train.probe import NEXT_PROMPT_LEN, PROBE_FILE, write_probe

IDS = [5, 6, 7, 8, 9]
TRAINED = [-1.0, -2.0, -0.5, -3.0]
BASE = [-1.5, -2.5, -1.0, -2.0]
LONG, NEXT = IDS * 3, [(7, -0.25), (3, -2.0)]


class ProbeEngine:
    """Answers each adapter name's prompt logprobs from `answers` (TRAINED + a shift)."""

    def __init__(self, serve_merged: bool = False, dtype: str = "float32") -> None:
        self.served_name, self.config, self.state = "base", EngineConfig(), "ready"
        self.dtype = dtype
        self.adapters: dict[str, str] = {}
        self.serve_merged, self.merged = serve_merged, None
        self.shift: dict[str, float] = {}
        self.next_shift = 0.0
        self.loads: list[tuple[str, bool]] = []
        self.unloads: list[str] = []

    def load_adapter(self, name: str, path: Path, *, latest: bool = False) -> None:
        self.loads.append((name, latest))
        self.adapters[name] = str(path)
        if self.serve_merged and latest:
            self.merged = name

    def unload_adapter(self, name: str) -> None:
        self.unloads.append(name)
        self.adapters.pop(name, None)

    def prompt_logprobs(self, name: str | None, token_ids: list[int]) -> list[float] | None:
        assert token_ids == IDS
        if name is None:  # the base by name
            return [x + self.shift.get("base", 0.0) for x in BASE]
        return [x + self.shift.get(name, 0.0) for x in TRAINED]

    def next_logprobs(self, name: str | None, token_ids: list[int]) -> dict[int, float]:
        assert token_ids == LONG
        return {7: -0.25 + self.next_shift, 3: -2.0 + self.next_shift, 9: -6.0}

    def served_adapters(self, timeout: float = 2.0) -> set[str]:
        return set(self.adapters)


def checkpoint(root: Path, step: int, probe: bool = True, full: bool = False) -> Path:
    path = root / f"{step:04d}"
    path.mkdir(parents=True)
    if probe and full:
        write_probe(path, IDS, TRAINED, base_logprobs=BASE, next_ids=LONG, next_=NEXT)
    elif probe:
        write_probe(path, IDS, TRAINED)
    return path


@pytest.mark.parametrize(("what", "shift", "ok"), [
    ("next", 0.0, True), ("next", 0.2, True), ("next", 0.5, False), ("next", -0.5, False),
    ("next", float("nan"), False), ("base", 0.0, True), ("base", 0.5, False),
    ("base", float("nan"), False)])
def test_the_next_token_and_the_base_parts(tmp_path, what, shift, ok):
    """The next token (through the prefix cache) within 3x the tolerance; the base by name
    against the probe's base logprobs."""
    engine, path = ProbeEngine(), checkpoint(tmp_path, 1, full=True)
    if what == "next":
        engine.next_shift = shift
        run = lambda: check_served(engine, "m@1", path, tolerance=0.1)  # noqa: E731
        error = "what vLLM generates does not match.*prefix-cache blocks"
    else:
        engine.shift["base"] = shift
        run = lambda: check_served(engine, "base", path, tolerance=0.1, base=True)  # noqa: E731
        error = "base: what vLLM serves does not match"
    if ok:
        metrics = run()
        assert metrics["policy_checked"] == 1.0
        if what == "next":
            assert metrics["policy_check_next_abs"] == pytest.approx(abs(shift))
        else:
            assert "policy_check_next_abs" not in metrics  # the base has no next-token part
    else:
        with pytest.raises(PolicyMismatch, match=error):
            run()


def test_a_next_token_the_engine_does_not_rank_counts_at_its_lowest_listed():
    from art_core.inference.policy_check import compare_next

    assert compare_next([(1, -0.5), (2, -1.0)], {1: -0.5, 2: -1.5}) == pytest.approx(0.25)
    assert compare_next([(1, -0.5), (2, -1.0)], {1: -0.5, 5: -3.0}) == pytest.approx(1.0)


def test_a_probe_without_the_base_part_leaves_the_base_unchecked(tmp_path):
    engine = ProbeEngine()
    engine.shift["base"] = 5.0
    assert check_served(engine, "base", checkpoint(tmp_path, 1), 0.1, base=True) == \
        {"policy_checked": 0.0}


@pytest.mark.parametrize(("shift", "ok"), [(0.0, True), (0.05, True), (0.3, False),
                                           (-0.3, False), (float("nan"), False)])
def test_check_served_within_and_beyond_the_tolerance(tmp_path, shift, ok):
    engine = ProbeEngine()
    engine.shift["m@1"] = shift
    path = checkpoint(tmp_path, 1)
    if ok:
        metrics = check_served(engine, "m@1", path, tolerance=0.1)
        assert metrics["policy_checked"] == 1.0
        assert metrics["policy_check_mean_abs"] == pytest.approx(abs(shift))
    else:
        with pytest.raises(PolicyMismatch, match=r"m@1: what vLLM serves does not match") as e:
            check_served(engine, "m@1", path, tolerance=0.1)
        assert e.value.metrics["policy_check_mean_abs"] == pytest.approx(abs(shift),
                                                                         nan_ok=True)


@pytest.mark.parametrize(("setting", "served", "tolerance"), [
    ("auto", "float32", 0.1),  # float32 numerics differ by ~1e-5
    ("auto", "bfloat16", 0.2),  # bf16 on both sides: SmolLM2 merged differs by 0.04-0.105
    ("auto", "float16", 0.2),
    ("auto", "auto", 0.2),  # vLLM's pick on CUDA: bf16
    (0.05, "bfloat16", 0.05),  # a number is taken as it is
    (None, "float32", None),  # no check
])
def test_the_tolerance_follows_the_served_dtype(setting, served, tolerance):
    assert EngineConfig(policy_check_tolerance=setting).policy_check_tolerance == setting
    assert tolerance_for(setting, served) == tolerance


@pytest.mark.parametrize("bad", [0, -0.1, "high"])
def test_a_tolerance_that_is_not_positive_or_auto_is_refused(bad):
    with pytest.raises(ValueError, match="policy_check_tolerance"):
        EngineConfig(policy_check_tolerance=bad)


@pytest.mark.parametrize(("dtype", "shift", "published"), [
    ("float32", 0.15, False),  # beyond float32's 0.1
    ("bfloat16", 0.15, True),  # within bf16's 0.2
    ("bfloat16", 0.25, False),
])
async def test_publish_resolves_auto_by_the_dtype_the_engine_serves(tmp_path, dtype, shift,
                                                                    published):
    gw, engine = Gateway(), ProbeEngine(dtype=dtype)
    gw.add_engine(engine)  # type: ignore[arg-type]
    engine.shift["m@0"] = shift
    publish = gw.publish("m", engine, 0, checkpoint(tmp_path, 0),  # type: ignore[arg-type]
                         tolerance="auto")
    if published:
        assert (await publish)["policy_checked"] == 1.0
    else:
        with pytest.raises(PolicyMismatch):
            await publish
    assert gw.models["m"].policy_tolerance == tolerance_for("auto", dtype)


def test_no_manifest_or_no_scoring_is_not_checked(tmp_path):
    engine = ProbeEngine()
    assert check_served(engine, "m@1", checkpoint(tmp_path, 1, probe=False), 0.1) == \
        {"policy_checked": 0.0}
    engine.prompt_logprobs = lambda name, ids: None  # type: ignore[method-assign]
    assert check_served(engine, "m@2", checkpoint(tmp_path, 2), 0.1) == {"policy_checked": 0.0}
    with pytest.raises(ValueError, match="the probe has 4 logprobs, the engine gave 3"):
        compare(TRAINED, TRAINED[:3])


@pytest.mark.parametrize("merged", [False, True], ids=["lora", "merged"])
async def test_a_mismatched_step_is_not_published_and_the_previous_keeps_serving(tmp_path,
                                                                               merged):
    gw, engine = Gateway(), ProbeEngine(serve_merged=merged)
    gw.add_engine(engine)  # type: ignore[arg-type]
    await gw.publish("m", engine, 0, checkpoint(tmp_path, 0))  # type: ignore[arg-type]
    metrics = await gw.publish("m", engine, 1, checkpoint(tmp_path, 1))  # type: ignore[arg-type]
    assert metrics["policy_checked"] == 1.0 and gw.models["m"].latest == 1

    engine.shift["m@2"] = 0.5  # vLLM serves something else under m@2
    with pytest.raises(PolicyMismatch):
        await gw.publish("m", engine, 2, checkpoint(tmp_path, 2))  # type: ignore[arg-type]
    served = gw.models["m"]
    assert served.latest == 1 and 2 not in served.checkpoints
    assert "m@2" in engine.unloads and "m@2" not in engine.adapters
    if merged:  # the merge had replaced step 1's weights: step 1 is merged again
        assert engine.loads[-1] == ("m@1", True) and engine.merged == "m@1"
    health = await gw.health()
    assert health["status"] == "degraded" and "m@2" in health["policy_mismatch"]["m"]

    await gw.publish("m", engine, 3, checkpoint(tmp_path, 3))  # type: ignore[arg-type]
    assert gw.models["m"].latest == 3 and (await gw.health())["status"] == "ok"


def test_the_trainer_writes_its_probe_with_the_checkpoint(tiny_models, tmp_path):
    from art_core.train.trainer import Trainer
    from tests.support.data import make_group

    trainer = Trainer(str(tiny_models["llama"]), LoraConfig(rank=4), device="cpu")
    (tmp_path / "a").mkdir()
    trainer.save_probe(tmp_path / "a")
    before = json.loads((tmp_path / "a" / PROBE_FILE).read_text())
    assert len(before["logprobs"]) == len(before["token_ids"]) - 1 > 10
    assert all(x < 0 for x in before["logprobs"])
    assert before["base_logprobs"] == pytest.approx(before["logprobs"])  # B = 0 at the start
    assert len(before["next"]["token_ids"]) == NEXT_PROMPT_LEN > 256  # two KV blocks and more
    top = before["next"]["top"]
    assert len(top) == 5 and all(b[1] <= a[1] < 0 for a, b in zip(top, top[1:], strict=False))

    trainer.step([make_group(trainer.tokenizer)], TrainConfig(learning_rate=5e-2, bf16=False))
    trainer.step([make_group(trainer.tokenizer)], TrainConfig(learning_rate=5e-2, bf16=False))
    (tmp_path / "b").mkdir()
    trainer.model.train()
    trainer.save_probe(tmp_path / "b")
    after = json.loads((tmp_path / "b" / PROBE_FILE).read_text())
    assert after["token_ids"] == before["token_ids"]
    mean, _ = compare(before["logprobs"], after["logprobs"])
    assert mean > 0  # a trained adapter says something else about the same tokens
    assert after["base_logprobs"] == pytest.approx(before["base_logprobs"], abs=1e-6)
    assert after["next"]["top"] != before["next"]["top"]
    assert trainer.model.training  # the probe leaves the model as it found it


async def test_a_check_that_cannot_ask_vllm_does_not_block_the_publish(tmp_path, caplog):
    from art_core.inference.engine import EngineError

    gw, engine = Gateway(), ProbeEngine()
    gw.add_engine(engine)  # type: ignore[arg-type]
    await gw.publish("m", engine, 0, checkpoint(tmp_path, 0))  # type: ignore[arg-type]

    def down(name: str, ids: list[int]) -> list[float]:
        raise EngineError("vLLM /v1/completions did not answer: ConnectError")

    engine.prompt_logprobs = down  # type: ignore[method-assign]
    metrics = await gw.publish("m", engine, 1, checkpoint(tmp_path, 1))  # type: ignore[arg-type]
    assert metrics == {"policy_checked": 0.0} and gw.models["m"].latest == 1
    assert "could not run" in caplog.text
