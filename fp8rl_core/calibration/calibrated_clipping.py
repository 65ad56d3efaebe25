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

import itertools
import math
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from fp8rl_core.calibration.bapo import PUBLISHED, UpdateBoundsRule
from fp8rl_core.calibration.estimators import LOWER_ESTIMATORS, EstimatorInput, LowerEstimate, PoolEntry
from fp8rl_core.registry import Registry

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.method import CalibrationConfig

__all__ = [
    "CLIP_MODES",
    "CalibrationResult",
    "CalibrationTokens",
    "CalibratorState",
    "ModeContext",
    "balance",
    "calibrate",
    "initial_bounds",
    "pos_neg_contrib",
    "relaxed_bounds",
]

BALANCE_RTOL = 1e-9
_INF = float("inf")
_NAN = float("nan")


def _ratio(pos: float, neg: float) -> float:
    return _INF if neg == 0 else pos / neg


def _share(count: int, n: int) -> float:
    return count / n if n else _NAN


def _grid(lo: float, hi: float, step: float) -> list[float]:
    """Grid lo, lo+step, ... <= hi, with hi appended if the steps miss it."""
    n = int(math.floor((hi - lo) / step + 1e-9))
    pts = [round(lo + j * step, 12) for j in range(n + 1)]
    if pts[-1] < hi - 1e-12:
        pts.append(hi)
    return pts


def _work_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    dt = torch.promote_types(a.dtype, b.dtype)
    return dt if dt in (torch.float32, torch.float64) else torch.float32  # bf16/fp16 ratios: upcast


# --------------------------------------------------------------------------- token sets


