"""The demo's parts that need no engine: its reward and the eval log that spans resumed runs."""

from __future__ import annotations

import pytest

from art_core.demos.brevity import EvalLog, brevity_reward


@pytest.mark.parametrize(("text", "expected"), [
    ("Music is art.", 1 - 3 / 40),
    ("Gravity is a force that pulls objects together!", 1 - 8 / 40),
    ("  Is the sky blue?  ", 1 - 4 / 40),
    (" ".join(["word"] * 60) + ".", 0.0),   # 40 words or more: nothing left to gain
    ("", 0.0),                              # empty
    ("Sleep.", 0.0),                        # a lone word
    ("Rain falls.", 0.0),                   # two words
    ("The ocean is a vast body of", 0.0),   # cut off mid-sentence
])
def test_brevity_reward(text: str, expected: float) -> None:
    assert brevity_reward(text) == pytest.approx(expected)


def test_shorter_sentence_scores_higher() -> None:
    assert brevity_reward("Music is art.") > brevity_reward("Music is a form of art.")


def test_eval_log_survives_a_resume_and_skips_torn_lines(tmp_path) -> None:
    path = tmp_path / "eval.jsonl"
    first = EvalLog(path)
    assert first.curve == {}
    first.add(0, 0.1)
    first.add(1, 0.4)
    with path.open("a") as f:
        f.write('{"step": 2, "eval_rew')  # a run killed mid-write
    resumed = EvalLog(path)
    assert resumed.curve == {0: 0.1, 1: 0.4}
    resumed.add(1, 0.5)  # a step evaluated again: the newest value wins
    assert EvalLog(path).curve == {0: 0.1, 1: 0.5}

