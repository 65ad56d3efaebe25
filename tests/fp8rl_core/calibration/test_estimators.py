"""Raw-L estimators (fp8rl_core.calibration.estimators): each against a slow reference loop, the
Harrell-Davis interval's coverage, the pool across a checkpoint, and a micro campaign."""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

from fp8rl_core.calibration.calibrated_clipping import CalibratorState, calibrate
from fp8rl_core.calibration.estimators import LOWER_ESTIMATORS, betainc, harrell_davis, hd_interval
from fp8rl_core.config.method import CalibrationConfig
from tests.calibration_common import EPS_HIGH, EPS_LOW, STANDARD


def _step_batch(gen: torch.Generator, n: int = 300, spread: float = 0.15):
    """Random A<0/A>0 tokens whose BF16 ratios clip a few percent below 1 - eps_low."""
    r16 = torch.exp(torch.randn(n, generator=gen, dtype=torch.float64) * spread)
    r8 = r16 * torch.exp(torch.randn(n, generator=gen, dtype=torch.float64) * 0.05)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    return r8, r16, adv, torch.ones(n, dtype=torch.bool)


def _ref_midpoint(vals: list[float], k: int) -> float:
    v = sorted(vals)
    if k <= 0:
        return v[0]
    if k >= len(v):
        return v[-1] + 1e-6
    return (v[k - 1] + v[k]) / 2


def _ref_pool_mean(steps: list[tuple[list[float], int]]) -> float:
    """Slow reference of the level-aligned pool: pooled level, each step's own quantile, n-weighted mean."""
    total_n = 0
    total_k = 0
    for vals, k in steps:
        total_n += len(vals)
        total_k += k
    level = total_k / total_n
    acc = 0.0
    for vals, _ in steps:
        acc += _ref_midpoint(vals, round(level * len(vals))) * len(vals)
    return acc / total_n


def _negatives(r8, r16, adv):
    neg = adv < 0
    return r8[neg].tolist(), int((r16[neg] < 1 - EPS_LOW).sum())


def _run_steps(cfg: CalibrationConfig, n_steps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    state = CalibratorState.initial(eps_low=EPS_LOW, eps_high=EPS_HIGH, config=cfg)
    history, out = [], []
    for step in range(1, n_steps + 1):
        r8, r16, adv, mask = _step_batch(
            gen, n=int(torch.randint(50, 400, (1,), generator=gen)), spread=0.05 + 0.02 * step
        )
        res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg, previous=state)
        state = state.updated(res, step)
        history.append(_negatives(r8, r16, adv))
        out.append((res, list(history)))
    return out, state


def test_default_estimator_is_the_papers_rule():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        r8, r16, adv, mask = _step_batch(gen)
        res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=CalibrationConfig())
        vals, k = _negatives(r8, r16, adv)
        assert res.estimator == "quantile" and res.pooled_steps == 1 and res.lower_ci_low is None
        assert res.raw_lower == pytest.approx(_ref_midpoint(vals, k), abs=1e-15)
        assert res.shadow_tokens == len(adv)


@pytest.mark.parametrize("window", [1, 3, 5])
def test_pooled_against_reference(window):
    cfg = CalibrationConfig(estimator="pooled", estimator_window=window)
    out, state = _run_steps(cfg, 8, seed=window)
    for res, history in out:
        used = history[-window:]
        assert res.pooled_steps == len(used)
        assert res.raw_lower == pytest.approx(_ref_pool_mean(used), rel=1e-12)
        assert res.lower_level == pytest.approx(sum(k for _, k in used) / sum(len(v) for v, _ in used))
    assert len(state.pool) == window - 1


@pytest.mark.parametrize("min_clipped", [1, 8, 40])
def test_k_floor_against_reference(min_clipped):
    window = 6
    cfg = CalibrationConfig(estimator="k_floor", estimator_window=window, estimator_min_clipped=min_clipped)
    out, _ = _run_steps(cfg, 9, seed=min_clipped)
    widened = 0
    for res, history in out:
        used = [history[-1]]
        earlier = history[-window:-1]
        while sum(k for _, k in used) < min_clipped and earlier:
            used.insert(0, earlier.pop())
        widened += len(used) > 1
        assert res.pooled_steps == len(used)
        assert res.raw_lower == pytest.approx(_ref_pool_mean(used), rel=1e-12)
    assert widened > 0 or min_clipped == 1


