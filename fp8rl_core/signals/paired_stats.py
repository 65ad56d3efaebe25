"""Paired comparisons of two settings: across seeds and per evaluation problem.

Two cells of a sweep (say FP8 with standard clipping and BF16) run on the same seeds; the
question is whether their accuracy differs by more than seed-to-seed noise.

* :func:`bootstrap_mean_ci` — percentile bootstrap interval of the mean of the per-seed
  differences (resampling seeds with replacement, a seeded generator: reproducible).
* :func:`sign_flip_p` — the exact two-sided sign-flip (permutation) test of "mean difference
  = 0": under the null each difference is as likely positive as negative, so all ``2^n``
  sign patterns are equally likely; the p-value is the share whose ``|mean|`` reaches the
  observed one. With 7 seeds the smallest attainable p is 2/128 = 0.016.
* :func:`mcnemar_exact_p` — per problem: over pairs (seed, step, problem) judged in both
  cells, ``b`` = right in A only, ``c`` = right in B only; under the null the discordant
  pairs split 1:1, and the two-sided p-value is the exact binomial one. Pairs from one
  seed share a policy, so they are not independent: read this p-value as a lower bound.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np

__all__ = ["bootstrap_mean_ci", "mcnemar_exact_p", "sign_flip_p"]


def bootstrap_mean_ci(
    diffs: Sequence[float], *, level: float = 0.95, draws: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(diffs)`` (NaN, NaN for fewer than 2 values)."""
    x = np.asarray(diffs, dtype=np.float64)
    if x.size < 2:
        return math.nan, math.nan
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(draws, x.size))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def sign_flip_p(diffs: Sequence[float], *, max_exact: int = 20) -> float:
    """Exact two-sided sign-flip p-value of ``mean(diffs) = 0`` (all ``2^n`` patterns; n <= ``max_exact``)."""
    x = np.asarray(diffs, dtype=np.float64)
    n = x.size
    if n == 0:
        return math.nan
    if n > max_exact:
        raise ValueError(f"sign_flip_p enumerates 2^n patterns; n = {n} > {max_exact}")
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))  # [2^n, n]
    stats = np.abs(signs @ x)
    observed = abs(float(x.sum()))
    return float(np.mean(stats >= observed - 1e-12 * max(1.0, observed)))


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: ``min(1, 2 P[Binomial(b + c, 1/2) <= min(b, c)])``."""
    if b < 0 or c < 0:
        raise ValueError(f"counts must be >= 0, got {b}, {c}")
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / (1 << n)  # exact integers: no overflow at large n
    return min(1.0, 2.0 * tail)
