"""Paired comparisons (fp8rl_core.signals.paired_stats) against slow references and known values."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from fp8rl_core.signals.paired_stats import bootstrap_mean_ci, mcnemar_exact_p, sign_flip_p


def slow_sign_flip(x):
    """Every sign pattern by recursion, counted one by one."""
    obs, hits, total = abs(sum(x)), 0, 0

    def walk(i, acc):
        nonlocal hits, total
        if i == len(x):
            total += 1
            hits += abs(acc) >= obs - 1e-12
            return
        walk(i + 1, acc + x[i])
        walk(i + 1, acc - x[i])

    walk(0, 0.0)
    return hits / total


def test_sign_flip_matches_the_slow_reference_and_known_values():
    rng = random.Random(1)
    for _ in range(30):
        x = [rng.gauss(0.3, 1.0) for _ in range(rng.randint(1, 9))]
        assert sign_flip_p(x) == pytest.approx(slow_sign_flip(x), abs=1e-12)
    assert sign_flip_p([1.0] * 7) == pytest.approx(2 / 128)  # all one sign: the two extreme patterns
    assert sign_flip_p([1.0, -1.0]) == 1.0
    assert math.isnan(sign_flip_p([]))
    with pytest.raises(ValueError, match="2\\^n"):
        sign_flip_p([1.0] * 21)


def test_sign_flip_is_calibrated_under_the_null():
    """Under a symmetric null the rejection rate at 0.05 is at most 0.05 (plus Monte Carlo noise)."""
    rng = np.random.default_rng(4)
    rejections = np.mean([sign_flip_p(rng.normal(0, 1, 7)) <= 0.05 for _ in range(2000)])
    assert rejections <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 2000)
    shifted = np.mean([sign_flip_p(rng.normal(2.0, 1, 7)) <= 0.05 for _ in range(500)])
    assert shifted > 0.9  # and it has power where the effect is large


def test_bootstrap_interval_covers_the_mean_at_about_its_level():
    rng = np.random.default_rng(2)
    cover = 0
    for i in range(400):
        x = rng.normal(1.0, 2.0, 30)
        lo, hi = bootstrap_mean_ci(x, level=0.9, draws=2000, seed=i)
        assert lo <= float(np.mean(x)) <= hi
        cover += lo <= 1.0 <= hi
    assert 0.82 <= cover / 400 <= 0.95  # percentile bootstrap of n = 30: slightly under nominal
    assert bootstrap_mean_ci([1.0, 2.0], seed=3) == bootstrap_mean_ci([1.0, 2.0], seed=3)  # reproducible
    assert all(math.isnan(v) for v in bootstrap_mean_ci([1.0]))


def test_mcnemar_exact_against_the_binomial_by_hand():
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(5, 5) == 1.0
    assert mcnemar_exact_p(0, 6) == pytest.approx(2 / 64)
    assert mcnemar_exact_p(2, 10) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert mcnemar_exact_p(10, 2) == mcnemar_exact_p(2, 10)
    assert mcnemar_exact_p(600, 600) == 1.0 and 0 < mcnemar_exact_p(500, 640) < 1e-4  # thousands of pairs
    with pytest.raises(ValueError):
        mcnemar_exact_p(-1, 2)
