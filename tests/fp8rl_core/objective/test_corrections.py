"""Mismatch corrections (fp8rl_core.objective.corrections) against slow loop references, their calibrated
thresholds, the settings' checks at load, and 2-step campaigns with each correction on."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fp8rl_core.calibration.calibrated_clipping import CalibratorState
from fp8rl_core.objective.corrections import (
    CORRECTIONS,
    calibrate_correction,
    calibrate_thresholds,
    correction_weights,
    step_weights,
)
from fp8rl_core.objective.losses import tis_weights

# --------------------------------------------------------------------------- slow references


def _clamped_exp(x: float) -> float:
    return math.exp(min(max(x, -20.0), 20.0))


def _inside(r: float, lo: float, hi: float) -> bool:
    return lo <= r <= hi


# name -> (reference thresholds, weight of token t of a row from that row's valid log-ratios d and t)
REFERENCE = {
    # Yao et al. 2025: min(rho_t, C), C = 2
    "token-tis": ((0.0, 2.0), lambda d, t, lo, hi: min(_clamped_exp(d[t]), hi)),
    # verl seq_is: min(prod_t rho_t, C), C = 2
    "seq-tis": ((0.0, 2.0), lambda d, t, lo, hi: min(_clamped_exp(sum(d)), hi)),
    # token MIS: rho_t where rho_t <= C, else 0
    "token-mis": ((0.0, 2.0), lambda d, t, lo, hi: (r := _clamped_exp(d[t])) * _inside(r, lo, hi)),
    # Seq-MIS: prod rho where it is <= C, else 0, on every token of the sequence
    "seq-mis": ((0.0, 2.0), lambda d, t, lo, hi: (r := _clamped_exp(sum(d))) * _inside(r, lo, hi)),
    # IcePop: rho_t inside [0.5, 5], else 0
    "icepop": ((0.5, 5.0), lambda d, t, lo, hi: (r := _clamped_exp(d[t])) * _inside(r, lo, hi)),
    # verl geo_rs: keep the sequence (weight 1) when exp(mean d) is inside [1/1.001, 1.001]
    "geo-mask": ((1 / 1.001, 1.001), lambda d, t, lo, hi: float(_inside(_clamped_exp(sum(d) / len(d)), lo, hi))),
}


def _loop_weights(old, roll, mask, name, lo, hi) -> torch.Tensor:
    out = torch.zeros_like(old)
    for b in range(old.shape[0]):
        cols = [t for t in range(old.shape[1]) if mask[b, t]]
        d = [float(old[b, t] - roll[b, t]) for t in cols]
        for i, t in enumerate(cols):
            out[b, t] = REFERENCE[name][1](d, i, lo, hi)
    return out


def _batch(seed: int, scale: float, b: int = 6, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    roll = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    old = roll + torch.randn(b, t, generator=g, dtype=torch.float64) * scale
    mask = torch.rand(b, t, generator=g) < 0.8
    mask[0] = False  # a row without valid tokens
    mask[1, :] = True
    old[~mask] = float("nan")  # padding may hold anything
    return old, roll, mask


def test_every_registered_correction_has_a_reference():
    assert set(CORRECTIONS.names()) == set(REFERENCE)


@pytest.mark.parametrize("name", sorted(REFERENCE))
@pytest.mark.parametrize("scale", [0.004, 0.3, 1.5])
def test_each_correction_equals_its_loop_reference(name, scale):
    for seed in range(3):
        old, roll, mask = _batch(seed, scale)
        (lo, hi), _ = REFERENCE[name]
        got = correction_weights(old, roll, mask.double(), name)  # the reference thresholds by default
        want = _loop_weights(old, roll, mask, name, lo, hi)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        # and with thresholds of one's own (a masking correction's both ends, a truncation's cap)
        lo2, hi2 = (0.0 if CORRECTIONS.get(name).rule == "truncate" else 0.9), 1.3
        got = correction_weights(old, roll, mask.double(), name, lower=lo2, upper=hi2)
        torch.testing.assert_close(got, _loop_weights(old, roll, mask, name, lo2, hi2), rtol=1e-12, atol=0)
    assert not got.requires_grad


def test_the_corrections_do_mask_and_truncate_on_these_inputs():
    """The references above are not vacuous: every rule changes some weight at scale 1 (geo: 0.004)."""
    for name in REFERENCE:
        old, roll, mask = _batch(0, 0.004 if name == "geo-mask" else 1.0)
        w = correction_weights(old, roll, mask.double(), name)[mask]
        plain = torch.exp(old - roll)[mask]
        assert not torch.allclose(w, plain), name


def test_token_tis_default_is_bit_identical_to_the_historical_expression():
    from fp8rl_core.config.method import AlgorithmConfig

    g = torch.Generator().manual_seed(1)
    roll = -torch.rand(8, 11, generator=g) * 4
    old = roll + torch.randn(8, 11, generator=g)
    mask = (torch.rand(8, 11, generator=g) < 0.7).float()
    for cap in (2.0, 1.5):
        a = AlgorithmConfig(tis_cap=cap)
        assert torch.equal(step_weights(old, roll, mask, a), tis_weights(old, roll, cap=cap) * mask)
    assert step_weights(old, roll, mask, AlgorithmConfig(tis=False)) is None


# --------------------------------------------------------------------------- calibrated thresholds


def _count(v, pred) -> int:
    return sum(1 for x in v.tolist() if pred(x))


@pytest.mark.parametrize("lo, hi", [(0.0, 2.0), (0.5, 5.0), (1 / 1.001, 1.001)])
def test_calibrated_thresholds_leave_as_many_units_outside_as_bf16(lo, hi):
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        spread = math.log(hi) * 0.8
        r16 = torch.exp(torch.randn(200, generator=g, dtype=torch.float64) * spread)
        r8 = r16 * torch.exp(torch.randn(200, generator=g, dtype=torch.float64) * spread * 0.5)  # FP8 widens
        res = calibrate_thresholds(r8, r16, lower=lo, upper=hi, max_factor=2.0)
        k16, k8 = _count(r16, lambda x: x > hi), _count(r8, lambda x: x > hi)
        assert hi <= res.upper <= max(hi, hi**2)
        if k8 <= k16:  # FP8 exceeds no more than BF16: the reference stays
            assert res.upper == hi
        elif res.upper < hi**2:  # not capped: the counts match
            assert _count(r8, lambda x: x > res.upper) == k16
        j16, j8 = _count(r16, lambda x: x < lo), _count(r8, lambda x: x < lo)
        assert min(lo, lo**2) <= res.lower <= lo
        if j8 <= j16:
            assert res.lower == lo
        elif res.lower > lo**2:
            assert _count(r8, lambda x: x < res.lower) == j16
        n = len(r8)
        assert res.units == n
        assert res.outside_share_bf16 == pytest.approx((j16 + k16) / n)
        assert res.outside_share_fp8_before == pytest.approx((j8 + k8) / n)
        outside = _count(r8, lambda x: x < res.lower or x > res.upper)
        assert res.outside_share_fp8_after == pytest.approx(outside / n)


def test_calibrated_thresholds_edge_cases():
    r = torch.tensor([0.5, 1.0, 3.0, float("nan")], dtype=torch.float64)
    res = calibrate_thresholds(r, torch.ones(4, dtype=torch.float64), lower=0.0, upper=2.0)
    assert res.units == 3 and res.upper == 3.0 and res.lower == 0.0  # BF16 truncates none: neither may FP8
    capped = calibrate_thresholds(r * 10, torch.ones(4, dtype=torch.float64), lower=0.0, upper=2.0)
    assert capped.upper == 4.0  # at most twice as far from 1 in log-ratio
    empty = calibrate_thresholds(torch.tensor([float("nan")]), torch.tensor([1.0]), lower=0.5, upper=5.0)
    assert (empty.lower, empty.upper, empty.units) == (0.5, 5.0, 0)


def test_calibrate_correction_uses_the_correction_s_units():
    from fp8rl_core.config.method import AlgorithmConfig

    old8, roll, mask = _batch(3, 0.3)
    old16 = torch.where(mask, roll + (old8 - roll) * 0.5, old8)  # BF16 pi_old: half the mismatch
    a = AlgorithmConfig(correction={"mode": "seq-mis", "calibrate": True})
    res = calibrate_correction(old8, old16, roll, mask, a)
    assert res.units == int(mask.any(-1).sum())  # one unit per sequence with valid tokens
    a = AlgorithmConfig(correction={"mode": "icepop", "calibrate": True})
    assert calibrate_correction(old8, old16, roll, mask, a).units == int(mask.sum())


def test_calibrator_state_keeps_the_thresholds_through_a_checkpoint():
    s = CalibratorState(0.8, 1.28, 1, 4, 0.1, (), (0.25, 3.5))
    back = CalibratorState.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s
    old = {k: v for k, v in s.to_dict().items() if k != "correction"}  # a checkpoint from before
    assert CalibratorState.from_dict(old).correction is None


# --------------------------------------------------------------------------- settings at load


@pytest.mark.parametrize(
    "override, says",
    [
        ("algorithm.correction.mode=seq-tiss", "unknown mismatch correction 'seq-tiss'; valid: geo-mask"),
        ("algorithm.correction.lower=0.5", "truncates from above only"),
        ("algorithm.correction.upper=3", "token-tis takes its cap from algorithm.tis_cap"),
        ("algorithm.correction.calibrate=sometimes", "algorithm.correction.calibrate"),
        ("algorithm.correction.max_factor=0.5", "algorithm.correction.max_factor"),
    ],
)
def test_a_bad_correction_setting_is_one_line_naming_the_key(override, says):
    from flows.campaign.configuration import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", [override])
    msg = str(err.value)
    assert says in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["algorithm.correction.mode=icepop", "algorithm.correction.upper=0.9"], "greater than or equal to 1"),
        (["algorithm.correction.mode=icepop", "algorithm.correction.lower=1.5"], "less than or equal to 1"),
        (["algorithm.tis=false", "algorithm.correction.mode=seq-mis"], "algorithm.tis is off"),
        (["algorithm.correction.mode=seq-mis", "calibration.tis_weighted_balance=true"], "weighs by token TIS"),
    ],
)
def test_bad_correction_combinations_fail_at_load(overrides, says):
    from flows.campaign.configuration import ConfigError, load_config

    with pytest.raises(ConfigError, match=says):
        load_config("tiny-cpu", overrides)
    load_config("tiny-cpu", ["algorithm.correction.mode=icepop", "algorithm.correction.lower=0.4"])


# --------------------------------------------------------------------------- 2-step campaigns


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_two_step_campaign_with_each_correction(tmp_path, monkeypatch, name):
    """Two steps of the micro campaign with the correction on (calibrated thresholds where it has any to
    calibrate): the bounds row records them and step 2 trains with them."""
    from conftest import micro_config, open_micro_run

    import stages.trainer.old_logp as old_logp

    in_force = []
    real = old_logp.step_weights

    def spy(old, rollout, mask, algorithm, thresholds=None):
        in_force.append(thresholds)
        return real(old, rollout, mask, algorithm, thresholds)

    monkeypatch.setattr(old_logp, "step_weights", spy)

    from stages.calibrate import run_calibrate
    from stages.rollout import run_rollout
    from stages.runtime.io import read_step
    from stages.score import run_score
    from stages.train import run_train

    calibrate = name != "token-tis"  # the default stays fixed
    cfg = micro_config(
        "precision.train=fp8_tensorwise",
        "calibration.interval=1",
        f"algorithm.correction.mode={name}",
        f"algorithm.correction.calibrate={str(calibrate).lower()}",
    )
    env, state = open_micro_run(tmp_path, cfg)
    metrics = []
    try:
        for step in (1, 2):
            _, state = run_rollout(env, state, step)
            _, state = run_score(env, state, step)
            out, state = run_train(env, state, step)
            metrics.append(out["metrics"])
            _, state = run_calibrate(env, state, step)
        b = read_step(env, "bounds", 1).to_pylist()[0]
    finally:
        env.close()
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["skipped_updates"] == 0
        assert m["tis_weight_min"] >= 0
    assert b["correction"] == name
    if not calibrate:
        assert b["correction_upper"] is None and state.calibrator.correction is None
    else:
        (lo, hi), _ = REFERENCE[name]
        assert b["correction_reference_upper"] == pytest.approx(hi)
        assert b["correction_upper"] >= hi and b["correction_lower"] <= lo + 1e-12
        assert b["correction_units"] > 0
        assert state.calibrator.correction is not None
        first = in_force.index(next(t for t in in_force if t is not None))
        assert all(t is None for t in in_force[:first]) and first > 0  # step 1: the configured thresholds
        assert in_force[first] == pytest.approx((b["correction_lower"], b["correction_upper"]))  # step 2: step 1's
