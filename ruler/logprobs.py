"""Scores read from the judge's token probabilities instead of from text it writes.

The judge generates one token; the endpoint returns the top-k alternatives for it with their
logprobs (`logprobs=True, top_logprobs=20`). A rating is the probability mass on a fixed set of
label tokens ("Yes"/"No", the digits 0-9, "A"/"B"), summed over spellings (" Yes", "yes", "YES"
are different tokens with the same meaning). Nothing is parsed from free text, so the answer can
never be malformed; it can only put little mass on the labels, which `rating_mass` reports.

A label missing from the top-k list has a probability of at most the smallest listed one. For
two-label ratings that bound is used as its probability, so that "Yes at 0.95, No unlisted" and
"Yes at 0.60, No unlisted" stay ordered instead of both becoming 1.0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

YES_NO = {"yes": "yes", "no": "no"}
DIGITS = {str(d): str(d) for d in range(10)}
A_B = {"a": "a", "b": "b"}


class NoLogprobs(ValueError):
    """The response carries no top logprobs for the generated token."""


class NoRatingToken(ValueError):
    """None of the label tokens is among the judge's top candidates."""


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def first_token_candidates(response: Any) -> list[tuple[str, float]]:
    """(token, logprob) of every top candidate for the first generated token of `response`.

    Raises `NoLogprobs` when the server returned no logprobs or no top_logprobs (servers that do
    not support them either reject the parameter or silently leave the field out).
    """
    choices = _get(response, "choices") or []
    logprobs = _get(choices[0], "logprobs") if choices else None
    content = _get(logprobs, "content") if logprobs is not None else None
    if not content:
        raise NoLogprobs("the response has no logprobs")
    top = _get(content[0], "top_logprobs") or []
    candidates = [(str(_get(t, "token")), float(_get(t, "logprob"))) for t in top]
    if not candidates:
        raise NoLogprobs("the response has logprobs but no top_logprobs")
    return candidates


def _normalize(token: str) -> str:
    return token.strip().strip(".,:;!?\"'*()").lower()


def label_probabilities(
    candidates: Sequence[tuple[str, float]], labels: Mapping[str, str]
) -> dict[str, float]:
    """Probability of each label (by `labels[normalized token]`), summed over its spellings."""
    mass: dict[str, float] = {}
    for token, logprob in candidates:
        label = labels.get(_normalize(token))
        if label is not None and math.isfinite(logprob):
            mass[label] = mass.get(label, 0.0) + math.exp(logprob)
    return mass


def _require_labels(
    mass: Mapping[str, float], candidates: Sequence[tuple[str, float]], what: str
) -> None:
    if not mass:
        seen = [t for t, _ in candidates][:10]
        raise NoRatingToken(
            f"none of the rating tokens ({what}) is among the judge's top {len(candidates)} "
            f"candidates {seen}"
        )


def two_label_score(
    candidates: Sequence[tuple[str, float]], labels: Mapping[str, str], positive: str, what: str
) -> tuple[float, float]:
    """P(positive) / (P(positive) + P(other)) in [0, 1], and the mass on both labels.

    A label absent from the candidates gets the smallest listed probability (its upper bound).
    """
    mass = label_probabilities(candidates, labels)
    _require_labels(mass, candidates, what)
    floor = min(math.exp(lp) for _, lp in candidates)
    negative = next(v for v in set(labels.values()) if v != positive)
    p, q = mass.get(positive, floor), mass.get(negative, floor)
    return p / (p + q), sum(mass.values())


def yes_probability(candidates: Sequence[tuple[str, float]]) -> tuple[float, float]:
    """P(Yes) / (P(Yes) + P(No)), and the mass on Yes and No."""
    return two_label_score(candidates, YES_NO, "yes", "Yes/No")


def a_preference(candidates: Sequence[tuple[str, float]]) -> tuple[float, float]:
    """P(A) / (P(A) + P(B)): how much the judge prefers answer A, and the mass on A and B."""
    return two_label_score(candidates, A_B, "a", "A/B")


def expected_digit(candidates: Sequence[tuple[str, float]]) -> tuple[float, float]:
    """The expected rating over the listed digits 0-9 (renormalized), and their total mass."""
    mass = label_probabilities(candidates, DIGITS)
    _require_labels(mass, candidates, "0-9")
    total = sum(mass.values())
    return sum(int(d) * p for d, p in mass.items()) / total, total
