"""Calibrated Clipping: ratio clip bounds that undo FP8 ratio noise.

Source: Chen et al. 2026, "Towards Full Pipeline FP8 Reinforcement Learning for
LLMs", section 4; the exact rules are in docs/method.md, "Calibrated Clipping".

Why. FP8 noise in both pi_theta and pi_old compounds in the ratio r = pi/pi_old,
widening its spread. The PPO gradient of a negative-advantage token vanishes
below ``L = 1 - eps_low``, so a wider spread silences many more "bad" tokens than
BF16 would; they stop being penalised and training later collapses. Every K
steps the train stage runs BF16 shadow passes, giving a reference ratio r16 next
to the FP8 ratio r8 of every token, and this module picks FP8 bounds (L, H) that
reproduce BF16's behaviour at (1 - eps_low, 1 + eps_high).

Contribution of gradient-carrying tokens, for bounds (L, H) and dual clip c::

    Pos(r; L, H) = sum_{A>0, r<=H} r * A          (non-decreasing in H)
    Neg(r; L, H) = sum_{A<0, L<=r<=c} r * |A|     (non-increasing in L)
    balance = Pos / Neg                            (Neg = 0 -> +inf)

Rule (mode ``calibrated``), over the n negative-advantage tokens:

1. ``alpha`` = share of them with ``r16 < 1 - eps_low``; ``k = round(alpha n)``
   (= that count). Sort their r8: v1 <= ... <= vn. ``L = v1`` if k = 0,
   ``(vk + vk+1)/2`` if 0 < k < n, ``vn + 1e-6`` if k = n: FP8 clips the same
   *number* of tokens as BF16 (ties aside). This is ``calibration.estimator``
   ``quantile`` (the default); ``fp8rl_core.calibration.estimators`` holds the others
   (pooled over steps, a floor on k, Harrell-Davis with an interval).
2. Smoothing of L: ``L = prev_L + clamp(raw_L - prev_L, -max_delta, max_delta)``,
   clamped to [lower_min, lower_max]. ``prev`` starts at the initial bounds
   (``config.initial_*`` or ``1 - eps_low, 1 + eps_high``).
3. ``target = balance(r16; 1 - eps_low, 1 + eps_high)``; raw ``H`` = the
   smallest grid point of [upper_min, upper_max] (step upper_step) with
   ``balance(r8; L, H) >= target`` for the *smoothed* L of step 2 -- the L that
   will be in force --, ``upper_max`` if none. (Searching against the raw L and
   smoothing both afterwards, as we first did, leaves the pair in force off
   BF16's balance while L is still walking towards its raw value.)
4. ``H = prev_H + clamp(raw_H - prev_H, -max_delta, max_delta)``, clamped to
   [upper_min, upper_max]. So whenever the step cap lets H reach raw H, the pair
   (L, H) in force meets the target within one grid step.

``balance_after`` is the FP8 balance at the bounds in force (L, H), not at the
raw pair.

Degenerate batches keep the previous bound, in every case (status names it):
no negative-advantage token (``no_negative_tokens``: L and H kept); no positive
token (``no_positive_tokens``: H kept, Pos = 0 for every H); no negative token
contributes at the L in force (``no_contributing_negatives``: the FP8 balance is
+inf for every H, H kept -- the literal rule would jump to ``upper_min``); none
contributes in BF16 at the standard L (``no_contributing_negatives_bf16``: target
+inf, no H can meet it, H kept).

TIS weighting (``tis_weighted_balance``, off by default): each token's term of
Pos and Neg becomes ``r * |A| * w`` with its TIS weight
``w = min(exp(old_logp - rollout_logp), C)``, the factor that really scales its
gradient in the loss; the same w weights the BF16 target (the rollout/trainer
mismatch is a property of the token, not of the precision of the shadow pass).
Membership (which tokens count as A<0, alpha, the quantile) is unchanged.

Cost. Rule 1 needs only v_k and v_k+1: one O(n) selection (``torch.kthvalue``)
and one pass for the next value, not a full sort. Everything else is a count or
a contribution sum at a few bounds, and one pass answers all the bounds of a
token set at once: ``bucketize`` the ratios into the sorted bounds (O(n log G)),
``index_add`` counts and float64 contributions into G + 1 bins, prefix-sum the
bins. For H this yields Pos at every grid point: the numbers of "one sort +
cumsum + searchsorted" without the sort (about 10x cheaper on CPU), never a
re-sum per grid point. Work runs on compacted copies of the A<0 and A>0 tokens.
Since sums over different bin layouts add in different orders, ``balance >=
target`` is tested with a relative slack of ``BALANCE_RTOL`` = 1e-9.

Comparisons against a bound happen in the ratios' dtype (a Python bound is
rounded to it), exactly as in ``fp8rl_core.objective.losses``; raw bounds are nudged up by
one ulp where rounding would otherwise change which tokens they clip.

Comparison modes (``CLIP_MODES``):

* ``standard``: fixed ``1 - eps_low``, ``1 + eps_high`` (statistics only);
* ``relaxed_lower``: standard clipping with a fixed, wider lower bound
  ``L = 1 - relaxed_eps_low`` (the paper's "simply relaxing the lower bound"),
  in force from the first step; alpha, the target and the over-clipping
  diagnostics stay measured against the standard ``eps_low``;
* ``calibrated_lower_only``: rules 1-2 for L, H fixed at ``1 + eps_high``
  (what ``relaxed_lower`` used to mean here);
* ``bapo``: BAPO as published, re-picked before every update by the trainer
  (``fp8rl_core.calibration.bapo``); a calibration step only records statistics;
* ``bapo_joint_every_k``: our earlier BAPO-like variant (re-picked on
  calibration steps only, L and H moved together); not the published method.

Inputs: non-finite r8, r16 or A and masked-out tokens are dropped (non-finite
ones counted in ``n_nonfinite``). Undefined shares are NaN.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from fp8rl_core.calibration.clip_modes import CLIP_MODES, ModeContext, initial_bounds
from fp8rl_core.calibration.estimators import LOWER_ESTIMATORS, EstimatorInput, LowerEstimate, PoolEntry
from fp8rl_core.calibration.tokens import _NAN, CalibrationTokens, _ratio, _share

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.method import CalibrationConfig

__all__ = [
    "CalibrationResult",
    "CalibratorState",
    "StandardClip",
    "balance",
    "calibrate",
    "pos_neg_contrib",
]


@dataclass(frozen=True)
class StandardClip:
    """The loss's standard clip, BF16's reference: bounds ``(1 - eps_low, 1 + eps_high)`` and the dual clip."""

    eps_low: float  # the standard PPO lower epsilon (``algorithm.eps_low``)
    eps_high: float  # the standard PPO upper epsilon (``algorithm.eps_high``)
    dual_clip: float = 3.0  # c of the loss (``algorithm.dual_clip``); Neg ignores r > c


@dataclass(frozen=True)
class CalibratorState:
    """Bounds in force between calibrations; saved in checkpoints (``to_dict``)."""

    lower: float
    upper: float
    n_calibrations: int = 0
    last_step: int | None = None
    alpha: float | None = None  # BF16's lower-clip share at the last calibration (the quantile drift signal's level)
    pool: tuple[PoolEntry, ...] = ()  # earlier calibration steps a pooled estimator re-uses (calibration.estimators)
    correction: tuple[float, float] | None = None  # calibrated mismatch-correction thresholds (None: configured)

    @property
    def bounds(self) -> tuple[float, float]:
        return self.lower, self.upper

    @classmethod
    def initial(cls, *, eps_low: float, eps_high: float, config: CalibrationConfig) -> "CalibratorState":
        lo, hi = initial_bounds(eps_low=eps_low, eps_high=eps_high, config=config)
        return cls(lower=lo, upper=hi)

    def updated(self, result: "CalibrationResult", step: int) -> "CalibratorState":
        """The state after applying ``result`` at ``step``."""
        alpha = result.alpha if math.isfinite(result.alpha) else self.alpha  # no A<0 token: keep the last level
        pool = result.pool if result.pool is not None else self.pool  # no A<0 token: the pool stays
        return CalibratorState(result.lower, result.upper, self.n_calibrations + 1, step, alpha, pool, self.correction)

    def to_dict(self) -> dict:
        """Plain JSON-able values (the pool as lists of floats, which JSON round-trips exactly)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CalibratorState":
        names = {f.name for f in fields(cls)}
        unknown, missing = set(d) - names, {"lower", "upper"} - set(d)
        if unknown or missing:
            raise ValueError(
                f"CalibratorState.from_dict: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}"
            )
        last, alpha = d.get("last_step"), d.get("alpha")  # alpha, pool: absent from older checkpoints
        pool = tuple(PoolEntry.from_dict(e) for e in d.get("pool") or ())
        correction = d.get("correction")  # absent from older checkpoints
        return cls(
            float(d["lower"]),
            float(d["upper"]),
            int(d.get("n_calibrations", 0)),
            None if last is None else int(last),
            None if alpha is None else float(alpha),
            pool,
            None if correction is None else (float(correction[0]), float(correction[1])),
        )