def _ref_hd(vals: list[float], p: float, grid: int = 20000) -> float:
    """Harrell-Davis by numerical integration of the Beta density, one order statistic at a time."""
    n = len(vals)
    a, b = p * (n + 1), (1 - p) * (n + 1)
    logc = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
    v = sorted(vals)
    est = 0.0
    for i in range(n):
        lo, hi = i / n, (i + 1) / n
        h = (hi - lo) / grid
        w = 0.0
        for j in range(grid):  # midpoint rule
            x = lo + (j + 0.5) * h
            w += math.exp(logc + (a - 1) * math.log(x) + (b - 1) * math.log1p(-x)) * h
        est += w * v[i]
    return est


def test_harrell_davis_against_reference():
    gen = torch.Generator().manual_seed(3)
    r8, r16, adv, mask = _step_batch(gen, n=120, spread=0.3)
    cfg = CalibrationConfig(estimator="harrell_davis")
    res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg)
    vals, k = _negatives(r8, r16, adv)
    assert k > 0
    assert res.raw_lower == pytest.approx(_ref_hd(vals, k / len(vals)), rel=1e-6)
    assert res.lower_ci_low < res.raw_lower < res.lower_ci_high
    x = np.linspace(0, 1, 11)  # I_x(2, 3) = 1 - (1-x)^3 (1 + 3x)
    assert np.allclose(betainc(2.0, 3.0, x), 1 - (1 - x) ** 3 * (1 + 3 * x), atol=1e-13)
    none = calibrate(r8, torch.ones_like(r16), adv, mask, standard=STANDARD, config=cfg)
    assert none.lower_ci_low is None and none.raw_lower == min(vals)  # k = 0: the paper's v1


@pytest.mark.parametrize("dist", ["lognormal", "student_t"])
def test_hd_interval_coverage(dist):
    """Nominal 90% within +-5 points over 1,000 draws, on ratio distributions with known quantiles."""
    rng = np.random.default_rng(7)
    cases = [(400, 0.02), (800, 0.01), (500, 0.05)]
    for n, p in cases:
        if dist == "lognormal":
            x = np.exp(rng.normal(0.0, 0.15, (1000, n)))
            q = math.exp(0.15 * NormalDist().inv_cdf(p))
        else:  # 1 + 0.1 t_4: the t_4 quantile in closed form
            x = 1 + 0.1 * rng.standard_t(4, (1000, n))
            a = 4 * p * (1 - p)
            t = math.sqrt(4 / math.sqrt(a) * math.cos(math.acos(math.sqrt(a)) / 3) - 4)
            q = 1 - 0.1 * t
        lo, hi = hd_interval(np.sort(x, axis=1), p, 0.9)
        cover = float(((lo <= q) & (q <= hi)).mean())
        assert 0.85 <= cover <= 0.95, (dist, n, p, cover)
        assert abs(float(np.median(harrell_davis(np.sort(x, axis=1), p))) - q) < 0.02


def test_pool_survives_a_checkpoint(tmp_path):
    """The calibrator state (pool included) through a checkpoint's state.json: a resumed run pools as the
    uninterrupted one."""
    from storage.checkpoints.store import CheckpointState, load_checkpoint, save_checkpoint

    cfg = CalibrationConfig(estimator="pooled", estimator_window=4)
    out, state = _run_steps(cfg, 5, seed=11)
    path = save_checkpoint(tmp_path, 5, rng_state=False, state=CheckpointState(calibrator_state=state.to_dict()))
    restored = CalibratorState.from_dict(load_checkpoint(path, restore_rng=False).calibrator_state)
    assert json.loads((path / "state.json").read_text())["calibrator_state"]["pool"][0]["ratios"]
    assert restored == state and len(restored.pool) == 3
    gen = torch.Generator().manual_seed(99)
    batch = _step_batch(gen)
    a = calibrate(*batch, standard=STANDARD, config=cfg, previous=state)
    b = calibrate(*batch, standard=STANDARD, config=cfg, previous=restored)
    assert a == b and a.pooled_steps == 4
    old = CalibratorState.from_dict({"lower": 0.8, "upper": 1.28, "n_calibrations": 1, "last_step": 4})
    assert old.pool == ()  # checkpoints written before the pool existed still load


