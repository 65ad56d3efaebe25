"""Drift signal, drift decisions and schedule replay against slow, obvious loops."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl_core.calibration import calibrate
from fp8rl_core.config import CalibrationConfig
from fp8rl_core.drift import Schedule, StepTokens, drift_decision, ks_distance, negative_ratios, replay

EPS_LOW, EPS_HIGH = 0.2, 0.28
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
    last, ref, prev_sig = None, None, None
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
                since >= sched.min_interval and prev_sig is not None and not math.isnan(prev_sig) and prev_sig > sched.threshold
            )
        neg = [float(r) for r, a, m in zip(rec.r8, rec.advantages, rec.mask) if m and a < 0]
        if cal:
            res = calibrate(rec.r8, rec.r16, rec.advantages, rec.mask, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                            config=config, previous=prev)
            prev, last, ref = (res.lower, res.upper), t, neg
        sig = _ks_slow(neg, ref) if ref is not None else float("nan")
        prev_sig = sig
        out.append((cal, sig, prev[0], prev[1]))
    return out


@pytest.mark.parametrize("sched", [
    Schedule("fixed", interval=1), Schedule("fixed", interval=3),
    Schedule("drift", threshold=0.08, min_interval=2, max_interval=6),
])
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
    drift = replay(recs, Schedule("drift", threshold=0.1, min_interval=2, max_interval=50),
                   eps_low=EPS_LOW, eps_high=EPS_HIGH, config=cfg)
    fired = [s for s, c in zip(drift.steps, drift.calibrated) if c]
    assert fired[0] == 1 and 10 in fired  # the first step after the shift (signal of step 9)
    assert all(s <= 12 for s in fired)  # a few catch-up recalibrations while L walks, then quiet
    assert every.bound_error(every) == (0.0, 0.0)
    assert drift.shadow_passes < every.shadow_passes


def test_negative_ratios_drops_masked_positive_and_nonfinite():
    r8 = torch.tensor([0.9, 1.1, float("nan"), 0.8, 1.2])
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, -1.0])
    mask = torch.tensor([True, True, True, True, False])
    assert negative_ratios(r8, adv, mask).tolist() == pytest.approx([0.9, 1.1])


def test_config_validates_intervals():
    with pytest.raises(ValueError):
        CalibrationConfig(schedule="drift", drift_min_interval=5, drift_max_interval=3)
    assert Schedule.from_config(CalibrationConfig(schedule="drift")).kind == "drift"
