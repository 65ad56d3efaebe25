"""Rollout-vs-trainer mismatch corrections: the per-token weights that scale the policy loss.

The rollout engine samples from its own distribution (pi_rollout: vLLM, FP8 or
not); the trainer recomputes pi_old in the training precision. Each correction
turns the per-token log-ratio ``d_t = old_logp_t - rollout_logp_t`` into a
detached weight ``w_t`` that multiplies the token's loss (``is_weights`` of
``fp8rl_core.objective.losses``). A correction is three choices:

* its **unit**: the token (``rho_t = exp(d_t)``), the sequence
  (``rho = exp(sum_t d_t)``, the product of the token ratios) or the sequence's
  geometric mean (``rho = exp(mean_t d_t)``); sums and means run over the valid
  tokens of a row, and a sequence unit's value is given to each of its tokens;
* its **rule** for a unit ratio rho and thresholds ``[lower, upper]``:
  ``truncate`` ``w = min(rho, upper)`` (``lower`` unused), ``masked-is``
  ``w = rho`` inside ``[lower, upper]`` and 0 outside (the unit's tokens are
  dropped from the gradient), ``mask`` ``w = 1`` inside and 0 outside (a pure
  rejection mask, no reweighting);
* its reference thresholds, those of the peer or paper it follows.

Every log-ratio is clamped to ±20 before ``exp``, like the PPO ratio, so no inf
appears (verl clamps its IS log-ratios to the same ±20).

The registered corrections (``CORRECTIONS``; ``algorithm.correction.mode``):

==============  ==========  =========  ================  ==============================================
name            unit        rule       thresholds        follows
==============  ==========  =========  ================  ==============================================
token-tis       token       truncate   C = tis_cap (2)   Yao et al. 2025, "Your efficient RL framework
                                                         secretly brings you off-policy RL training"
                                                         (the default; ``losses.tis_weights``)
seq-tis         sequence    truncate   C = 2             verl ``RolloutCorrectionConfig.seq_is``
                                                         (verl/trainer/ppo/rollout_corr_helper.py)
token-mis       token       masked-is  [0, 2]            masked IS of Liu, Li et al. 2025, "When speed
                                                         kills stability" (token level); slime's MIS
                                                         (examples/train_infer_mismatch_helper)
seq-mis         sequence    masked-is  [0, 2]            the same paper's Seq-MIS; verl ``seq_mis``
                                                         (truncated sequence IS at 2 plus a sequence
                                                         rejection above 2: the same weights)
icepop          token       masked-is  [0.5, 5]          IcePop, Ling Team 2025 (Ring-1T, arXiv
                                                         2510.18855): the token's coefficient is its
                                                         train/inference ratio inside [alpha, beta],
                                                         0 outside
geo-mask        geometric   mask       [1/1.001, 1.001]  verl ``geo_rs`` (geometric-mean rejection in
                                                         rollout_corr_helper.py), TRL's sequence mask
==============  ==========  =========  ================  ==============================================

Token TIS gives ``tis_weights(old, rollout, C) * mask`` exactly as before
(bit-identical on finite inputs); every correction gives 0 at padding positions,
whatever they hold.

Calibrated thresholds (``algorithm.correction.calibrate: true``) are set
from the BF16 shadow pass the way Calibrated Clipping sets L
(``fp8rl_core.calibration.calibrated_clipping``): the reference thresholds say how many units a
correction should truncate or mask when pi_old is computed in BF16; FP8 noise in
pi_old widens the spread of the unit ratios, so at the same thresholds FP8
training truncates or masks more. ``calibrate_thresholds`` counts the units whose
BF16 ratio lies above ``upper`` (k) and below ``lower`` (j), sorts the FP8 ratios
``v_1 <= ... <= v_n`` and, where FP8 leaves more units outside a threshold
than BF16 does, moves that threshold to between the order statistics that leave
the same count outside (the midpoint rule of Calibrated Clipping's L); where it
leaves as many or fewer, the threshold stays. Thresholds only ever widen (never tighter than the reference: the
correction's own meaning for an unperturbed pi_old), and at most to
``max_factor`` times the reference's distance from 1 in log-ratio
(``upper <= reference ** max_factor``, ``lower >= reference ** max_factor``:
2 -> 4 and 0.5 -> 0.25 at the default 2, 1.001 -> 1.002 for the geometric
mask), so a lone FP8 outlier cannot switch a correction off.

Shapes: every per-token tensor is ``[B, T]``, rows are sequences; ``mask`` bool
or 0/1 float. Weights come back float32 (the dtype of ``old_logp``), detached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from fp8rl_core.config.correction_kinds import CORRECTIONS, DEFAULT_CORRECTION, Correction, thresholds
from fp8rl_core.objective.losses import LOG_RATIO_CLAMP, tis_weights

__all__ = [
    "CORRECTIONS",
    "Correction",
    "ThresholdCalibration",
    "calibrate_correction",
    "calibrate_thresholds",
    "configured_thresholds",
    "correction_weights",
    "step_weights",
    "unit_values",
    "thresholds",
    "unit_ratios",
]


def _masked(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(m, x, torch.zeros_like(x))


# unit log-ratio, broadcast to [B, T]: (d [B, T], m [B, T] bool) -> [B, T]
UNITS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": lambda d, m: d,
    "sequence": lambda d, m: _masked(d, m).sum(-1, keepdim=True).expand_as(d),
    "geometric": lambda d, m: (_masked(d, m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)).expand_as(
        d
    ),
}


def _inside(rho: torch.Tensor, lower: float, upper: float) -> torch.Tensor:
    return (rho >= lower) & (rho <= upper)


# weight from the unit ratio: (rho [B, T], lower, upper) -> [B, T]
RULES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "truncate": lambda rho, lower, upper: torch.clamp(rho, max=upper),
    "masked-is": lambda rho, lower, upper: torch.where(_inside(rho, lower, upper), rho, torch.zeros_like(rho)),
    "mask": lambda rho, lower, upper: _inside(rho, lower, upper).to(rho.dtype),
}


def unit_ratios(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, unit: str) -> torch.Tensor:
    """``[B, T]`` ratio of each token's unit, ``exp(clamp(unit log-ratio, -20, 20))``; padding holds garbage."""
    m = mask.bool()
    d = _masked(old_logp.detach() - rollout_logp.detach(), m)
    return torch.exp(torch.clamp(UNITS[unit](d, m), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@torch.no_grad()
def correction_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    name: str = DEFAULT_CORRECTION,
    *,
    lower: float | None = None,
    upper: float | None = None,
) -> torch.Tensor:
    """Per-token weights ``[B, T]`` of correction ``name`` (module docstring), 0 at padding, detached.

    Args:
        old_logp: ``[B, T]`` pi_old in the training precision.
        rollout_logp: ``[B, T]`` the rollout engine's log-probs of the same tokens.
        mask: ``[B, T]`` valid response tokens (0/1 float or bool).
        lower, upper: thresholds (None: the correction's reference ones).
    """
    c = CORRECTIONS.get(name)
    lo, hi = thresholds(name, lower, upper)
    m = mask.bool()
    if c.unit == "token" and c.rule == "truncate":  # token TIS: the historical weights, bit for bit
        w = tis_weights(old_logp, rollout_logp, cap=hi)
    else:
        w = RULES[c.rule](unit_ratios(old_logp, rollout_logp, m, c.unit), lo, hi)
    return _masked(w, m)  # = w * mask for finite w (w >= 0), and 0 where padding holds NaN


# --------------------------------------------------------------------------- calibrated thresholds


@dataclass(frozen=True)
class ThresholdCalibration:
    """Outcome of one threshold calibration (columns ``correction_*`` of the ``bounds`` table)."""

    lower: float  # in force from the next step
    upper: float
    reference_lower: float
    reference_upper: float
    units: int  # units (tokens or sequences) with a shadow pass
    outside_share_bf16: float  # share of units outside the reference thresholds, BF16 pi_old
    outside_share_fp8_before: float  # the same, FP8 pi_old
    outside_share_fp8_after: float  # FP8 pi_old, calibrated thresholds


def _match_above(v: torch.Tensor, k: int) -> float:
    """A threshold with exactly ``k`` of the sorted ``v`` strictly above it (midpoint of the neighbours)."""
    n = v.numel()
    if k <= 0:
        return float(v[-1])
    if k >= n:
        return math.nextafter(float(v[0]), -math.inf)
    return 0.5 * (float(v[n - k - 1]) + float(v[n - k]))


def _match_below(v: torch.Tensor, j: int) -> float:
    """A threshold with exactly ``j`` of the sorted ``v`` strictly below it."""
    n = v.numel()
    if j <= 0:
        return float(v[0])
    if j >= n:
        return math.nextafter(float(v[-1]), math.inf)
    return 0.5 * (float(v[j - 1]) + float(v[j]))


def _outside(rho: torch.Tensor, lower: float, upper: float) -> float:
    return float(((rho < lower) | (rho > upper)).double().mean()) if rho.numel() else math.nan


def calibrate_thresholds(
    rho8: torch.Tensor, rho16: torch.Tensor, *, lower: float, upper: float, max_factor: float = 2.0
) -> ThresholdCalibration:
    """FP8 thresholds that truncate or mask as many units as BF16 does at ``[lower, upper]``.

    Args:
        rho8: ``[n]`` unit ratios with pi_old from the FP8 (training-precision) forward.
        rho16: ``[n]`` the same units' ratios with pi_old from the BF16 shadow forward.
        lower, upper: the reference thresholds (``lower`` 0: none).
        max_factor: widening cap (distance from 1 in log-ratio, as a multiple of the reference's), ``>= 1``.
    Non-finite pairs are left out; with no unit left the reference thresholds are returned.
    """
    keep = torch.isfinite(rho8) & torch.isfinite(rho16)
    r8, r16 = rho8[keep].double(), rho16[keep].double()
    n = r8.numel()
    if n == 0:
        nan = math.nan
        return ThresholdCalibration(lower, upper, lower, upper, 0, nan, nan, nan)
    v = torch.sort(r8).values
    k, j = int((r16 > upper).sum()), int((r16 < lower).sum())
    upper_cap = max(upper, upper**max_factor)  # a cap below 1 (a truncation) is never lowered
    lower_floor = min(lower, lower**max_factor)
    new_upper = upper if int((r8 > upper).sum()) <= k else min(max(_match_above(v, k), upper), upper_cap)
    new_lower = lower if int((r8 < lower).sum()) <= j else max(min(_match_below(v, j), lower), lower_floor)
    return ThresholdCalibration(
        new_lower,
        new_upper,
        lower,
        upper,
        n,
        _outside(r16, lower, upper),
        _outside(r8, lower, upper),
        _outside(r8, new_lower, new_upper),
    )


def configured_thresholds(algorithm) -> tuple[float, float]:
    """``(lower, upper)`` the config sets for ``algorithm.correction`` (``AlgorithmConfig``): its own values,
    else the correction's reference ones; token TIS's cap is ``algorithm.tis_cap``."""
    c = algorithm.correction
    upper = algorithm.tis_cap if c.mode == DEFAULT_CORRECTION else c.upper
    return thresholds(c.mode, c.lower, upper)


def step_weights(old_logp, rollout_logp, mask, algorithm, in_force: tuple[float, float] | None = None):
    """The loss's per-token weights ``[B, T]`` for ``algorithm`` (None when ``algorithm.tis`` is off).

    ``in_force``: calibrated thresholds from the last calibration (None: the configured ones).
    """
    if not algorithm.tis:
        return None
    lower, upper = in_force if in_force is not None else configured_thresholds(algorithm)
    return correction_weights(old_logp, rollout_logp, mask, algorithm.correction.mode, lower=lower, upper=upper)


def unit_values(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, unit: str) -> torch.Tensor:
    """``[n]`` the unit ratios of ``[B, T]`` inputs: one per valid token (token unit) or per row with a valid
    token (sequence units), in row order."""
    m = mask.bool()
    rho = unit_ratios(old_logp, rollout_logp, m, unit)
    return rho[m] if unit == "token" else rho[m.any(-1), 0]


def calibrate_correction(old_fp8, old_bf16, rollout_logp, mask, algorithm) -> ThresholdCalibration:
    """Calibrated thresholds of ``algorithm.correction`` from one shadow step's ``[B, T]`` tensors (``mask``: the
    tokens with a BF16 shadow pass), against its configured thresholds."""
    c = CORRECTIONS.get(algorithm.correction.mode)
    lower, upper = configured_thresholds(algorithm)
    rho8 = unit_values(old_fp8, rollout_logp, mask, c.unit)
    rho16 = unit_values(old_bf16, rollout_logp, mask, c.unit)
    return calibrate_thresholds(rho8, rho16, lower=lower, upper=upper, max_factor=algorithm.correction.max_factor)
