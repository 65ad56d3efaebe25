"""Calibrated Clipping: hand-computed values, a loop reference, the paper's properties."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl_core.calibration.calibrated_clipping import (
    CalibratorState,
    balance,
    calibrate,
    pos_neg_contrib,
)
from fp8rl_core.calibration.clip_modes import CLIP_MODES
from fp8rl_core.calibration.tokens import BALANCE_RTOL
from fp8rl_core.config.method import CalibrationConfig
from storage.tables.schemas import BOUNDS_HEADLINE
from tests.calibration_common import EPS_HIGH, EPS_LOW, STANDARD


def _hand_batch(dtype=torch.float64):
    #          negatives (|A| = 1)        positives (A = 1)
    r8 = torch.tensor([0.5, 0.7, 0.9, 1.1, 1.0, 1.2, 1.5], dtype=dtype)
    r16 = torch.tensor([0.7, 0.9, 0.95, 1.0, 1.0, 1.1, 1.2], dtype=dtype)
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 1.0], dtype=dtype)
    return r8, r16, adv, torch.ones(7, dtype=torch.bool)


def test_calibrated_hand_computed():
    res = calibrate(*_hand_batch(), standard=STANDARD, config=CalibrationConfig())
    # BF16 clips 1 of 4 negatives (0.7 < 0.8): k = 1, L = (0.5 + 0.7) / 2
    assert res.alpha == res.lower_clip_share_bf16 == 0.25
    assert res.raw_lower == pytest.approx(0.6)
    # target = Pos16(1.28) / Neg16(0.8) = 3.3 / 2.85; Neg8(0.6) = 2.7, Pos8 = 1.0 | 2.2 | 3.7 at 1.2, 1.5
    assert res.target_balance == pytest.approx(3.3 / 2.85)
    # H is searched against the smoothed L = 0.75 (Neg8 = 0.9 + 1.1 = 2.0): Pos8 >= 1.158 * 2.0 first at 1.5
    assert res.raw_upper == 1.5
    assert res.balance_after == pytest.approx(2.2 / 2.0)  # at the bounds in force (0.75, 1.33)
    assert res.balance_before == pytest.approx(2.2 / 2.0)  # previous (0.8, 1.28): Neg8 = 0.9 + 1.1
    # smoothing by 0.05 from (0.8, 1.28)
    assert (res.lower, res.upper) == (pytest.approx(0.75), pytest.approx(1.33))
    assert res.lower_clip_share_fp8_before == 0.5 and res.lower_clip_share_fp8_after == 0.25
    assert res.upper_clip_share_bf16 == 0.0 and res.upper_clip_share_fp8_before == pytest.approx(1 / 3)
    assert (res.n_tokens, res.n_negative, res.n_positive, res.n_nonfinite) == (7, 4, 3, 0)
    assert res.status == "ok" and res.mode == "calibrated"
    d = res.to_dict()
    assert set(BOUNDS_HEADLINE) <= d.keys()  # what the bounds table and its summaries show first


def test_quantile_rule_endpoints():
    r8, r16, adv, mask = _hand_batch()
    cfg = CalibrationConfig()
    none = calibrate(r8, torch.where(adv < 0, 1.0, r16), adv, mask, standard=STANDARD, config=cfg)
    assert none.alpha == 0.0 and none.raw_lower == 0.5  # k = 0: L = v1, clips nothing
    every = calibrate(r8, torch.where(adv < 0, 0.1, r16), adv, mask, standard=STANDARD, config=cfg)
    assert every.alpha == 1.0 and every.raw_lower == pytest.approx(1.1 + 1e-6)  # k = n: vn + 1e-6
    assert every.lower_clip_share_fp8_after == 1.0


def test_pos_neg_contrib_and_balance():
    r8, _, adv, mask = _hand_batch()
    assert pos_neg_contrib(r8, adv, mask, 0.8, 1.28) == (pytest.approx(2.2), pytest.approx(2.0))
    assert pos_neg_contrib(r8, adv, mask, 0.8, 1.28, dual_clip=1.0) == (pytest.approx(2.2), pytest.approx(0.9))
    assert balance(r8, adv, mask, 0.8, 1.28) == pytest.approx(1.1)
    assert balance(r8, adv.abs(), mask, 0.8, 1.28) == math.inf  # no negative token: Neg = 0


# --------------------------------------------------------------------------- loop reference


def _loop_calibrate(r8, r16, adv, mask, cfg: CalibrationConfig, prev, c=3.0):
    """docs/method.md ("Calibrated Clipping"), literally, in Python floats (mode 'calibrated')."""
    toks = [
        (x8, x16, a)
        for x8, x16, a, m in zip(r8.tolist(), r16.tolist(), adv.tolist(), mask.tolist())
        if m and math.isfinite(x8) and math.isfinite(x16)
    ]
    neg = [(x8, x16, -a) for x8, x16, a in toks if a < 0]
    pos = [(x8, x16, a) for x8, x16, a in toks if a > 0]
    lo0, hi0 = 1 - EPS_LOW, 1 + EPS_HIGH

    def bal(which, lo, hi):
        p = sum(t[which] * t[2] for t in pos if t[which] <= hi)
        n = sum(t[which] * t[2] for t in neg if lo <= t[which] <= c)
        return math.inf if n == 0 else p / n

    n = len(neg)
    alpha = sum(1 for t in neg if t[1] < lo0) / n
    k = round(alpha * n)
    v = sorted(t[0] for t in neg)
    lower = v[0] if k == 0 else (v[k - 1] + v[k]) / 2 if k < n else v[-1] + 1e-6
    target = bal(1, lo0, hi0)
    steps = int(math.floor((cfg.upper_max - cfg.upper_min) / cfg.upper_step + 1e-9))
    grid = [round(cfg.upper_min + j * cfg.upper_step, 12) for j in range(steps + 1)]

    def smooth(p, raw, lo, hi):
        return min(max(p + min(max(raw - p, -cfg.max_delta), cfg.max_delta), lo), hi)

    lo_app = smooth(prev[0], lower, cfg.lower_min, cfg.lower_max)  # H is solved for the L in force
    if math.isinf(bal(0, lo_app, cfg.upper_max)) or math.isinf(target):
        upper = prev[1]  # degenerate: keep the previous H
    else:
        upper = next((h for h in grid if bal(0, lo_app, h) >= target), cfg.upper_max)
    hi_app = smooth(prev[1], upper, cfg.upper_min, cfg.upper_max)
    return {
        "alpha": alpha,
        "raw_lower": lower,
        "raw_upper": upper,
        "target_balance": target,
        "lower": lo_app,
        "upper": hi_app,
        "balance_before": bal(0, *prev),
        "balance_after": bal(0, lo_app, hi_app),
        "balance_applied": bal(0, lo_app, hi_app),
        "lower_clip_share_fp8_before": sum(1 for t in neg if t[0] < prev[0]) / n,
        "lower_clip_share_fp8_applied": sum(1 for t in neg if t[0] < lo_app) / n,
        "upper_clip_share_bf16": sum(1 for t in pos if t[1] > hi0) / len(pos),
        "upper_clip_share_fp8_after": sum(1 for t in pos if t[0] > upper) / len(pos),
    }


def _noisy_batch(seed: int, n: int, noise: float, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r16 = torch.exp(torch.randn(n, generator=gen, dtype=dtype) * 0.15)
    r8 = r16 * torch.exp(torch.randn(n, generator=gen, dtype=dtype) * noise)
    adv = torch.randn(n, generator=gen, dtype=dtype)
    mask = torch.rand(n, generator=gen) < 0.9
    return r8, r16, adv, mask


@pytest.mark.parametrize("seed", range(30))
def test_vectorized_matches_loop(seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    n = int(torch.randint(5, 400, (1,), generator=gen))
    r8, r16, adv, mask = _noisy_batch(seed, n, noise=0.05 + 0.1 * (seed % 3))
    if seed % 5 == 0:
        r8[0] = 3.5  # beyond the dual clip
    cfg = CalibrationConfig(max_delta=[0.05, 0.02, 0.5][seed % 3], upper_step=[0.01, 0.03][seed % 2])
    prev = (0.7 + 0.02 * (seed % 7), 1.1 + 0.05 * (seed % 5))
    if (mask & (adv < 0)).sum() == 0 or (mask & (adv > 0)).sum() == 0:
        pytest.skip("degenerate draw")
    res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg, previous=prev)
    ref = _loop_calibrate(r8, r16, adv, mask, cfg, prev)
    for key, val in ref.items():
        assert getattr(res, key) == pytest.approx(val, rel=1e-12, abs=1e-15), key


# --------------------------------------------------------------------------- properties


@pytest.mark.parametrize("seed", range(20))
def test_noiseless_keeps_the_standard_clipped_sets(seed):
    r8, r16, adv, mask = _noisy_batch(seed, 3000, noise=0.0, dtype=torch.float32)
    assert torch.equal(r8, r16)
    res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=CalibrationConfig())
    neg, pos = mask & (adv < 0), mask & (adv > 0)
    assert (neg & (r8 < 0.8)).sum() > 10 and (pos & (r8 > 1.28)).sum() > 10
    assert torch.equal(neg & (r8 < res.raw_lower), neg & (r8 < 1 - EPS_LOW))
    assert torch.equal(pos & (r8 > res.raw_upper), pos & (r8 > 1 + EPS_HIGH))
    assert res.balance_after == pytest.approx(res.target_balance, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_noisy_lower_clip_count_matches_bf16(seed, dtype):
    r8, r16, adv, mask = _noisy_batch(seed, 2000, noise=0.1 + 0.02 * seed, dtype=dtype)
    res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=CalibrationConfig())
    neg = mask & (adv < 0)
    k16 = int((neg & (r16 < 0.8)).sum())
    k8 = int((neg & (r8 < res.raw_lower)).sum())
    assert int((neg & (r8 < 0.8)).sum()) > k16 + 5  # the noise really inflates FP8 clipping
    assert abs(k8 - k16) <= 1
    assert abs(res.lower_clip_share_fp8_after - res.lower_clip_share_bf16) * res.n_negative <= 1 + 1e-9


def test_balance_after_reaches_target_when_range_allows():
    outcomes = set()
    for seed in range(30):
        r8, r16, adv, mask = _noisy_batch(seed, 1500, noise=0.05 + 0.03 * (seed % 10))
        upper_max = [1.3, 1.5, 1.8][seed % 3]
        cfg = CalibrationConfig(upper_max=upper_max)
        res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg)
        cfg = CalibrationConfig(upper_max=upper_max, max_delta=1.0)  # no step cap: raw H is in force
        res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg)
        reachable = balance(r8, adv, mask, res.lower, upper_max) >= res.target_balance
        outcomes.add(reachable)
        if reachable:
            assert res.balance_after >= res.target_balance * (1 - BALANCE_RTOL)
            if res.raw_upper > cfg.upper_min:  # and the grid point below does not
                below = round(res.raw_upper - cfg.upper_step, 12)
                assert balance(r8, adv, mask, res.lower, below) < res.target_balance
        else:
            assert res.raw_upper == upper_max
    assert outcomes == {True, False}  # both branches exercised


@pytest.mark.parametrize("seed", range(40))
def test_smoothing_never_moves_more_than_max_delta(seed):
    gen = torch.Generator().manual_seed(seed)
    r8, r16, adv, mask = _noisy_batch(seed, 500, noise=0.3)
    cfg = CalibrationConfig(max_delta=float(torch.rand(1, generator=gen)) * 0.1)
    prev = (0.6 + 0.4 * float(torch.rand(1, generator=gen)), 1.0 + 0.8 * float(torch.rand(1, generator=gen)))
    res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg, previous=prev)
    assert abs(res.lower - prev[0]) <= cfg.max_delta + 1e-12
    assert abs(res.upper - prev[1]) <= cfg.max_delta + 1e-12
    assert cfg.lower_min <= res.lower <= cfg.lower_max and cfg.upper_min <= res.upper <= cfg.upper_max
    if abs(res.raw_lower - prev[0]) <= cfg.max_delta and cfg.lower_min <= res.raw_lower <= cfg.lower_max:
        assert res.lower == pytest.approx(res.raw_lower)


def test_pair_in_force_meets_bf16_balance_when_the_step_cap_allows():
    """The (L, H) in force after a calibration meets BF16's balance within one grid step
    whenever H is within max_delta of its previous value -- also while L is still held
    back by the step cap (the old order searched H against the raw L and missed here)."""
    checked = 0
    for seed in range(40):
        r8, r16, adv, mask = _noisy_batch(seed, 1000, noise=0.1 + 0.05 * (seed % 4))
        cfg = CalibrationConfig(max_delta=0.05, upper_max=3.0)
        prev = (0.9 if seed % 2 else 0.7, 1.1 + 0.04 * (seed % 8))  # L far from its raw value: the cap binds on L
        res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg, previous=prev)
        if res.status != "ok" or abs(res.raw_upper - prev[1]) > cfg.max_delta + 1e-12:
            continue  # the step cap does not let H reach its target on this draw
        assert abs(res.lower - res.raw_lower) > 1e-6  # the cap held L back
        lo, hi = res.lower, res.upper
        assert res.balance_after == pytest.approx(balance(r8, adv, mask, lo, hi), rel=1e-12)
        assert balance(r8, adv, mask, lo, hi) >= res.target_balance * (1 - BALANCE_RTOL)
        if hi > cfg.upper_min:
            assert balance(r8, adv, mask, lo, round(hi - cfg.upper_step, 12)) < res.target_balance
        checked += 1
    assert checked >= 5


def test_pair_in_force_meets_balance_on_a_hand_batch():
    # raw L = 0.6, but the cap keeps L at 0.75 (from 0.8). BF16 target = Pos16(1.28) / Neg16(0.8)
    # = (1.0 + 1.1 + 0.3*1.2 + 1.2) / (0.9 + 0.95 + 1.0) = 3.66 / 2.85.
    # At the L in force, Neg8(0.75) = 0.9 + 1.1 = 2.0: Pos8(1.3) = 1.0 + 1.2 + 0.39 = 2.59 >= 2.569 -> H = 1.3.
    # The old order searched against raw L = 0.6 (Neg8 = 2.7, needs 3.47) -> raw H = 1.5, H in force 1.35,
    # and the pair in force (0.75, 1.35) then sits above BF16's balance by more than a grid step.
    r8 = torch.tensor([0.5, 0.7, 0.9, 1.1, 1.0, 1.2, 1.3, 1.5], dtype=torch.float64)
    r16 = torch.tensor([0.7, 0.9, 0.95, 1.0, 1.0, 1.1, 1.2, 1.2], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, -1.0, -1.0, 1.0, 1.0, 0.3, 1.0], dtype=torch.float64)
    mask = torch.ones(8, dtype=torch.bool)
    res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=CalibrationConfig(), previous=(0.8, 1.3))
    assert res.target_balance == pytest.approx(3.66 / 2.85)
    assert res.raw_lower == pytest.approx(0.6) and res.lower == pytest.approx(0.75)
    assert res.raw_upper == pytest.approx(1.3) and res.upper == pytest.approx(1.3)
    assert res.balance_after == pytest.approx(2.59 / 2.0)


# --------------------------------------------------------------------------- degenerate batches


@pytest.mark.parametrize(
    "r8,r16,previous,status",
    [
        # every A<0 token has r8 above the dual clip: Neg8 = 0 at any L, FP8 balance +inf for every H
        # (the old code set raw H to upper_min (1.0) -> H = 1.35)
        ([3.5, 4.0, 1.0, 1.1], [0.9, 1.0, 1.0, 1.1], (0.8, 1.4), "no_contributing_negatives"),
        # BF16 clips every negative below 0.8 (target +inf) while FP8 has contributing ones
        ([0.85, 0.9, 1.0, 1.1], [0.5, 0.6, 1.0, 1.1], (0.8, 1.3), "no_contributing_negatives_bf16"),
    ],
)
def test_degenerate_no_contributing_negatives_keeps_previous_upper(r8, r16, previous, status):
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    r8, r16 = (torch.tensor(r, dtype=torch.float64) for r in (r8, r16))
    ones = torch.ones(4, dtype=torch.bool)
    res = calibrate(r8, r16, adv, ones, standard=STANDARD, config=CalibrationConfig(), previous=previous)
    assert res.status == status
    assert res.raw_upper == res.upper == previous[1]
    if status.endswith("_bf16"):
        assert math.isinf(res.target_balance)


def test_degenerate_no_negative_tokens_keeps_both():
    ones = torch.ones(4, dtype=torch.float64)
    res = calibrate(
        ones * 1.1,
        ones,
        torch.tensor([1.0, 2.0, 0.0, 0.5]),
        torch.ones(4, dtype=torch.bool),
        standard=STANDARD,
        config=CalibrationConfig(),
        previous=(0.7, 1.4),
    )
    assert res.status == "no_negative_tokens" and (res.lower, res.upper, res.raw_lower, res.raw_upper) == (
        0.7,
        1.4,
        0.7,
        1.4,
    )


def test_degenerate_no_positive_tokens_keeps_upper():
    r8 = torch.tensor([0.5, 0.9, 1.0], dtype=torch.float64)
    res = calibrate(
        r8,
        r8,
        -torch.ones(3, dtype=torch.float64),
        torch.ones(3, dtype=torch.bool),
        standard=STANDARD,
        config=CalibrationConfig(),
        previous=(0.8, 1.4),
    )
    assert res.status == "no_positive_tokens" and res.raw_upper == 1.4 and res.upper == 1.4


def test_tis_weighted_balance():
    r8, r16, adv, mask = _noisy_batch(3, 400, noise=0.1)
    w = torch.rand(400, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    cfg = CalibrationConfig(tis_weighted_balance=True, max_delta=1.0)
    res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg, weights=w)
    ref = calibrate(r8, r16, adv * w, mask, standard=STANDARD, config=CalibrationConfig(max_delta=1.0))
    assert (res.target_balance, res.raw_upper, res.alpha) == (ref.target_balance, ref.raw_upper, ref.alpha)
    plain = calibrate(r8, r16, adv, mask, standard=STANDARD, config=CalibrationConfig(max_delta=1.0))
    assert res.target_balance != plain.target_balance and res.alpha == plain.alpha
    with pytest.raises(ValueError, match="TIS weights"):
        calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg)


def test_relaxed_lower_is_standard_with_a_wider_fixed_lower_bound():
    batch = _noisy_batch(1, 800, noise=0.2)
    cfg = CalibrationConfig(mode="relaxed_lower", relaxed_eps_low=0.4)
    res = calibrate(*batch, standard=STANDARD, config=cfg, previous=(0.7, 1.5))
    assert (res.lower, res.upper) == (pytest.approx(0.6), pytest.approx(1.28))
    std = calibrate(*batch, standard=STANDARD, config=CalibrationConfig(mode="standard"))
    assert res.alpha == std.alpha and res.target_balance == std.target_balance  # measured against eps_low = 0.2
    from fp8rl_core.calibration.clip_modes import initial_bounds

    assert initial_bounds(eps_low=EPS_LOW, eps_high=EPS_HIGH, config=cfg) == (pytest.approx(0.6), pytest.approx(1.28))
    assert CalibratorState.initial(eps_low=EPS_LOW, eps_high=EPS_HIGH, config=cfg).lower == pytest.approx(0.6)


# --------------------------------------------------------------------------- modes


def test_standard_and_relaxed_lower():
    batch = _noisy_batch(0, 1000, noise=0.2)
    std = calibrate(*batch, standard=STANDARD, config=CalibrationConfig(mode="standard"), previous=(0.7, 1.5))
    assert (std.lower, std.upper, std.raw_lower, std.raw_upper) == (0.8, 1.28, 0.8, 1.28)
    cal = calibrate(*batch, standard=STANDARD, config=CalibrationConfig(max_delta=1.0))
    assert std.target_balance == cal.target_balance and std.alpha == cal.alpha
    rel = calibrate(
        *batch,
        standard=STANDARD,
        config=CalibrationConfig(mode="calibrated_lower_only", max_delta=1.0),
    )
    assert rel.raw_lower == cal.raw_lower and rel.lower == cal.lower
    assert rel.upper == rel.raw_upper == 1.28 and cal.upper != 1.28
    assert sorted(CLIP_MODES.names()) == [
        "bapo",
        "bapo_joint_every_k",
        "calibrated",
        "calibrated_lower_only",
        "oracle",
        "relaxed_lower",
        "standard",
    ]


def _loop_bapo_joint(r8, adv, mask, cfg: CalibrationConfig, c=3.0):
    b = cfg.bapo
    lo, hi = b.lower_start, b.upper_start
    while True:
        p, n = pos_neg_contrib(r8, adv, mask, lo, hi, c)
        if n == 0 or p / (p + n) >= b.rho0:
            return lo, hi
        can_h, can_l = hi + b.upper_step <= b.upper_max + 1e-9, lo + b.lower_step <= b.lower_max + 1e-9
        if not (can_h or can_l):
            return lo, hi
        hi = round(hi + b.upper_step, 12) if can_h else hi
        lo = round(lo + b.lower_step, 12) if can_l else lo


def test_bapo_joint_every_k_matches_loop():
    moved = 0
    for seed in range(12):
        r8, r16, adv, mask = _noisy_batch(seed, 600, noise=0.3)
        adv = adv - 0.3 * (seed % 4)  # shift toward negative advantages so BAPO has to move
        cfg = CalibrationConfig(
            mode="bapo_joint_every_k", bapo={"rho0": [0.4, 0.5, 0.6][seed % 3], "lower_step": 0.02, "upper_step": 0.05}
        )
        res = calibrate(r8, r16, adv, mask, standard=STANDARD, config=cfg)
        lo, hi = _loop_bapo_joint(r8, adv, mask, cfg)
        assert (res.lower, res.upper) == (pytest.approx(lo), pytest.approx(hi))
        assert res.raw_lower == res.lower and res.raw_upper == res.upper
        moved += (res.lower, res.upper) != (cfg.bapo.lower_start, cfg.bapo.upper_start)
    assert moved >= 3


def test_bapo_mode_records_standard_statistics_only():
    batch = _noisy_batch(0, 500, noise=0.2)
    res = calibrate(*batch, standard=STANDARD, config=CalibrationConfig(mode="bapo"), previous=(0.7, 1.5))
    assert (res.lower, res.upper) == (0.8, 1.28)  # the trainer re-picks BAPO's bounds per update


# --------------------------------------------------------------------------- edges and state


def test_edges():
    cfg = CalibrationConfig()
    kw = dict(standard=STANDARD, config=cfg, previous=(0.75, 1.3))
    ones = torch.ones(4)
    res = calibrate(ones, ones, torch.tensor([1.0, 2.0, 0.0, 0.5]), torch.ones(4, dtype=torch.bool), **kw)
    assert res.status == "no_negative_tokens" and (res.raw_lower, res.raw_upper) == (0.75, 1.3)
    assert math.isnan(res.alpha)
    res = calibrate(ones, ones, torch.zeros(4), torch.ones(4), **kw)
    assert res.status == "no_negative_tokens" and (res.lower, res.upper) == (0.75, 1.3)
    res = calibrate(torch.tensor([0.5]), torch.tensor([0.7]), torch.tensor([-1.0]), torch.tensor([True]), **kw)
    assert res.status == "no_positive_tokens" and res.n_tokens == 1
    assert res.raw_lower == pytest.approx(0.5 + 1e-6) and res.raw_upper == 1.3 and res.lower == pytest.approx(0.7)
    empty = torch.zeros(0)
    res = calibrate(empty, empty, empty, empty.bool(), **kw)
    assert res.status == "empty" and res.n_tokens == 0 and (res.lower, res.upper) == (0.75, 1.3)
    # non-finite ratios are dropped and counted; masked-out ones are not counted
    r8, r16, adv, mask = _hand_batch()
    bad8 = torch.cat([r8, torch.tensor([float("nan"), float("inf"), 1.0, float("nan")], dtype=torch.float64)])
    bad16 = torch.cat([r16, torch.tensor([1.0, 1.0, -float("inf"), 1.0], dtype=torch.float64)])
    badadv = torch.cat([adv, torch.tensor([-1.0, 1.0, -1.0, 1.0], dtype=torch.float64)])
    badmask = torch.cat([mask, torch.tensor([True, True, True, False])])
    res = calibrate(bad8, bad16, badadv, badmask, standard=STANDARD, config=cfg)
    clean = calibrate(*_hand_batch(), standard=STANDARD, config=cfg)
    assert res.n_nonfinite == 3 and res.n_tokens == 7
    assert (res.raw_lower, res.raw_upper, res.target_balance) == (
        clean.raw_lower,
        clean.raw_upper,
        clean.target_balance,
    )
    with pytest.raises(ValueError, match="one shape"):
        calibrate(r8, r16[:3], adv, mask, standard=STANDARD, config=cfg)


def test_calibrator_state_roundtrip_and_previous():
    cfg = CalibrationConfig(initial_lower=0.85)
    state = CalibratorState.initial(eps_low=EPS_LOW, eps_high=EPS_HIGH, config=cfg)
    assert state.bounds == (0.85, 1.28) and state.n_calibrations == 0 and state.last_step is None
    res = calibrate(*_hand_batch(), standard=STANDARD, config=cfg)  # previous=None -> initial
    assert (res.previous_lower, res.previous_upper) == (0.85, 1.28)
    new = state.updated(res, step=20)
    assert new == CalibratorState.from_dict(new.to_dict())
    assert (new.lower, new.upper, new.n_calibrations, new.last_step) == (res.lower, res.upper, 1, 20)
    again = calibrate(*_hand_batch(), standard=STANDARD, config=cfg, previous=new)
    assert (again.previous_lower, again.previous_upper) == new.bounds
    with pytest.raises(ValueError, match="unknown keys"):
        CalibratorState.from_dict({"lower": 0.8, "upper": 1.2, "lowr": 1})
    with pytest.raises(ValueError, match=r"missing keys \['upper'\]"):
        CalibratorState.from_dict({"lower": 0.8})


def test_low_precision_inputs_are_upcast():
    r8, r16, adv, mask = _hand_batch(torch.float32)
    res16 = calibrate(
        r8.bfloat16(),
        r16.bfloat16(),
        adv.bfloat16(),
        mask,
        standard=STANDARD,
        config=CalibrationConfig(),
    )
    ref = calibrate(
        r8.bfloat16().float(),
        r16.bfloat16().float(),
        adv,
        mask,
        standard=STANDARD,
        config=CalibrationConfig(),
    )
    assert (res16.raw_lower, res16.raw_upper, res16.alpha) == (ref.raw_lower, ref.raw_upper, ref.alpha)
