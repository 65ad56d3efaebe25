"""Estimators of the calibrated lower bound L (``calibration.estimator``).

The paper's rule (docs/method.md, "Calibrated Clipping", rule 1) sets the raw L from one step's
shadow tokens: with k = the number of A<0 tokens BF16 clips at ``1 - eps_low``
and v1 <= ... <= vn their sorted FP8 ratios, raw L is the midpoint of v_k and
v_k+1. When BF16 clips ~1% of a few hundred tokens, k is a handful and raw L is
mostly sampling noise. The estimators here trade that noise for shadow tokens
or for assumptions; each reports the shadow tokens its estimate rests on.

* ``quantile`` (default): the paper's rule, bit for bit (one step's tokens).
* ``pooled``: the last ``estimator_window`` calibration steps, *aligned by
  quantile level*: the pooled level is ``alpha = sum k_j / sum n_j`` (BF16's
  clip share over the window), each step's own FP8 ratios give that level's
  quantile by the paper's midpoint rule at ``round(alpha n_j)``, and raw L is
  their n_j-weighted mean. Steps are never merged by raw ratio, so a spread that
  moves between steps does not smear the tail.
* ``k_floor``: as ``pooled``, but the window grows backwards from the current
  step only until BF16 clips at least ``estimator_min_clipped`` tokens in it
  (at most ``estimator_window`` steps): one step when k is already large.
* ``harrell_davis``: the Harrell-Davis quantile of the current step's FP8
  ratios at level ``alpha = k / n`` (a Beta-weighted mean of every order
  statistic instead of two), with a ``estimator_ci_level`` confidence interval
  for the FP8 quantile at that level: the interval between the HD quantiles at
  the levels of the distribution-free binomial order-statistic interval (the
  BF16 level alpha is taken as given). k = 0 falls back to the paper's v1.

State. The pooled estimators need the A<0 FP8 ratios and k of earlier
calibration steps: each estimate returns the pool to keep (at most
``estimator_window - 1`` steps, the current one included), which
``CalibratorState`` carries and saves in checkpoints as plain lists of floats
(JSON round-trips a float exactly), so a resumed run pools what the
uninterrupted one would. The other estimators keep an empty pool.

Shadow tokens: ``shadow_tokens`` counts every shadow-passed token (all
advantages) of the steps an estimate used; pooled estimates re-use passes
already run, so the *extra* shadow cost of a run is set by the schedule alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from fp8rl_core.registry import Registry

__all__ = ["LOWER_ESTIMATORS", "LowerEstimate", "PoolEntry", "harrell_davis", "hd_weights", "midpoint_quantile"]


@dataclass(frozen=True)
class PoolEntry:
    """One calibration step remembered by a pooled estimator."""

    k: int  # A<0 tokens BF16 clips at 1 - eps_low
    tokens: int  # shadow-passed tokens of the step (all advantages)
    ratios: tuple[float, ...]  # sorted FP8 ratios of its A<0 tokens

    def to_dict(self) -> dict:
        return {"k": self.k, "tokens": self.tokens, "ratios": list(self.ratios)}

    @classmethod
    def from_dict(cls, d: dict) -> "PoolEntry":
        return cls(int(d["k"]), int(d["tokens"]), tuple(float(x) for x in d["ratios"]))


@dataclass(frozen=True)
class LowerEstimate:
    """Raw L of one calibration, its interval (None where the estimator has none) and its cost."""

    raw_lower: float
    level: float  # quantile level of the FP8 ratios the estimate aims at
    shadow_tokens: int
    pooled_steps: int
    ci_low: float | None = None
    ci_high: float | None = None
    pool: tuple[PoolEntry, ...] = ()


class _Tokens(Protocol):  # what an estimator reads of fp8rl_core.calibration.tokens.CalibrationTokens
    r8n: torch.Tensor
    n_neg: int
    n_tokens: int

    def quantile_lower(self, k: int) -> float: ...


@dataclass(frozen=True)
class EstimatorInput:
    tokens: _Tokens
    k: int  # BF16's clipped count among the current step's A<0 tokens
    pool: tuple[PoolEntry, ...]  # earlier calibration steps, oldest first
    window: int
    min_clipped: int
    ci_level: float


LowerEstimator = Callable[[EstimatorInput], LowerEstimate]
LOWER_ESTIMATORS: Registry[LowerEstimator] = Registry("lower-bound estimator")


def midpoint_quantile(sorted_vals: Sequence[float] | np.ndarray, k: int) -> float:
    """The paper's rule on sorted values (float64, no dtype nudge): v1 if k = 0,
    (v_k + v_k+1)/2 if 0 < k < n, v_n + 1e-6 if k >= n."""
    v = np.asarray(sorted_vals, dtype=np.float64)
    n = len(v)
    if n == 0:
        raise ValueError("midpoint_quantile needs at least one value")
    if k <= 0:
        return float(v[0])
    if k >= n:
        return float(v[-1]) + 1e-6
    return float((v[k - 1] + v[k]) / 2)


@LOWER_ESTIMATORS.register("quantile")
def _quantile(inp: EstimatorInput) -> LowerEstimate:
    """The paper's rule on the current step (the default; numerics unchanged)."""
    tok = inp.tokens
    return LowerEstimate(tok.quantile_lower(inp.k), inp.k / tok.n_neg, tok.n_tokens, 1)


