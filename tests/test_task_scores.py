"""Task scoring: each metric on a hand-computed example, and intervals that hold what they should."""

from __future__ import annotations

import math

import pytest

from tasks.evaluation import task_scores as scores


def test_normalize_drops_case_punctuation_and_extra_spaces():
    assert scores.normalize("  The capital is  PARIS. ") == "the capital is paris"


@pytest.mark.parametrize(
    ("reply", "answers", "right"),
    [
        ("The capital of France is Paris.", ["Paris"], True),
        ("It is twelve.", ["12", "twelve"], True),
        ("The answer is 112.", ["12"], False),  # whole words: 12 is not found in 112
        ("Romania", ["Rome"], False),
        ("George Orwell wrote it.", ["Orwell"], True),
        ("I do not know.", ["Paris"], False),
    ],
)
def test_contains_answer_matches_whole_words_ignoring_case(reply, answers, right):
    assert scores.contains_answer(reply, answers) is right


def test_exact_answer_needs_the_whole_reply():
    assert scores.exact_answer("Paris.", ["paris"])
    assert not scores.exact_answer("Paris, of course", ["Paris"])


def test_rouge_l_hand_computed():
    # Longest common subsequence "the cat on the mat": 5 of 6 words each way, so F1 = 5/6.
    assert scores.rouge_l("the cat lay on the mat", "the cat sat on the mat") == pytest.approx(5 / 6)
    assert scores.rouge_l("same words here", "same words here") == pytest.approx(1.0)
    assert scores.rouge_l("nothing alike", "entirely different") == 0.0


def test_wilson_interval_hand_computed():
    score = scores.wilson(8, 10)  # the textbook example: 8 of 10, 95%
    assert score.value == 0.8 and score.count == 10
    assert (score.low, score.high) == (pytest.approx(0.4902, abs=1e-4), pytest.approx(0.9433, abs=1e-4))


def test_wilson_interval_stays_inside_zero_and_one():
    for successes in (0, 10):
        score = scores.wilson(successes, 10)
        assert 0.0 <= score.low <= score.value <= score.high <= 1.0
    assert scores.wilson(0, 10).low == 0.0 and scores.wilson(10, 10).high == 1.0
    assert math.isnan(scores.wilson(0, 0).value)


def test_bootstrap_interval_is_reproducible_and_holds_the_mean():
    values = [0.1, 0.9, 0.4, 0.7, 0.3, 0.8, 0.2, 0.6]
    first, second = scores.bootstrap_mean(values), scores.bootstrap_mean(values)
    assert first == second
    assert first.value == pytest.approx(0.5) and first.low < first.value < first.high
    constant = scores.bootstrap_mean([0.5] * 20)
    assert constant.low == constant.high == pytest.approx(0.5)


def test_paired_difference_calls_a_small_difference_noise_and_a_large_one_not():
    reference = [1.0, 0.0] * 20
    assert scores.paired_difference(reference, reference).noise
    one_flip = [0.0] + reference[1:]
    assert scores.paired_difference(one_flip, reference).noise
    all_lost = [0.0] * 40
    lost = scores.paired_difference(all_lost, reference)
    assert not lost.noise and lost.score.high < 0
    with pytest.raises(ValueError, match="pair the same items"):
        scores.paired_difference([1.0], [1.0, 0.0])
