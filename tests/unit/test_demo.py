"""The brevity demo's reward (its loop is art_core.loop, tests/unit/test_loop.py)."""

from __future__ import annotations

import pytest

from art_core.demos.brevity import brevity_reward


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