def _entry(inp: EstimatorInput) -> PoolEntry:
    vals = torch.sort(inp.tokens.r8n.to(torch.float64)).values.tolist()
    return PoolEntry(inp.k, inp.tokens.n_tokens, tuple(vals))


def _level_aligned(entries: Sequence[PoolEntry]) -> tuple[float, float]:
    """(pooled level sum k / sum n, n-weighted mean of each step's quantile at that level)."""
    ns = [len(e.ratios) for e in entries]
    level = sum(e.k for e in entries) / sum(ns)
    qs = [midpoint_quantile(e.ratios, round(level * n)) for e, n in zip(entries, ns)]
    return level, sum(q * n for q, n in zip(qs, ns)) / sum(ns)


def _pooled_estimate(entries: list[PoolEntry], keep: int) -> LowerEstimate:
    level, raw = _level_aligned(entries)
    pool = tuple(entries[-keep:]) if keep > 0 else ()
    return LowerEstimate(raw, level, sum(e.tokens for e in entries), len(entries), pool=pool)


def _usable(pool: Sequence[PoolEntry]) -> list[PoolEntry]:
    return [e for e in pool if len(e.ratios)]


@LOWER_ESTIMATORS.register("pooled")
def _pooled(inp: EstimatorInput) -> LowerEstimate:
    """The last ``window`` calibration steps (this one included), aligned by quantile level."""
    entries = (_usable(inp.pool) + [_entry(inp)])[-inp.window :]
    return _pooled_estimate(entries, inp.window - 1)


@LOWER_ESTIMATORS.register("k_floor")
def _k_floor(inp: EstimatorInput) -> LowerEstimate:
    """Widen the pool backwards until BF16 clips >= ``min_clipped`` tokens (at most ``window`` steps)."""
    history = _usable(inp.pool)[-(inp.window - 1) :] if inp.window > 1 else []
    entries = [_entry(inp)]
    while sum(e.k for e in entries) < inp.min_clipped and history:
        entries.insert(0, history.pop())
    est = _pooled_estimate(entries, 0)
    keep = (_usable(inp.pool) + [entries[-1]])[-(inp.window - 1) :] if inp.window > 1 else []
    return LowerEstimate(est.raw_lower, est.level, est.shadow_tokens, est.pooled_steps, pool=tuple(keep))


# --------------------------------------------------------------------------- Harrell-Davis