@dataclass(frozen=True)
class CalibrationResult:
    """Outcome of one calibration (one row of the ``bounds`` table via ``to_dict``).

    ``lower``/``upper`` are the smoothed, clamped bounds to use from the next
    step; ``raw_*`` the unsmoothed rule output; ``previous_*`` the bounds in
    force before. Balances: ``target`` = BF16 at the standard bounds,
    ``before`` = FP8 at previous, ``after`` = FP8 at the bounds in force from
    the next step (lower, upper), ``applied`` = the same (kept for old readers).
    ``lower_clip_share_*`` are shares of the negative-advantage
    tokens (so ``lower_clip_share_bf16 == alpha``), ``upper_clip_share_*`` of
    the positive ones. ``n_tokens`` counts the valid, finite tokens used.
    """

    mode: str
    lower: float
    upper: float
    raw_lower: float
    raw_upper: float
    previous_lower: float
    previous_upper: float
    alpha: float
    target_balance: float
    balance_before: float
    balance_after: float
    balance_applied: float
    lower_clip_share_bf16: float
    lower_clip_share_fp8_before: float
    lower_clip_share_fp8_after: float
    lower_clip_share_fp8_applied: float
    upper_clip_share_bf16: float
    upper_clip_share_fp8_before: float
    upper_clip_share_fp8_after: float
    n_tokens: int
    n_negative: int
    n_positive: int
    n_nonfinite: int
    status: str
    estimator: str = "quantile"
    lower_level: float = _NAN  # the FP8 quantile level the raw L aims at
    lower_ci_low: float | None = None  # the estimator's interval for raw L (None: it has none)
    lower_ci_high: float | None = None
    shadow_tokens: int = 0  # shadow-passed tokens the raw L rests on (pooled steps included)
    pooled_steps: int = 0
    pool: tuple[PoolEntry, ...] | None = field(default=None, repr=False)  # the calibrator's next pool; None: keep

    def to_dict(self) -> dict[str, float | int | str]:
        d = asdict(self)
        d.pop("pool")
        return d


