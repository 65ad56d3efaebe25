"""avg@k, unbiased pass@k and maj@k against hand-computed values and brute force."""

from __future__ import annotations

import itertools
import math

import pytest

from fp8rl_core.signals.eval_metrics import avg_at_k, maj_at_k, majority_answer, pass_at_k, pass_at_k_single


def test_avg_at_k():
    assert avg_at_k([[True, False], [True, True, True, False]]) == pytest.approx((0.5 + 0.75) / 2)


@pytest.mark.parametrize("n, c, k", [(5, 0, 1), (5, 1, 1), (5, 2, 3), (10, 3, 4), (8, 8, 2), (8, 6, 3), (16, 1, 16)])
def test_pass_at_k_equals_combinatorial_and_brute_force(n, c, k):
    formula = 1 - math.comb(n - c, k) / math.comb(n, k)
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k_single(n, c, k) == pytest.approx(formula, abs=1e-12)
    assert pass_at_k_single(n, c, k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_1_is_mean_correctness():
    data = [[True, False, False, False], [True, True, False, False]]
    assert pass_at_k(data, 1) == pytest.approx(avg_at_k(data))
    assert pass_at_k(data, 4) == 1.0


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k([[True, False]], 3)
    with pytest.raises(ValueError, match="no samples"):
        pass_at_k([[]], 1)


def test_majority_answer_ties_and_none():
    assert majority_answer(["3", "4", "4", None, None, None]) == "4"  # None does not vote
    assert majority_answer(["3", "4"]) == "3"  # tie: first seen
    assert majority_answer([None, None]) is None


def test_maj_at_k():
    answers = [["5", "5", "6"], ["1", "2", "2"], [None, None, None], ["7", None, None]]
    correct = [[True, True, False], [True, False, False], [False, False, False], [True, False, False]]
    # problem 1: vote 5 (correct); 2: vote 2 (wrong); 3: no vote; 4: vote 7 (correct)
    assert maj_at_k(answers, correct) == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="answers"):
        maj_at_k([["1"]], [[True, False]])
