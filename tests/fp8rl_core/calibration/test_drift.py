"""Drift signal, drift decisions and schedule replay against slow, obvious loops."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl_core.calibration.calibrated_clipping import calibrate
from fp8rl_core.calibration.drift import (
    Schedule,
    StepTokens,
    drift_decision,
    ks_distance,
    negative_ratios,
    quantile_shift,
    replay,
)
from fp8rl_core.config.method import CalibrationConfig
from tests.calibration_common import EPS_HIGH, EPS_LOW, STANDARD

pytestmark = pytest.mark.timeout(60)


def _ks_slow(x: list[float], y: list[float]) -> float:
    if not x or not y:
        return 0.0
    best = 0.0
    for v in x + y:
        fx = sum(1 for a in x if a <= v) / len(x)
        fy = sum(1 for b in y if b <= v) / len(y)
        best = max(best, abs(fx - fy))
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ks_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(57, generator=g) * 0.1 + 1.0
    y = torch.randn(41, generator=g) * 0.12 + 1.02
    y[:5] = x[:5]  # ties across the samples
    assert ks_distance(x, y) == pytest.approx(_ks_slow(x.tolist(), y.tolist()), abs=1e-12)
    assert ks_distance(x, x) == 0.0
    assert ks_distance(x, torch.empty(0)) == 0.0
    assert ks_distance(torch.zeros(3), torch.ones(4)) == 1.0


def _quantile_slow(x: list[float], alpha, lower: float) -> float:
    """By hand: sort, k = round(alpha n), the calibration's midpoint rule, distance to L."""
    if not x or alpha is None:
        return 0.0
    v = sorted(x)
    k = round(alpha * len(v))
    q = v[0] if k == 0 else v[-1] if k == len(v) else (v[k - 1] + v[k]) / 2
    return abs(q - lower)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantile_shift_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(83, generator=g) * 0.1)
    for alpha in (0.0, 0.004, 0.05, 0.37, 0.999, 1.0):
        for lower in (0.8, 0.95):
            assert quantile_shift(x, alpha, lower) == pytest.approx(_quantile_slow(x.tolist(), alpha, lower), abs=1e-12)
    assert quantile_shift(torch.empty(0), 0.1, 0.8) == 0.0 and quantile_shift(x, None, 0.8) == 0.0
    # hand values: 10 ratios 0.80, 0.81, ..., 0.89; alpha 0.2 -> k = 2 -> (0.81 + 0.82) / 2
    x = torch.tensor([0.80 + 0.01 * i for i in range(10)], dtype=torch.float64)
    assert quantile_shift(x, 0.2, 0.80) == pytest.approx(0.015)
    # the calibration's own rule: at its step, q(alpha) is the raw L it chose
    r16 = torch.exp(torch.randn(400, generator=g) * 0.15)
    r8 = r16 * torch.exp(torch.randn(400, generator=g) * 0.05)
    adv = -torch.ones(400)
    res = calibrate(
        r8,
        r16,
        adv,
        torch.ones(400, dtype=torch.bool),
        standard=STANDARD,
        config=CalibrationConfig(max_delta=1.0, lower_min=0.01),
    )
    assert quantile_shift(r8, res.alpha, res.raw_lower) == pytest.approx(0.0, abs=1e-6)


def test_drift_decision_rules():
    kw = dict(threshold=0.1, min_interval=2, max_interval=5)
    assert drift_decision(0.5, 1, **kw) is False  # too soon
    assert drift_decision(0.5, 2, **kw) is True
    assert drift_decision(0.1, 3, **kw) is False  # not strictly above
    assert drift_decision(None, 4, **kw) is False
    assert drift_decision(float("nan"), 4, **kw) is False
    assert drift_decision(0.0, 5, **kw) is True  # max interval forces it