# --------------------------------------------------------------------------- entry points


def _resolve_previous(previous, eps_low: float, eps_high: float, config: CalibrationConfig) -> tuple[float, float]:
    if previous is None:
        return initial_bounds(eps_low=eps_low, eps_high=eps_high, config=config)
    if isinstance(previous, CalibratorState):
        return previous.bounds
    lo, hi = previous
    return float(lo), float(hi)


def calibrate(
    r_fp8: torch.Tensor,
    r_bf16: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    standard: StandardClip,
    config: CalibrationConfig,
    previous: tuple[float, float] | CalibratorState | None = None,
    weights: torch.Tensor | None = None,
) -> CalibrationResult:
    """Choose the clip bounds for the next steps (mode ``config.mode``).

    Args:
        r_fp8, r_bf16: ``[N]`` (any shape, flattened) float32/float64 importance
            ratios of the training forward (FP8) and of the BF16 shadow pass, on
            all tokens of the calibration step's mini-batches.
        advantages: ``[N]`` per-token advantages; ``mask``: ``[N]`` bool/0-1.
        standard: the standard PPO epsilons (BF16 reference bounds) and the loss's dual clip.
        config: the ``CalibrationConfig``; its ``mode`` picks a ``CLIP_MODES`` entry.
        previous: bounds in force, as ``(L, H)`` or a ``CalibratorState``;
            None = ``initial_bounds``.
        weights: ``[N]`` TIS weights; required by, and only used with,
            ``config.tis_weighted_balance`` (Pos/Neg sum r * |A| * w).
    Returns:
        A ``CalibrationResult`` of Python scalars.
    """
    eps_low, eps_high, dual_clip = standard.eps_low, standard.eps_high, standard.dual_clip
    mode_fn = CLIP_MODES.get(config.mode)
    prev = _resolve_previous(previous, eps_low, eps_high, config)
    if config.tis_weighted_balance and weights is None:
        raise ValueError("calibration.tis_weighted_balance needs the TIS weights of the tokens (weights=...)")
    tok = CalibrationTokens(
        r_fp8, r_bf16, advantages, mask, dual_clip, weights=weights if config.tis_weighted_balance else None
    )
    std_l, std_h = 1.0 - eps_low, 1.0 + eps_high
    k16 = tok.count_below("n16", std_l)
    target = _ratio(tok.pos_contrib("p16", std_h), tok.neg_contrib("n16", std_l))
    est = _estimate(tok, k16, previous, config)
    ctx = ModeContext(eps_low, eps_high, dual_clip, config, prev, k16, target, est)
    raw_l, raw_h, lower, upper, status = mode_fn(tok, ctx)
    tok.prefetch("n8", [prev[0], raw_l, lower])  # at most one more pass per side
    tok.prefetch("p8", [prev[1], raw_h, upper])

    def fp8_balance(lo: float, hi: float) -> float:
        return _ratio(tok.pos_contrib("p8", hi), tok.neg_contrib("n8", lo))

    nn, npos = tok.n_neg, tok.n_pos
    return CalibrationResult(
        mode=config.mode,
        lower=lower,
        upper=upper,
        raw_lower=raw_l,
        raw_upper=raw_h,
        previous_lower=prev[0],
        previous_upper=prev[1],
        alpha=_share(k16, nn),
        target_balance=target,
        balance_before=fp8_balance(*prev),
        balance_after=fp8_balance(lower, upper),
        balance_applied=fp8_balance(lower, upper),
        lower_clip_share_bf16=_share(k16, nn),
        lower_clip_share_fp8_before=_share(tok.count_below("n8", prev[0]), nn),
        lower_clip_share_fp8_after=_share(tok.count_below("n8", raw_l), nn),
        lower_clip_share_fp8_applied=_share(tok.count_below("n8", lower), nn),
        upper_clip_share_bf16=_share(tok.count_above("p16", std_h), npos),
        upper_clip_share_fp8_before=_share(tok.count_above("p8", prev[1]), npos),
        upper_clip_share_fp8_after=_share(tok.count_above("p8", raw_h), npos),
        n_tokens=tok.n_tokens,
        n_negative=nn,
        n_positive=npos,
        n_nonfinite=tok.n_nonfinite,
        status=status,
        estimator=config.estimator,
        **_estimate_fields(est),
    )


