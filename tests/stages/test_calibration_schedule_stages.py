"""Drift schedule, subsampled shadow passes, GSPO calibration and the noise columns, through the micro
campaign's stages."""

from __future__ import annotations

import math

import pytest
from conftest import micro_config, open_micro_run

from stages.calibrate import run_calibrate
from stages.rollout import run_rollout
from stages.runtime.io import read_step
from stages.score import run_score
from stages.train import run_train


@pytest.mark.timeout(600)
def test_drift_subsample_and_gspo_through_the_stages(tmp_path):
    cfg = micro_config(
        "algorithm.loss=gspo",
        "algorithm.eps_low=3e-4",
        "algorithm.eps_high=4e-4",
        "algorithm.loss_agg=seq-mean-token-mean",
        # the micro model never answers right: length shaping gives the groups' rewards a spread (advantages != 0)
        "algorithm.overlong_shaping=true",
        "algorithm.overlong_max_len=12",
        "algorithm.overlong_cache_len=10",
        "calibration.schedule=drift",
        "calibration.drift_threshold=1e-9",
        "calibration.drift_min_interval=2",
        "calibration.drift_max_interval=50",
        "calibration.shadow_target_error=0.9",
        "calibration.shadow_min_sequences=4",
    )
    env, state = open_micro_run(tmp_path, cfg)
    shadows = []
    try:
        for step in (1, 2, 3):
            _, state = run_rollout(env, state, step)
            _, state = run_score(env, state, step)
            out, state = run_train(env, state, step)
            m = out["metrics"]
            shadows.append(m["shadow"])
            if m["shadow"]:
                _, state = run_calibrate(env, state, step)
            if step == 2:
                assert m["drift_signal"] > 0
    finally:
        env.close()
    ctx = env
    # step 1 always; step 2 too soon (min interval 2); step 3 on step 2's drift signal
    assert shadows == [1.0, 0.0, 1.0]
    tok = read_step(ctx, "token_stats", 1).to_pandas()
    per_seq = tok.groupby("sample_id")["logp_bf16"].apply(lambda s: s.notna().all() or s.isna().all())
    assert per_seq.all()  # whole sequences are shadowed or not
    shadowed = tok.groupby("sample_id")["logp_bf16"].apply(lambda s: s.notna().all())
    assert 4 <= shadowed.sum() < len(shadowed)  # a real subset
    b = read_step(ctx, "bounds", 1).to_pylist()[0]
    assert b["shadow_sequences"] == shadowed.sum() and b["total_sequences"] == len(shadowed)
    assert math.isfinite(b["lower_error_bound"]) and b["lower_error_bound"] >= b["lower_error_bootstrap"] >= 0
    # GSPO: sequence-level bounds on GSPO's own scale
    assert 0.9994 <= b["lower"] <= 1.0 and 1.0 <= b["upper"] <= 1.0012 and b["tokens"] == shadowed.sum()
    s1 = read_step(ctx, "steps", 1).to_pylist()[0]
    for k in ("ratio_noise_nmae", "tis_weight_nmae", "rollout_bf16_prob_nmae", "rollout_fp8_prob_nmae"):
        assert math.isfinite(s1[k]) and s1[k] >= 0
    assert math.isfinite(s1["prob_nmae"])  # shadow metrics restricted to the shadowed rows, not NaN
