"""Scores of a variant's task answers, each with its count and a 95% interval, and its agreement with
the reference model's answers: a difference inside its interval is reported as noise, not a loss.

Proportions (right answers, agreement) get Wilson score intervals; means (ROUGE-L) and paired
differences (variant minus reference, item by item) get percentile bootstrap intervals.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

Z_95 = 1.959963984540054
BOOTSTRAP_RESAMPLES = 2000
_PUNCTUATION = re.compile(f"[{re.escape(string.punctuation)}]")


@dataclass(frozen=True)
class Score:
    value: float
    count: int
    low: float
    high: float
    interval: str  # how low..high was found: "wilson" or "bootstrap"

    def record(self) -> dict:
        return asdict(self)


def normalize(text: str) -> str:
    """Lower case, punctuation as spaces, single spaces: "The capital is Paris." -> "the capital is paris"."""
    return " ".join(_PUNCTUATION.sub(" ", text.lower()).split())


def contains_answer(reply: str, answers: Sequence[str]) -> bool:
    """Whether the reply names one of the answers as whole words ("12" is not found in "112")."""
    said = f" {normalize(reply)} "
    return any(f" {normalize(answer)} " in said for answer in answers if normalize(answer))


def exact_answer(reply: str, answers: Sequence[str]) -> bool:
    return normalize(reply) in {normalize(answer) for answer in answers}


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (rouge-score, with its stemmer): 1 for equal texts, 0 for no common word."""
    from rouge_score.rouge_scorer import RougeScorer

    if not prediction.strip() and not reference.strip():
        return 1.0
    return RougeScorer(["rougeL"], use_stemmer=True).score(reference, prediction)["rougeL"].fmeasure


def wilson(successes: int, count: int, z: float = Z_95) -> Score:
    """A share with its Wilson score interval (sound near 0 and 1 and for small counts, where the
    normal approximation's interval leaves [0, 1])."""
    if count == 0:
        return Score(math.nan, 0, math.nan, math.nan, "wilson")
    share = successes / count
    denominator = 1 + z * z / count
    centre = (share + z * z / (2 * count)) / denominator
    half = z * math.sqrt(share * (1 - share) / count + z * z / (4 * count * count)) / denominator
    # At 0 or 1 the bounds meet the share only up to rounding: hold them to it exactly.
    return Score(share, count, min(share, max(0.0, centre - half)), max(share, min(1.0, centre + half)), "wilson")


def share(flags: Sequence[bool]) -> Score:
    return wilson(int(sum(bool(flag) for flag in flags)), len(flags))


def bootstrap_mean(values: Sequence[float], seed: int = 0) -> Score:
    """The mean with a percentile bootstrap interval (a fixed seed: the same answers, the same interval)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return Score(math.nan, 0, math.nan, math.nan, "bootstrap")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(BOOTSTRAP_RESAMPLES, values.size))].mean(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    return Score(float(values.mean()), int(values.size), float(low), float(high), "bootstrap")


@dataclass(frozen=True)
class Difference:
    """Variant minus reference over the same items, with its interval; `noise` when it holds 0."""

    score: Score

    @property
    def noise(self) -> bool:
        return self.score.low <= 0 <= self.score.high

    def record(self) -> dict:
        return self.score.record() | {"within_noise": self.noise}


def paired_difference(variant: Sequence[float], reference: Sequence[float]) -> Difference:
    if len(variant) != len(reference):
        raise ValueError(f"{len(variant)} variant items against {len(reference)} reference items; pair the same items")
    return Difference(bootstrap_mean(np.asarray(variant, float) - np.asarray(reference, float)))