def _estimate(tok: CalibrationTokens, k16: int, previous, config: CalibrationConfig) -> LowerEstimate | None:
    """Raw L of ``config.estimator`` (None without A<0 tokens), fed the calibrator's pool."""
    if tok.n_neg == 0:
        return None
    pool = previous.pool if isinstance(previous, CalibratorState) else ()
    inp = EstimatorInput(
        tok, k16, pool, config.estimator_window, config.estimator_min_clipped, config.estimator_ci_level
    )
    return LOWER_ESTIMATORS.get(config.estimator)(inp)


def _estimate_fields(est: LowerEstimate | None) -> dict:
    if est is None:
        return {}
    return {
        "lower_level": est.level,
        "lower_ci_low": est.ci_low,
        "lower_ci_high": est.ci_high,
        "shadow_tokens": est.shadow_tokens,
        "pooled_steps": est.pooled_steps,
        "pool": est.pool,
    }


def pos_neg_contrib(
    r: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, lower: float, upper: float, dual_clip: float = 3.0
) -> tuple[float, float]:
    """``(Pos, Neg)`` (docs/method.md, "Calibrated Clipping") for ratios ``r`` ``[N]`` (any shape),
    advantages and mask of the same shape; non-finite tokens are ignored."""
    tok = CalibrationTokens(r, r, advantages, mask, dual_clip)
    return tok.pos_contrib("p8", upper), tok.neg_contrib("n8", lower)


def balance(
    r: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, lower: float, upper: float, dual_clip: float = 3.0
) -> float:
    """``Pos / Neg`` (+inf when Neg = 0); arguments as ``pos_neg_contrib``."""
    return _ratio(*pos_neg_contrib(r, advantages, mask, lower, upper, dual_clip))
