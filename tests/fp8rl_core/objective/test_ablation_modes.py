"""The paper's comparison cells run through the real train stage (tiny model, one step).

BAPO as published re-picks its bounds before every update and records them in
``steps``; CISPO takes its cap from the loss registry (no special case in the
trainer); relaxed_lower trains with its wider fixed lower bound from step 1
while the diagnostics stay measured against the standard eps_low.
"""

from __future__ import annotations

import math

import pytest
from conftest import micro_config, open_micro_run

from fp8rl_core.objective.losses import loss_bounds
from stages.rollout import run_rollout
from stages.runtime.io import read_step
from stages.score import run_score
from stages.train import run_train

pytestmark = pytest.mark.timeout(1200)  # the first test of a session bootstraps the micro model


def _train_one_step(tmp_path, *overrides):
    cfg = micro_config("precision.train=fp8_tensorwise", *overrides)
    env, state = open_micro_run(tmp_path, cfg)
    try:
        _, state = run_rollout(env, state, 1)
        _, state = run_score(env, state, 1)
        out, state = run_train(env, state, 1)
    finally:
        env.close()
    return cfg, env, out


def test_bapo_per_update_bounds_reach_the_steps_row(tmp_path):
    # two mini-batches, two epochs: four updates, each with its own bounds
    cfg, ctx, out = _train_one_step(
        tmp_path,
        "calibration.mode=bapo",
        "algorithm.ppo_epochs=2",
        "algorithm.ppo_mini_batch_size=16",
        "algorithm.micro_batch_size=8",
    )
    m = out["metrics"]
    b = cfg.calibration.bapo
    for side, (lo, hi) in (("lower", (b.lower_start, b.lower_max)), ("upper", (b.upper_start, b.upper_max))):
        assert lo <= m[f"bapo_{side}_min"] <= m[f"bapo_{side}_mean"] <= m[f"bapo_{side}_max"] <= hi + 1e-12
    assert 0.0 <= m["bapo_rho_min"] <= m["bapo_rho_max"] <= 1.0 and m["bapo_iterations_mean"] >= 0
    assert m["updates"] == 4
    steps = read_step(ctx, "steps", 1).to_pylist()[0]
    assert steps["bapo_rho_mean"] == pytest.approx(m["bapo_rho_mean"])
    assert math.isfinite(m["clipfrac_lower"])
    # token_stats carry each row's own (epoch-0) bounds, so the clip flags and over-clipping use them
    tok = read_step(ctx, "token_stats", 1).to_pandas()
    lows = tok.groupby("minibatch")["lower_bound"].agg(["min", "max"])
    assert (lows["min"] == lows["max"]).all()
    assert (
        m["bapo_lower_min"] - 1e-6 <= tok["lower_bound"].min() <= tok["lower_bound"].max() <= m["bapo_lower_max"] + 1e-6
    )


def test_cispo_cap_comes_from_the_registry(tmp_path):
    cfg = micro_config("algorithm.loss=cispo")
    assert loss_bounds("cispo", 0.8, 1.28, cfg.algorithm) == (0.0, pytest.approx(1.2))
    assert loss_bounds("ppo", 0.8, 1.28, cfg.algorithm) == (0.8, 1.28)
    with pytest.raises(Exception, match="unknown policy loss 'cispoo'"):
        micro_config("algorithm.loss=cispoo")
    from pathlib import Path

    import stages.trainer

    trainer = sorted(Path(stages.trainer.__file__).parent.glob("*.py"))
    assert len(trainer) > 5 and not [p.name for p in trainer if '"cispo"' in p.read_text()]  # no loss special-cased
    _, _, out = _train_one_step(tmp_path, "algorithm.loss=cispo")
    assert math.isfinite(out["metrics"]["loss"]) and out["metrics"]["skipped_updates"] == 0


def test_relaxed_lower_trains_at_its_wider_bound_from_step_one(tmp_path):
    _, ctx, out = _train_one_step(tmp_path, "calibration.mode=relaxed_lower", "calibration.relaxed_eps_low=0.4")
    assert out["metrics"]["lower_bound"] == pytest.approx(0.6)
    tok = read_step(ctx, "token_stats", 1).to_pandas()
    assert (tok["lower_bound"].round(6) == 0.6).all() and (tok["standard_lower"].round(6) == 0.8).all()