def test_unknown_estimator_is_named():
    from conftest import micro_config

    from flows.campaign.configuration import ConfigError

    msg = r"calibration.estimator: unknown lower-bound estimator 'median_of_means'.*k_floor"
    with pytest.raises(ConfigError, match=msg):
        micro_config("calibration.estimator=median_of_means")
    assert set(LOWER_ESTIMATORS.names()) == {"quantile", "pooled", "k_floor", "harrell_davis"}


@pytest.mark.timeout(300)
def test_micro_campaign_writes_the_interval(tmp_path):
    from conftest import micro_config, open_micro_run

    from stages.calibrate import run_calibrate
    from stages.rollout import run_rollout
    from stages.runtime.io import read_step
    from stages.score import run_score
    from stages.train import run_train

    # a tiny eps_low makes BF16 clip some A<0 tokens (k > 0); length shaping gives advantages a spread
    cfg = micro_config(
        "calibration.estimator=harrell_davis",
        "calibration.interval=1",
        "algorithm.eps_low=0.001",
        "algorithm.overlong_shaping=true",
        "algorithm.overlong_max_len=12",
        "algorithm.overlong_cache_len=10",
    )
    env, state = open_micro_run(tmp_path, cfg)
    try:
        for step in (1, 2):
            _, state = run_rollout(env, state, step)
            _, state = run_score(env, state, step)
            _, state = run_train(env, state, step)
            _, state = run_calibrate(env, state, step)
        rows = [read_step(env, "bounds", s).to_pylist()[0] for s in (1, 2)]
    finally:
        env.close()
    for b in rows:
        assert b["estimator"] == "harrell_davis" and b["pooled_steps"] == 1 and b["estimator_shadow_tokens"] > 0
    with_ci = [b for b in rows if b["lower_ci_low"] is not None]
    assert with_ci, rows
    for b in with_ci:
        assert b["lower_ci_low"] <= b["raw_lower"] <= b["lower_ci_high"] and 0 < b["lower_level"] < 1


def _replay_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[3] / "benchmarks" / "schedule_replay.py"
    spec = importlib.util.spec_from_file_location("schedule_replay", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_replay_scores_predictive_clip_share_error():
    """Same tokens every step: the unsmoothed paper's L clips exactly BF16's count on the next step (error 0);
    the smoothed L walks from 0.8 and misses it first; the spent shadow tokens follow K."""
    from fp8rl_core.calibration.drift import StepTokens

    mod = _replay_module()
    gen = torch.Generator().manual_seed(5)
    _, r16, adv, mask = _step_batch(gen, n=400, spread=0.3)
    r8 = r16**2  # FP8's spread twice BF16's: its L sits far below 0.8
    recs = [StepTokens(s, r8, r16, adv, mask) for s in range(1, 11)]
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, dual_clip=3.0)
    raw = mod.replay_estimator(recs, CalibrationConfig(max_delta=1.0), 1, **kw)
    smooth = mod.replay_estimator(recs, CalibrationConfig(max_delta=0.01), 1, **kw)
    assert raw["error"] == 0.0 and smooth["error"] > 0.0
    every5 = mod.replay_estimator(recs, CalibrationConfig(estimator="pooled"), 5, **kw)
    assert raw["spent"] == 10 * 400 and every5["spent"] == 2 * 400 and every5["calibrations"] == 2
    assert every5["per_estimate"] == (400 + 800) / 2  # the second estimate pools the first step's tokens


def test_bounds_written_before_the_estimator_columns_read_with_nulls(tmp_path):
    import pyarrow as pa
    from integrity_helpers import write_old_part

    from storage.queries.catalog import connect
    from storage.run.layout import create_run

    run_dir = create_run(tmp_path / "runs", "r1", config={"seed": 0}).root
    old = pa.table(
        {
            "run_id": ["r1"],
            "step": pa.array([1], pa.int64()),
            "variant": ["main"],
            "mode": ["calibrated"],
            "raw_lower": [0.7],
            "lower": [0.75],
            "upper": [1.3],
        }
    )
    write_old_part(run_dir, "bounds", "calibrate", old)
    sql = "SELECT lower, estimator, lower_ci_low, lower_ci_high, pooled_steps FROM bounds"
    rows = connect(run_dir).sql(sql).fetchall()
    assert rows == [(0.75, None, None, None, None)]
