"""Subsampled BF16 shadow passes with a stated error on the calibrated lower bound.

The shadow passes are the cost of Calibrated Clipping: two BF16 forwards over
the whole batch. Here they run on a uniform random subset of m of the batch's
N sequences (sampling without replacement), and the calibration uses the
subset's tokens. The FP8 ratios r8 are known for *every* token (they come from
the training forward), so the error of the subset's L can be stated against
the full batch's r8 distribution.

Sampling unit. Tokens of one sequence are correlated (one prompt, one policy
state, one advantage), so tokens are not independent draws; sequences are.
Every bound below treats the sequence as the unit: per sequence s, n_s = its
A<0 tokens (known for every sequence without a shadow pass: advantages and the
mask are), y_s(x) = those with ratio < x. Only the N- sequences with n_s > 0
count (advantages are per sequence, so that is every A<0 sequence); a subset
holds m- of them, and m, N below are those counts. A token-weighted share over the
subset, F_S(x) = sum_S y_s(x) / sum_S n_s, differs from the full batch's F(x)
by sum_S z_s / sum_S n_s with z_s = y_s(x) - F(x) n_s, which has population
mean 0 and range b = max_s n_s. Hoeffding's bound for sampling without
replacement with Serfling's finite-population factor gives, at one x,

    P(|F_S(x) - F(x)| >= eps) <= delta,
    eps_point(m, delta) = b / nbar_S * sqrt((1 - (m - 1) / N) * ln(2 / delta) / (2 m))

(nbar_S = mean n_s over the subset; m = N gives 0). No independence of tokens
is assumed: within-sequence correlation is absorbed in b.

Stated error (quantile levels). The subset's alpha = F16_S(1 - eps_low) is
one point (``eps_point``). Its L is the alpha-quantile of the subset's r8,
where the subset CDF F8_S must be close to F8 *uniformly*: a union bound over a
grid of G = ``GRID`` level points plus the grid spacing gives
``eps_sup = eps_point(m, delta / (2 G)) + 1 / G``. With probability at least
1 - delta (delta/2 each), F8(L_S) lies within
``E = eps_point(m, delta / 2) + eps_sup + 1 / n_S`` (the last term: the
quantile rule's rounding on the subset) of the full batch's alpha, so L_S and
the full batch's L both lie in ``[Q8(alpha_S - E), Q8(alpha_S + E)]`` (Q8: the
full batch's FP8 quantile rule), whose width is the stated bound on
``|L_S - L_full|`` in ratio units (``lower_error_bound``).

Subset size (``choose_size``): the smallest m whose E, computed from the n_s of
the whole batch before sampling, is at most the target (in levels), never fewer
than ``min_sequences`` nor more than N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "GRID",
    "BootstrapSpec",
    "bootstrap_lower_error",
    "SubsampleBound",
    "choose_size",
    "eps_point",
    "level_error",
    "lower_error_bound",
    "quantile_rule",
    "sample_sequences",
]

GRID = 50  # level grid of the uniform (DKW-style) bound


def eps_point(m: int, n_total: int, b: float, nbar: float, delta: float) -> float:
    """Hoeffding-Serfling half-width of a token-weighted share at one point (sequences as the unit)."""
    if m >= n_total:
        return 0.0
    if m <= 0 or nbar <= 0:
        return 1.0
    fpc = 1.0 - (m - 1) / n_total
    return min(1.0, b / nbar * math.sqrt(fpc * math.log(2.0 / delta) / (2.0 * m)))


def level_error(m: int, n_total: int, b: float, nbar: float, delta: float, n_tokens: int) -> float:
    """E: the stated error in quantile levels of the subset's L (module docstring)."""
    if m >= n_total:
        return 0.0
    sup = eps_point(m, n_total, b, nbar, delta / (2 * GRID)) + 1.0 / GRID
    return eps_point(m, n_total, b, nbar, delta / 2) + sup + 1.0 / max(n_tokens, 1)


def _units(neg_per_seq: torch.Tensor) -> tuple[int, float, float]:
    """(N-, b, nbar) over the sequences that hold A<0 tokens (the others add nothing to F)."""
    neg = neg_per_seq[neg_per_seq > 0].double()
    if neg.numel() == 0:
        return 0, 0.0, 0.0
    return int(neg.numel()), float(neg.max()), float(neg.mean())


def choose_size(neg_per_seq: torch.Tensor, target: float, delta: float, min_sequences: int = 1) -> int:
    """Smallest m (of N sequences) whose expected level error E <= target.

    ``neg_per_seq``: ``[N]`` A<0 token counts per sequence, known before the
    shadow pass. A uniform subset of m sequences holds about m N-/N of the
    N- sequences with negatives; E is evaluated at that count.
    """
    n = int(neg_per_seq.numel())
    n_neg, b, nbar = _units(neg_per_seq)
    if n == 0 or n_neg == 0:
        return min(n, max(min_sequences, 1))

    def err(m: int) -> float:
        mn = max(1, int(math.floor(m * n_neg / n)))
        return level_error(mn, n_neg, b, nbar, delta, int(round(mn * nbar)))

    lo, hi = max(1, min(min_sequences, n)), n
    while lo < hi:  # E is non-increasing in m
        mid = (lo + hi) // 2
        if err(mid) <= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def sample_sequences(n: int, m: int, generator: torch.Generator) -> torch.Tensor:
    """``[N]`` bool: a uniform random subset of m of n sequences (without replacement)."""
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.randperm(n, generator=generator)[: max(0, min(m, n))]] = True
    return keep