def _betacf(a: float, b: float, x: np.ndarray, iters: int = 400) -> np.ndarray:
    """Continued fraction of the incomplete beta function (modified Lentz), vectorized over x."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = np.ones_like(x)
    d = 1.0 - qab * x / qap
    d = 1.0 / np.where(np.abs(d) < tiny, tiny, d)
    h = d.copy()
    for m in range(1, iters + 1):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / np.where(np.abs(d) < tiny, tiny, d)
            c = 1.0 + aa / c
            c = np.where(np.abs(c) < tiny, tiny, c)
            h = h * d * c
        if np.all(np.abs(d * c - 1.0) < 1e-15):
            break
    return h


def betainc(a: float, b: float, x: np.ndarray) -> np.ndarray:
    """Regularized incomplete beta I_x(a, b) for x in [0, 1] (float64)."""
    x = np.clip(np.asarray(x, dtype=np.float64), 0.0, 1.0)
    out = np.where(x >= 1.0, 1.0, 0.0)
    inner = (x > 0) & (x < 1)
    xi = x[inner]
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * np.log(xi) + b * np.log1p(-xi)
    bt = np.exp(lbt)
    low = xi < (a + 1.0) / (a + b + 2.0)
    val = np.empty_like(xi)
    val[low] = bt[low] * _betacf(a, b, xi[low]) / a
    val[~low] = 1.0 - bt[~low] * _betacf(b, a, 1.0 - xi[~low]) / b
    out[inner] = val
    return out


def hd_weights(n: int, p: float) -> np.ndarray:
    """``[n]`` Harrell-Davis weights of the order statistics for level p in (0, 1)."""
    a, b = p * (n + 1), (1 - p) * (n + 1)
    x = np.arange(n + 1, dtype=np.float64) / n
    mean, sd = a / (a + b), math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)))
    near = (x > mean - 40 * sd) & (x < mean + 40 * sd)  # the Beta mass beyond 40 sd is below 1e-25
    cdf = np.where(x >= mean, 1.0, 0.0)
    cdf[near] = betainc(a, b, x[near])
    return np.diff(cdf)


def harrell_davis(sorted_vals: np.ndarray, p: float) -> np.ndarray:
    """HD quantile at level p of each row of ``[..., n]`` sorted values (vectorized over rows)."""
    v = np.asarray(sorted_vals, dtype=np.float64)
    return v @ hd_weights(v.shape[-1], p)


def order_stat_levels(n: int, p: float, ci_level: float) -> tuple[float, float]:
    """Levels (l/n, u/n) of the distribution-free order-statistic interval for the p-quantile:
    the binomial(n, p) count's central ``ci_level`` range (normal approximation)."""
    z = NormalDist().inv_cdf(0.5 + ci_level / 2)
    sd = math.sqrt(n * p * (1 - p))
    lo = max(n * p - z * sd, 0.5) / n
    hi = min(n * p + z * sd, n - 0.5) / n
    return lo, hi


def hd_interval(sorted_vals: np.ndarray, p: float, ci_level: float) -> tuple[np.ndarray, np.ndarray]:
    """HD quantiles at the order-statistic interval's levels: the ``ci_level`` interval for the p-quantile."""
    v = np.asarray(sorted_vals, dtype=np.float64)
    lo, hi = order_stat_levels(v.shape[-1], p, ci_level)
    return harrell_davis(v, lo), harrell_davis(v, hi)


@LOWER_ESTIMATORS.register("harrell_davis")
def _harrell_davis(inp: EstimatorInput) -> LowerEstimate:
    """HD quantile of the current step's A<0 FP8 ratios at BF16's level k/n, with its interval."""
    tok = inp.tokens
    n = tok.n_neg
    if inp.k <= 0 or n < 2:  # no level inside (0, 1) to smooth at: the paper's rule
        return LowerEstimate(tok.quantile_lower(inp.k), inp.k / n, tok.n_tokens, 1)
    p = min(inp.k / n, 1 - 0.5 / n)
    v = torch.sort(tok.r8n.to(torch.float64)).values.numpy()
    lo, hi = hd_interval(v, p, inp.ci_level)
    return LowerEstimate(float(harrell_davis(v, p)), p, tok.n_tokens, 1, float(lo), float(hi))