class CalibrationTokens:
    """Compacted valid tokens of one calibration, split by advantage sign.

    ``r8n, r16n, absn``: ``[n_neg]`` FP8 ratio, BF16 ratio and |A| of the A<0
    tokens; ``r8p, r16p, ap``: ``[n_pos]`` the same for A>0 (one float dtype).
    Zero-advantage tokens carry no gradient and are only counted. Statistics are
    memoised per (token set, bound): ``calibrate`` asks for a bound repeatedly.
    """

    def __init__(
        self,
        r8: torch.Tensor,
        r16: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        dual_clip: float = 3.0,
        weights: torch.Tensor | None = None,
    ) -> None:
        if weights is not None:  # Pos/Neg weighted by TIS: r * |A| * w, the factor that scales the gradient
            if weights.shape != adv.shape:
                raise ValueError(
                    f"calibrate: weights must have the advantages' shape {tuple(adv.shape)}, got {tuple(weights.shape)}"
                )
            adv = adv * weights.to(adv.dtype if adv.dtype.is_floating_point else torch.float32)
        if not (r8.shape == r16.shape == adv.shape == mask.shape):
            raise ValueError(
                "calibrate needs r_fp8, r_bf16, advantages and mask of one shape, got "
                f"{tuple(r8.shape)}, {tuple(r16.shape)}, {tuple(adv.shape)}, {tuple(mask.shape)}"
            )
        dt = _work_dtype(r8, r16)
        r8, r16 = r8.reshape(-1).to(dt), r16.reshape(-1).to(dt)
        adv = adv.reshape(-1).to(dt)
        m = mask.reshape(-1).bool()
        self.n_masked = int(torch.count_nonzero(m))
        # A sum is finite only if every term is (inf/NaN propagate); a finite
        # overflow merely sends us down the exact path. Saves 3 full passes.
        if bool(torch.isfinite(r8.sum() + r16.sum() + adv.sum())):
            valid = m
            self.n_tokens = self.n_masked
        else:
            valid = m & torch.isfinite(r8)
            valid &= torch.isfinite(r16)
            valid &= torch.isfinite(adv)
            self.n_tokens = int(torch.count_nonzero(valid))
        self.n_nonfinite = self.n_masked - self.n_tokens
        neg_idx = torch.nonzero(valid & (adv < 0)).squeeze(1)  # one nonzero per sign, then cheap gathers
        pos_idx = torch.nonzero(valid & (adv > 0)).squeeze(1)
        self.dtype = dt
        self.dual_clip = dual_clip
        self.r8n, self.r16n = r8.index_select(0, neg_idx), r16.index_select(0, neg_idx)
        self.absn = adv.index_select(0, neg_idx).neg_()
        self.r8p, self.r16p, self.ap = (
            r8.index_select(0, pos_idx),
            r16.index_select(0, pos_idx),
            adv.index_select(0, pos_idx),
        )
        self.n_neg, self.n_pos = int(neg_idx.numel()), int(pos_idx.numel())
        self._memo: dict[str, dict[float, tuple[int, float]]] = {}

    def _bound(self, x: float) -> float:
        """``x`` as the ratios' dtype will see it."""
        return float(torch.tensor(x, dtype=self.dtype))

    def _arrays(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ratios, |A|) of ``key``: "n8", "n16" (A<0; FP8, BF16) or "p8", "p16" (A>0)."""
        return {
            "n8": (self.r8n, self.absn),
            "n16": (self.r16n, self.absn),
            "p8": (self.r8p, self.ap),
            "p16": (self.r16p, self.ap),
        }[key]

    def _side(self, key: str, bounds: Sequence[float]) -> list[tuple[int, float]]:
        """Per bound: (count, contribution). One pass answers every bound not yet seen.

        Lower side (keys "n*"), bound L: ``(#{r < L}, Neg = sum r|A| over L <= r <= c)``.
        Upper side (keys "p*"), bound H: ``(#{r > H}, Pos = sum r A over r <= H)``.
        The pass: bucketize r into the sorted bounds (plus c), count and sum the
        float64 contributions per bin, then prefix sums over the (few) bins.
        """
        lower = key.startswith("n")
        memo = self._memo.setdefault(key, {})
        rounded = [self._bound(b) for b in bounds]
        missing = sorted(set(rounded) - set(memo))
        if missing:
            r, a = self._arrays(key)
            vals = missing
            if lower:  # r <= c  <=>  r < nextafter(c)
                c = torch.tensor(self._bound(self.dual_clip), dtype=self.dtype)
                c_next = float(torch.nextafter(c, torch.tensor(_INF, dtype=self.dtype)))
                vals = sorted(set(missing) | {c_next})
            g = torch.tensor(vals, dtype=self.dtype, device=r.device)
            # lower: idx = #{g <= r}, so r < g[j] <=> idx <= j; upper: idx = #{g < r}, so r <= g[j] <=> idx <= j
            idx = torch.bucketize(r, g, right=lower)
            nb = len(vals) + 1
            ones = torch.ones(1, dtype=torch.int64, device=r.device).expand(r.numel())  # no n-sized allocation
            cnt = torch.zeros(nb, dtype=torch.int64, device=r.device).index_add_(0, idx, ones).tolist()
            # product in the ratios' dtype (as the loss computes it), accumulated in float64
            sums = torch.zeros(nb, dtype=torch.float64, device=r.device)
            sums = sums.index_add_(0, idx, (r * a).to(torch.float64)).tolist()
            cum_cnt = list(itertools.accumulate(cnt))
            if lower:
                jc = vals.index(c_next)
                for j, v in enumerate(vals):
                    memo[v] = (cum_cnt[j], math.fsum(sums[j + 1 : jc + 1]) if j < jc else 0.0)
            else:
                cum_sum = list(itertools.accumulate(sums))
                for j, v in enumerate(vals):
                    memo[v] = (r.numel() - cum_cnt[j], cum_sum[j])
        return [memo[v] for v in rounded]

    def prefetch(self, key: str, bounds: Sequence[float]) -> None:
        """Compute the statistics of several bounds in one pass (later calls hit the memo)."""
        self._side(key, bounds)

    def neg_contrib(self, key: str, lower: float) -> float:
        """Neg = sum r*|A| over A<0 with lower <= r <= dual_clip; key "n8" (FP8) or "n16" (BF16)."""
        return self._side(key, [lower])[0][1]

    def pos_contrib(self, key: str, upper: float) -> float:
        """Pos = sum r*A over A>0 with r <= upper; key "p8" (FP8) or "p16" (BF16)."""
        return self._side(key, [upper])[0][1]

    def count_below(self, key: str, bound: float) -> int:
        """#{r < bound} of the A<0 tokens ("n8", "n16")."""
        return self._side(key, [bound])[0][0]

    def count_above(self, key: str, bound: float) -> int:
        """#{r > bound} of the A>0 tokens ("p8", "p16")."""
        return self._side(key, [bound])[0][0]

    def curve(self, key: str, grid: Sequence[float]) -> torch.Tensor:
        """``[G]`` float64 contributions (Pos for "p*", Neg for "n*") at every grid point, one pass."""
        return torch.tensor([c for _, c in self._side(key, grid)], dtype=torch.float64)

    def quantile_lower(self, k: int) -> float:
        """Raw L of the sorted-quantile rule: FP8 clips exactly the k lowest r8 (ties aside)."""
        n = self.n_neg
        if n == 0:
            raise ValueError("quantile_lower needs at least one negative-advantage token")
        if k <= 0:
            return float(self.r8n.min())
        if k >= n:
            vn = float(self.r8n.max())
            return self._strictly_above(vn, vn + 1e-6)
        vk = float(torch.kthvalue(self.r8n, k).values)
        if int(torch.count_nonzero(self.r8n <= vk)) > k:
            vk1 = vk  # a tie straddles the cut
        else:  # v_{k+1} is the smallest value above v_k: one pass instead of a second selection
            vk1 = float(torch.where(self.r8n > vk, self.r8n, _INF).amin())
        if vk == vk1:
            return vk
        return self._strictly_above(vk, (vk + vk1) / 2)

    def _strictly_above(self, v: float, candidate: float) -> float:
        """``candidate`` if the dtype still sees it above ``v``, else the next value above ``v``."""
        if self._bound(candidate) > v:
            return candidate
        t = torch.tensor(v, dtype=self.dtype)
        return float(torch.nextafter(t, torch.tensor(_INF, dtype=self.dtype)))


@dataclass(frozen=True)
class ModeContext:
    """Everything a clip mode may use besides the tokens (all Python scalars)."""

    eps_low: float
    eps_high: float
    dual_clip: float
    config: CalibrationConfig
    previous: tuple[float, float]
    k_bf16: int  # negatives that BF16 clips at 1 - eps_low
    target_balance: float
    estimate: LowerEstimate | None = None  # raw L of ``config.estimator``; None without A<0 tokens


ClipMode = Callable[[CalibrationTokens, ModeContext], tuple[float, float, float, float, str]]
"""``(tokens, ctx) -> (raw_lower, raw_upper, lower, upper, status)``."""
CLIP_MODES: Registry[ClipMode] = Registry("clip mode")


def _smooth(prev: float, raw: float, max_delta: float, lo: float, hi: float) -> float:
    new = prev + min(max(raw - prev, -max_delta), max_delta)
    return min(max(new, lo), hi)


def _search_upper(tok: CalibrationTokens, lower: float, ctx: ModeContext) -> tuple[float, str]:
    """(smallest grid H with balance(r8; lower, H) >= target, upper_max if none; status).

    Degenerate cases keep the previous H: no negative token contributes at
    ``lower`` (FP8 balance +inf for every H) or none does in BF16 at the
    standard L (target +inf: no finite H can match it)."""
    cfg = ctx.config
    grid = _grid(cfg.upper_min, cfg.upper_max, cfg.upper_step)
    neg8 = tok.neg_contrib("n8", lower)
    if neg8 == 0:
        return ctx.previous[1], "no_contributing_negatives"
    if math.isinf(ctx.target_balance):
        return ctx.previous[1], "no_contributing_negatives_bf16"
    # the smoothed H is raw H (a grid point) or prev +- max_delta: compute those in the same pass
    prev_h, d = ctx.previous[1], cfg.max_delta
    tok.prefetch(
        "p8", [*grid, prev_h, *(_smooth(prev_h, x, d, cfg.upper_min, cfg.upper_max) for x in (prev_h - d, prev_h + d))]
    )
    ok = tok.curve("p8", grid) >= ctx.target_balance * neg8 * (1 - BALANCE_RTOL)
    hit = torch.nonzero(ok)
    return (grid[int(hit[0])] if hit.numel() else cfg.upper_max), "ok"


def _calibrated_lower(tok: CalibrationTokens, ctx: ModeContext) -> tuple[float, float, str]:
    """(raw L, L in force after smoothing, status); degenerate batches keep the previous L."""
    prev_l = ctx.previous[0]
    if tok.n_neg == 0:
        return prev_l, prev_l, "empty" if tok.n_tokens == 0 else "no_negative_tokens"
    raw_l = ctx.estimate.raw_lower  # rule 1, or the estimator ``config.estimator`` names
    cfg = ctx.config
    lower = _smooth(prev_l, raw_l, cfg.max_delta, cfg.lower_min, cfg.lower_max)
    tok.prefetch("n8", [raw_l, prev_l, lower])  # one pass over the FP8 negatives for every L reported
    return raw_l, lower, "ok"


@CLIP_MODES.register("calibrated")
def _mode_calibrated(tok: CalibrationTokens, ctx: ModeContext) -> tuple[float, float, float, float, str]:
    """Rule 1 for L, smoothing of L, then H searched against the *smoothed* L (the
    pair in force), then smoothing of H. Any degenerate batch keeps the previous H."""
    cfg = ctx.config
    raw_l, lower, status = _calibrated_lower(tok, ctx)
    if status != "ok":
        raw_h = ctx.previous[1]
    elif tok.n_pos == 0:
        raw_h, status = ctx.previous[1], "no_positive_tokens"
    else:
        raw_h, status = _search_upper(tok, lower, ctx)
    upper = _smooth(ctx.previous[1], raw_h, cfg.max_delta, cfg.upper_min, cfg.upper_max)
    return raw_l, raw_h, lower, upper, status


@CLIP_MODES.register("calibrated_lower_only")
def _mode_calibrated_lower_only(tok: CalibrationTokens, ctx: ModeContext) -> tuple[float, float, float, float, str]:
    """Rule 1 and smoothing for L; H fixed at 1 + eps_high (formerly named ``relaxed_lower``)."""
    raw_l, lower, status = _calibrated_lower(tok, ctx)
    upper = 1.0 + ctx.eps_high
    return raw_l, upper, lower, upper, status


@CLIP_MODES.register("relaxed_lower")
def _mode_relaxed_lower(tok: CalibrationTokens, ctx: ModeContext) -> tuple[float, float, float, float, str]:
    """Standard clipping with a fixed, wider lower bound ``1 - relaxed_eps_low``."""
    lower, upper = relaxed_bounds(ctx.eps_high, ctx.config)
    return lower, upper, lower, upper, "empty" if tok.n_tokens == 0 else "ok"


def relaxed_bounds(eps_high: float, config: CalibrationConfig) -> tuple[float, float]:
    """(1 - calibration.relaxed_eps_low, 1 + eps_high): the bounds of mode ``relaxed_lower``."""
    return 1.0 - config.relaxed_eps_low, 1.0 + eps_high


@CLIP_MODES.register("standard")
def _mode_standard(tok: CalibrationTokens, ctx: ModeContext) -> tuple[float, float, float, float, str]:
    lower, upper = 1.0 - ctx.eps_low, 1.0 + ctx.eps_high
    return lower, upper, lower, upper, "empty" if tok.n_tokens == 0 else "ok"


@CLIP_MODES.register("bapo")
def _mode_bapo(tok: CalibrationTokens, ctx: ModeContext) -> tuple[float, float, float, float, str]:
    """BAPO as published picks its bounds before every update in the trainer
    (``fp8rl_core.calibration.bapo``); a calibration step only records statistics at the
    standard bounds, which BAPO does not use."""
    return _mode_standard(tok, ctx)


UPDATE_BOUNDS: Registry[UpdateBoundsRule] = Registry("per-update clip-bound rule")
"""Clip modes whose bounds the trainer picks before every update: their hooks (``fp8rl_core.calibration.bapo``)."""
UPDATE_BOUNDS.register("bapo")(PUBLISHED)


def per_update_rule(mode: str) -> UpdateBoundsRule | None:
    """The trainer's per-update hooks of clip mode ``mode``, or None for a mode whose bounds hold for a step."""
    return UPDATE_BOUNDS.get(mode) if mode in UPDATE_BOUNDS else None


@CLIP_MODES.register("bapo_joint_every_k")
def _mode_bapo_joint_every_k(tok: CalibrationTokens, ctx: ModeContext) -> tuple[float, float, float, float, str]:
    """Our earlier BAPO-like variant (formerly ``bapo``), NOT the published method:
    re-picked only on calibration steps from the shadow step's FP8 ratios and then
    held for K steps, L and H raised together each iteration, our Pos/Neg (with
    dual clip, ``r <= H``, ``L <= r``). Ranges, steps and rho0 from ``calibration.bapo``."""
    b = ctx.config.bapo
    lgrid = _grid(b.lower_start, b.lower_max, b.lower_step)
    hgrid = _grid(b.upper_start, b.upper_max, b.upper_step)
    steps = max(len(lgrid), len(hgrid))
    li = torch.clamp(torch.arange(steps), max=len(lgrid) - 1)  # path of (L_t, H_t)
    hi = torch.clamp(torch.arange(steps), max=len(hgrid) - 1)
    pos, neg = tok.curve("p8", hgrid)[hi], tok.curve("n8", lgrid)[li]  # [steps] each
    need = b.rho0 / (1.0 - b.rho0)
    ok = (neg == 0) | (pos >= need * neg * (1 - BALANCE_RTOL))
    hit = torch.nonzero(ok)
    t = int(hit[0]) if hit.numel() else steps - 1
    lower, upper = lgrid[int(li[t])], hgrid[int(hi[t])]
    return lower, upper, lower, upper, "empty" if tok.n_tokens == 0 else "ok"


# --------------------------------------------------------------------------- state and result


def initial_bounds(*, eps_low: float, eps_high: float, config: CalibrationConfig) -> tuple[float, float]:
    """(L, H) before the first calibration: ``config.initial_*`` or ``1 -/+ eps``
    (mode ``relaxed_lower``: its fixed bounds, in force from the first step)."""
    if config.mode == "relaxed_lower":
        eps_low = config.relaxed_eps_low
    lo = config.initial_lower if config.initial_lower is not None else 1.0 - eps_low
    hi = config.initial_upper if config.initial_upper is not None else 1.0 + eps_high
    return lo, hi


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
    eps_low: float,
    eps_high: float,
    config: CalibrationConfig,
    previous: tuple[float, float] | CalibratorState | None = None,
    dual_clip: float = 3.0,
    weights: torch.Tensor | None = None,
) -> CalibrationResult:
    """Choose the clip bounds for the next steps (mode ``config.mode``).

    Args:
        r_fp8, r_bf16: ``[N]`` (any shape, flattened) float32/float64 importance
            ratios of the training forward (FP8) and of the BF16 shadow pass, on
            all tokens of the calibration step's mini-batches.
        advantages: ``[N]`` per-token advantages; ``mask``: ``[N]`` bool/0-1.
        eps_low, eps_high: the standard PPO epsilons (BF16 reference bounds).
        config: the ``CalibrationConfig``; its ``mode`` picks a ``CLIP_MODES`` entry.
        previous: bounds in force, as ``(L, H)`` or a ``CalibratorState``;
            None = ``initial_bounds``.
        dual_clip: c of the loss (``algorithm.dual_clip``); Neg ignores r > c.
        weights: ``[N]`` TIS weights; required by, and only used with,
            ``config.tis_weighted_balance`` (Pos/Neg sum r * |A| * w).
    Returns:
        A ``CalibrationResult`` of Python scalars.
    """
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