def quantile_rule(sorted_v: torch.Tensor, level: float) -> float:
    """The calibration's quantile rule at share ``level`` of sorted values: k = round(level n);
    v1 if k = 0, (vk + vk+1)/2 if 0 < k < n, vn + 1e-6 if k = n (levels outside [0, 1] clamp)."""
    n = sorted_v.numel()
    k = int(round(min(max(level, 0.0), 1.0) * n))
    if k <= 0:
        return float(sorted_v[0])
    if k >= n:
        return float(sorted_v[-1]) + 1e-6
    return float((sorted_v[k - 1] + sorted_v[k]) / 2)


@dataclass(frozen=True)
class SubsampleBound:
    """What a subsampled calibration states: its size and its error bounds (``bounds`` columns)."""

    sequences: int  # m
    total_sequences: int  # N
    level_error: float  # E, in quantile levels
    lower_error_bound: float  # width of [Q8(alpha - E), Q8(alpha + E)], ratio units
    failure_prob: float  # delta


def lower_error_bound(
    r8_neg_full: torch.Tensor,
    alpha_subset: float,
    *,
    m: int,
    neg_per_seq: torch.Tensor,
    keep: torch.Tensor,
    delta: float,
) -> SubsampleBound:
    """The stated bound on |L_subset - L_full| after a subset calibration.

    ``r8_neg_full``: FP8 ratios of every A<0 token of the batch; ``neg_per_seq``: ``[N]``
    A<0 counts per sequence; ``keep``: ``[N]`` bool, the shadowed sequences.
    """
    n = int(neg_per_seq.numel())
    v = torch.sort(r8_neg_full.reshape(-1).to(torch.float64)).values
    if m >= n or v.numel() == 0:
        return SubsampleBound(m, n, 0.0, 0.0, delta)
    n_neg, b, _ = _units(neg_per_seq)
    sub = neg_per_seq[keep & (neg_per_seq > 0)]
    m_neg = int(sub.numel())
    nbar_s = float(sub.double().mean()) if m_neg else 0.0
    e = level_error(m_neg, n_neg, b, nbar_s, delta, int(sub.sum()))
    a = alpha_subset if math.isfinite(alpha_subset) else 0.0
    width = quantile_rule(v, a + e) - quantile_rule(v, a - e)
    return SubsampleBound(m, n, e, width, delta)


@dataclass(frozen=True)
class BootstrapSpec:
    """What :func:`bootstrap_lower_error` states its error for: a subset of ``m`` of ``n_total`` sequences."""

    threshold: float  # 1 - eps_low: BF16's lower bound
    delta: float  # failure probability: the bound is the (1 - delta) quantile
    m: int  # sequences in the subset (m = n_total gives 0)
    n_total: int  # sequences of the batch
    resamples: int = 200


def bootstrap_lower_error(
    r8_neg: torch.Tensor,
    r16_neg: torch.Tensor,
    seq_neg: torch.Tensor,
    spec: BootstrapSpec,
    *,
    generator: torch.Generator | None = None,
) -> float:
    """Bootstrap over the subset's sequences: the (1 - delta) quantile of |L* - L_S|.

    ``r8_neg, r16_neg``: the subset's A<0 tokens' ratios; ``seq_neg``: their
    sequence ids. Each resample draws the subset's A<0 sequences with replacement
    (multiplicities w_s), forms alpha* = the w-weighted share of r16 < threshold and
    L* = the w-weighted quantile rule of r8 at alpha*. No finite-population shrinkage
    (it under-covered at m = N/2 in our checks): sampling without replacement makes
    this conservative. Tighter than ``lower_error_bound`` but approximate: its
    coverage is checked empirically (tests/fp8rl_core/calibration/test_subsample.py), not guaranteed.
    """
    threshold, delta, resamples = spec.threshold, spec.delta, spec.resamples
    if r8_neg.numel() == 0 or spec.m >= spec.n_total:
        return 0.0
    _, inv = torch.unique(seq_neg, return_inverse=True)
    k_seq = int(inv.max()) + 1
    order = torch.argsort(r8_neg.double())
    v = r8_neg.double()[order]
    inv_sorted = inv[order]
    below = (r16_neg < threshold).double()

    def rule(w_tok: torch.Tensor) -> torch.Tensor:  # [B, n] token weights in sorted order -> [B] L
        total = w_tok.sum(1)
        alpha = (w_tok * below[order]).sum(1) / total
        k = torch.round(alpha * total)
        cum = torch.cumsum(w_tok, 1)
        ik = torch.searchsorted(cum, k[:, None].clamp_min(1), right=False).squeeze(1).clamp(max=v.numel() - 1)
        ik1 = torch.searchsorted(cum, (k + 1)[:, None], right=False).squeeze(1).clamp(max=v.numel() - 1)
        mid = (v[ik] + v[ik1]) / 2
        return torch.where(k <= 0, v[0], torch.where(k >= total, v[-1] + 1e-6, mid))

    base = rule(torch.ones(1, v.numel(), dtype=torch.float64))[0]
    g = generator or torch.Generator().manual_seed(0)
    draws = torch.randint(0, k_seq, (resamples, k_seq), generator=g)
    w_seq = torch.zeros(resamples, k_seq, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones_like(draws, dtype=torch.float64)
    )
    dev = (rule(w_seq[:, inv_sorted]) - base).abs()
    return float(torch.quantile(dev, 1.0 - delta))