def _records(n_steps: int, seed: int = 0, shift_at: int = 9, n: int = 2000) -> list[StepTokens]:
    """Synthetic diagnostic steps: the FP8 noise widens from ``shift_at`` on."""
    g = torch.Generator().manual_seed(seed)
    recs = []
    for t in range(1, n_steps + 1):
        r16 = torch.exp(torch.randn(n, generator=g) * 0.15)
        noise = 0.03 if t < shift_at else 0.25
        r8 = r16 * torch.exp(torch.randn(n, generator=g) * noise)
        adv = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0) * (0.5 + torch.rand(n, generator=g))
        mask = torch.rand(n, generator=g) < 0.95
        recs.append(StepTokens(t, r8, r16, adv, mask))
    return recs


def _replay_slow(recs, sched: Schedule, config: CalibrationConfig):
    """The obvious loop: per step, decide by hand, brute-force KS, full calibrate."""
    prev = (1 - EPS_LOW, 1 + EPS_HIGH)
    last, ref, prev_sig, alpha = None, None, None, None
    out = []
    for rec in recs:
        t = rec.step
        if sched.kind == "fixed":
            cal = (t - 1) % sched.interval == 0
        elif last is None:
            cal = True
        else:
            since = t - last
            cal = since >= sched.max_interval or (
                since >= sched.min_interval
                and prev_sig is not None
                and not math.isnan(prev_sig)
                and prev_sig > sched.threshold
            )
        neg = [float(r) for r, a, m in zip(rec.r8, rec.advantages, rec.mask) if m and a < 0]
        if cal:
            res = calibrate(
                rec.r8,
                rec.r16,
                rec.advantages,
                rec.mask,
                standard=STANDARD,
                config=config,
                previous=prev,
            )
            prev, last, ref = (res.lower, res.upper), t, neg
            alpha = res.alpha if not math.isnan(res.alpha) else alpha
        if cal:
            sig = 0.0
        elif ref is None:
            sig = float("nan")
        elif sched.signal == "quantile":
            sig = _quantile_slow(neg, alpha, prev[0])
        else:
            sig = _ks_slow(neg, ref)
        prev_sig = sig
        out.append((cal, sig, prev[0], prev[1]))
    return out


@pytest.mark.parametrize(
    "sched",
    [
        Schedule("fixed", interval=1),
        Schedule("fixed", interval=3),
        Schedule("drift", threshold=0.08, min_interval=2, max_interval=6),
        Schedule("drift", threshold=0.01, min_interval=2, max_interval=6, signal="quantile"),
    ],
)
def test_replay_matches_slow_loop(sched):
    recs = _records(14, n=300)
    cfg = CalibrationConfig()
    fast = replay(recs, sched, eps_low=EPS_LOW, eps_high=EPS_HIGH, config=cfg)
    slow = _replay_slow(recs, sched, cfg)
    assert fast.calibrated == [c for c, _, _, _ in slow]
    for s_fast, (_, s_slow, _, _) in zip(fast.signal, slow):
        assert (math.isnan(s_fast) and math.isnan(s_slow)) or s_fast == pytest.approx(s_slow, abs=1e-12)
    assert fast.lower == pytest.approx([lo for _, _, lo, _ in slow])
    assert fast.upper == pytest.approx([hi for _, _, _, hi in slow])
    assert fast.shadow_passes == sum(c for c, _, _, _ in slow)


def test_drift_fires_on_the_shift_and_scores():
    recs = _records(20, shift_at=9)
    cfg = CalibrationConfig()
    every = replay(recs, Schedule("fixed", interval=1), eps_low=EPS_LOW, eps_high=EPS_HIGH, config=cfg)
    drift = replay(
        recs,
        Schedule("drift", threshold=0.1, min_interval=2, max_interval=50),
        eps_low=EPS_LOW,
        eps_high=EPS_HIGH,
        config=cfg,
    )
    fired = [s for s, c in zip(drift.steps, drift.calibrated) if c]
    assert fired[0] == 1 and 10 in fired  # the first step after the shift (signal of step 9)
    assert all(s <= 12 for s in fired)  # a few catch-up recalibrations while L walks, then quiet
    assert every.bound_error(every) == (0.0, 0.0)
    assert drift.shadow_passes < every.shadow_passes


