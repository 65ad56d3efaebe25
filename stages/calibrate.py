"""Calibrate stage: re-derive the FP8 clip bounds from the step's shadow-pass tokens.

Reads the calibration step's ``token_stats`` (every token, with FP8 and BF16
log-probs of π_θ and π_old), forms r8 and r16 exactly as the loss does
(``exp(clamp(Δlogp, −20, 20))``), calls :func:`fp8rl_core.calibration.calibrate`
in the configured mode, writes one ``bounds`` row, and moves the calibrator
state forward: the new (L, H) are in force from step t+1.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from fp8rl_core.calibration import calibrate
from fp8rl_core.losses import importance_ratio
from fp8rl_core.registered import CALIBRATION_UNITS
from stages.context import RunEnv, TrainState
from stages.result import StageResult
from stages.runtime.io import read_step
from stages.schedule.shadow import subsample_columns


def _ratio(logp: np.ndarray, old: np.ndarray) -> torch.Tensor:
    return importance_ratio(torch.from_numpy(logp.astype(np.float32)), torch.from_numpy(old.astype(np.float32)))


def _tis_weights(env: RunEnv, step: int, tok, old_logp_fp8: np.ndarray) -> torch.Tensor:
    """Per-token TIS weights min(exp(old_logp_fp8 - rollout_logp), C), as the loss applies them
    (all ones with ``algorithm.tis`` off): rollout log-probs come from the ``rollouts`` table."""
    from fp8rl_core.losses import tis_weights

    if not env.cfg.algorithm.tis:
        return torch.ones(len(old_logp_fp8), dtype=torch.float32)
    rows = read_step(env, "rollouts", step)
    by_id = dict(zip(rows.column("sample_id").to_pylist(), rows.column("rollout_logp").to_pylist()))
    sid = tok.column("sample_id").to_pylist()
    pos = tok.column("position").to_pylist()
    rollout = np.array([by_id[s][p] for s, p in zip(sid, pos)], dtype=np.float32)
    return tis_weights(
        torch.from_numpy(old_logp_fp8.astype(np.float32)), torch.from_numpy(rollout), cap=env.cfg.algorithm.tis_cap
    )


def run_calibrate(env: RunEnv, state: TrainState, step: int, *, attempt: int = 0) -> tuple[StageResult, TrainState]:
    """Calibrate on ``step``'s tokens; write ``bounds``; return the state with the moved calibrator."""
    t0 = time.perf_counter()
    cfg = env.cfg
    tok = read_step(env, "token_stats", step)
    if tok.column("logp_bf16").null_count == tok.num_rows:
        raise ValueError(f"step {step}: token_stats has no BF16 shadow log-probs; calibration needs a shadow step")
    col = {
        name: tok.column(name).to_numpy(zero_copy_only=False)
        for name in ("logp_fp8", "old_logp_fp8", "logp_bf16", "old_logp_bf16", "advantage")
    }
    shadowed, sub_cols = subsample_columns(col, tok.column("sample_id").to_numpy(), cfg, step)
    r8 = _ratio(col["logp_fp8"], col["old_logp_fp8"])
    r16 = _ratio(np.nan_to_num(col["logp_bf16"]), np.nan_to_num(col["old_logp_bf16"]))
    adv = torch.from_numpy(col["advantage"].astype(np.float32))
    mask = torch.from_numpy(shadowed)  # every token, or the subsampled shadow's
    cal_cfg = cfg.calibration
    weights = _tis_weights(env, step, tok, col["old_logp_fp8"]) if cfg.calibration.tis_weighted_balance else None
    units = CALIBRATION_UNITS.get(cfg.algorithm.loss)  # the units the loss clips: None = tokens
    if units is not None:  # e.g. GSPO's sequence ratios, on their own grid
        r8, r16, adv, mask, cal_cfg = units(col, tok.column("sample_id").to_numpy(), mask, cfg.calibration)
        weights = None  # not tokens: no per-token TIS weighting
    res = calibrate(
        r8,
        r16,
        adv,
        mask,
        eps_low=cfg.algorithm.eps_low,
        eps_high=cfg.algorithm.eps_high,
        config=cal_cfg,
        previous=state.calibrator,
        dual_clip=cfg.algorithm.dual_clip,
        weights=weights,
    )
    row = {
        "mode": [res.mode],
        "alpha": [res.alpha],
        "raw_lower": [res.raw_lower],
        "raw_upper": [res.raw_upper],
        "lower": [res.lower],
        "upper": [res.upper],
        "target_balance": [res.target_balance],
        "balance_before": [res.balance_before],
        "balance_after": [res.balance_after],
        "balance_applied": [res.balance_applied],
        "previous_lower": [res.previous_lower],
        "previous_upper": [res.previous_upper],
        "lower_clip_share_neg_before": [res.lower_clip_share_fp8_before],
        "lower_clip_share_neg_after": [res.lower_clip_share_fp8_after],
        "lower_clip_share_neg_applied": [res.lower_clip_share_fp8_applied],
        "lower_clip_share_neg_bf16": [res.lower_clip_share_bf16],
        "upper_clip_share_pos_before": [res.upper_clip_share_fp8_before],
        "upper_clip_share_pos_after": [res.upper_clip_share_fp8_after],
        "upper_clip_share_pos_bf16": [res.upper_clip_share_bf16],
        "tokens": [res.n_tokens],
        "negative_tokens": [res.n_negative],
        "nonfinite_tokens": [res.n_nonfinite],
        "status": [res.status],
        "estimator": [res.estimator],
        "lower_level": [res.lower_level],
        "lower_ci_low": [res.lower_ci_low],
        "lower_ci_high": [res.lower_ci_high],
        "estimator_shadow_tokens": [res.shadow_tokens],
        "pooled_steps": [res.pooled_steps],
        **{k: [v] for k, v in sub_cols.items()},
    }
    path = env.writer.write("bounds", step, row, stage="calibrate", attempt=attempt, variant=env.variant)
    calibrator = state.calibrator.updated(res, step)
    seconds = time.perf_counter() - t0
    info = {"lower": res.lower, "upper": res.upper, "alpha": res.alpha, "calibrator": calibrator.to_dict()}
    return StageResult(outputs=[str(path)], seconds=seconds, info=info), state.replace(calibrator=calibrator)
