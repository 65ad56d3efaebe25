"""The clip modes (``calibration.mode``): each turns one calibration's tokens into (L, H); and the
per-update rules (BAPO) a mode may hand to the trainer. The rules are in docs/method.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from fp8rl_core.calibration.bapo import PUBLISHED, UpdateBoundsRule
from fp8rl_core.calibration.estimators import LowerEstimate
from fp8rl_core.calibration.tokens import BALANCE_RTOL, CalibrationTokens, _grid
from fp8rl_core.registry import Registry

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.method import CalibrationConfig


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


@CLIP_MODES.register("oracle")
def _mode_oracle(tok: CalibrationTokens, ctx: ModeContext) -> tuple[float, float, float, float, str]:
    """The oracle keeps the standard bounds and takes every token's clip decision on its BF16 ratio in the
    trainer (``fp8rl_core.config.clip_mode_kinds``); a calibration step records statistics only."""
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
