"""Calibrate stage: re-derive the FP8 clip bounds from the step's shadow-pass tokens.

Reads the calibration step's ``token_stats`` (every token, with FP8 and BF16
log-probs of π_θ and π_old), forms r8 and r16 exactly as the loss does
(``exp(clamp(Δlogp, −20, 20))``), calls :func:`fp8rl_core.calibration.calibrated_clipping.calibrate`
in the configured mode, writes one ``bounds`` row, and moves the calibrator
state forward: the new (L, H) are in force from step t+1. With
``algorithm.correction.calibrate: true`` the mismatch correction's
thresholds are re-set on the same tokens (:func:`fp8rl_core.objective.corrections.calibrate_correction`),
recorded in the row's ``correction_*`` columns and in force from step t+1 too.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from fp8rl_core.calibration.calibrated_clipping import StandardClip, calibrate
from fp8rl_core.objective.losses import importance_ratio
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
    from fp8rl_core.objective.losses import tis_weights

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


def _rollout_logp(env: RunEnv, step: int, tok) -> np.ndarray:
    """The rollout engine's log-prob of every ``token_stats`` row (from the ``rollouts`` table)."""
    rows = read_step(env, "rollouts", step)
    by_id = dict(zip(rows.column("sample_id").to_pylist(), rows.column("rollout_logp").to_pylist()))
    sid, pos = tok.column("sample_id").to_pylist(), tok.column("position").to_pylist()
    return np.array([by_id[s][p] for s, p in zip(sid, pos)], dtype=np.float32)


def _as_rows(tok, columns: dict[str, np.ndarray], keep: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``[B, T]`` float32 tensors of per-token ``columns`` (one row per sample, column = position) and the mask of
    the ``keep`` tokens, so sequence-level corrections see whole sequences."""
    sid, pos = tok.column("sample_id").to_numpy(), tok.column("position").to_numpy().astype(np.int64)
    _, row = np.unique(sid, return_inverse=True)
    shape = (int(row.max()) + 1 if row.size else 0, int(pos.max()) + 1 if pos.size else 0)
    out = {}
    for name, values in columns.items():
        t = np.zeros(shape, dtype=np.float32)
        t[row, pos] = np.nan_to_num(values.astype(np.float32))
        out[name] = torch.from_numpy(t)
    mask = np.zeros(shape, dtype=bool)
    mask[row, pos] = keep
    return out, torch.from_numpy(mask)


def _correction_columns(env: RunEnv, step: int, tok, col: dict, shadowed: np.ndarray) -> tuple[dict, tuple | None]:
    """The ``bounds`` row's ``correction_*`` columns and the thresholds to put in force (None: not calibrated)."""
    from fp8rl_core.objective.corrections import calibrate_correction

    a = env.cfg.algorithm
    names = ("lower", "upper", "reference_lower", "reference_upper", "units", "outside_share_bf16",
             "outside_share_fp8_before", "outside_share_fp8_after")
    row = {"correction": [a.correction.mode if a.tis else None], **{f"correction_{n}": [None] for n in names}}
    if not (a.tis and a.correction.calibrate):
        return row, None
    t, mask = _as_rows(tok, {"old8": col["old_logp_fp8"], "old16": col["old_logp_bf16"],
                             "rollout": _rollout_logp(env, step, tok)}, shadowed)
    res = calibrate_correction(t["old8"], t["old16"], t["rollout"], mask, a)
    row.update({f"correction_{n}": [getattr(res, n)] for n in names})
    return row, (res.lower, res.upper)


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
        standard=StandardClip(cfg.algorithm.eps_low, cfg.algorithm.eps_high, cfg.algorithm.dual_clip),
        config=cal_cfg,
        previous=state.calibrator,
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
    correction_row, thresholds = _correction_columns(env, step, tok, col, shadowed)
    row.update(correction_row)
    path = env.writer.write("bounds", step, row, stage="calibrate", attempt=attempt, variant=env.variant)
    calibrator = state.calibrator.updated(res, step)
    if thresholds is not None:
        calibrator = dataclasses.replace(calibrator, correction=thresholds)
    seconds = time.perf_counter() - t0
    info = {"lower": res.lower, "upper": res.upper, "alpha": res.alpha, "calibrator": calibrator.to_dict()}
    result = StageResult(outputs=[str(path)], seconds=seconds, info=info)
    return result, dataclasses.replace(state, calibrator=calibrator)