def test_quantile_drift_fires_on_the_shift():
    """The quantile signal reads in L's units: it stays under 0.02 while the FP8 noise is steady and
    fires on the widening (L would move by ~0.1), then goes quiet once L has caught up."""
    recs = _records(20, shift_at=9)
    cfg = CalibrationConfig()
    kw = dict(eps_low=EPS_LOW, eps_high=EPS_HIGH, config=cfg)
    every = replay(recs, Schedule("fixed", interval=1), **kw)
    drift = replay(recs, Schedule("drift", threshold=0.02, min_interval=2, max_interval=50, signal="quantile"), **kw)
    fired = [s for s, c in zip(drift.steps, drift.calibrated) if c]
    assert fired[0] == 1 and fired[1] == 10, fired  # quiet while steady; the first step after the shift (signal of 9)
    assert 12 in fired and 14 in fired  # L walking under the 0.05 step cap keeps the signal up: catch-up recalibrations
    assert max(sig for s, sig in zip(drift.steps, drift.signal) if 2 <= s <= 8) < 0.02
    assert drift.signal[drift.steps.index(9)] > 0.05
    assert drift.shadow_passes < every.shadow_passes
    fixed = replay(recs, Schedule("fixed", interval=10), **kw)
    assert sum(drift.bound_error(every)) < sum(fixed.bound_error(every))


def test_negative_ratios_drops_masked_positive_and_nonfinite():
    r8 = torch.tensor([0.9, 1.1, float("nan"), 0.8, 1.2])
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, -1.0])
    mask = torch.tensor([True, True, True, True, False])
    assert negative_ratios(r8, adv, mask).tolist() == pytest.approx([0.9, 1.1])


def test_config_validates_intervals():
    with pytest.raises(ValueError):
        CalibrationConfig(schedule="drift", drift_min_interval=5, drift_max_interval=3)
    assert Schedule.from_config(CalibrationConfig(schedule="drift")).kind == "drift"


def test_live_quantile_signal_reads_the_checkpointed_state():
    """The train stage's quantile signal uses only the calibrator state (alpha, L), which checkpoints carry;
    an old checkpoint without alpha loads (the signal is then 0 until the next calibration)."""
    from types import SimpleNamespace

    from conftest import micro_config

    from fp8rl_core.calibration.calibrated_clipping import CalibratorState
    from stages.schedule.shadow import drift_metrics

    env = SimpleNamespace(cfg=micro_config("calibration.schedule=drift", "calibration.drift_signal=quantile"))
    g = torch.Generator().manual_seed(3)
    r8 = torch.exp(torch.randn(6, 20, generator=g) * 0.1)
    adv = torch.randn(6, generator=g)[:, None].expand(6, 20)
    mask = torch.rand(6, 20, generator=g) < 0.9
    cal = CalibratorState(0.8, 1.28, 1, 4, alpha=0.05)
    assert CalibratorState.from_dict(cal.to_dict()) == cal
    state = SimpleNamespace(calibrator=cal)
    want = _quantile_slow(
        [float(x) for x, a, m in zip(r8.flatten(), adv.flatten(), mask.flatten()) if m and a < 0], 0.05, 0.8
    )
    assert (
        drift_metrics(env, state, 5, r8, adv, mask, False)["drift_signal"] == pytest.approx(want, abs=1e-12)
        and want > 0
    )
    assert drift_metrics(env, state, 5, r8, adv, mask, True) == {"drift_signal": 0.0}
    old = CalibratorState.from_dict({"lower": 0.8, "upper": 1.28, "n_calibrations": 1, "last_step": 4})
    assert old.alpha is None and drift_metrics(env, SimpleNamespace(calibrator=old), 5, r8, adv, mask, False) == {
        "drift_signal": 0.0
    }
    assert drift_metrics(env, SimpleNamespace(calibrator=CalibratorState(0.8, 1.28)), 1, r8, adv, mask, False) == {}
