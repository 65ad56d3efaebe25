"""GSPO: sequence ratio, loss and gradient against hand-derived values; sequence-level calibration."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl_core.calibration.calibrated_clipping import StandardClip, calibrate
from fp8rl_core.config.method import AlgorithmConfig, CalibrationConfig
from fp8rl_core.objective.gspo import (
    GSPO_EPS_HIGH,
    GSPO_EPS_LOW,
    gspo_calibration_config,
    gspo_loss,
    sequence_calibration_inputs,
    sequence_ratio,
)
from fp8rl_core.objective.losses import POLICY_LOSSES, LossSpec

pytestmark = pytest.mark.timeout(30)
L, H = 1 - GSPO_EPS_LOW, 1 + GSPO_EPS_HIGH


def test_published_clip_range_and_registration():
    assert (GSPO_EPS_LOW, GSPO_EPS_HIGH) == (3e-4, 4e-4)  # Zheng et al. 2025, section 5.1
    assert POLICY_LOSSES.get("gspo") is gspo_loss
    assert AlgorithmConfig(loss="gspo", eps_low=3e-4, eps_high=4e-4).loss == "gspo"


def test_sequence_ratio_is_geometric_mean_over_valid_tokens():
    logp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.7, -0.9]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -1.5, 0.0], [-0.6, -1.0, -0.9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    s = sequence_ratio(torch.where(mask, logp, 0.0), old, mask)
    assert s[0] == pytest.approx(1.0)  # (0.5 - 0.5) / 2
    assert s[1] == pytest.approx(math.exp((0.1 + 0.3 + 0.0) / 3))


def test_loss_hand_values_clipped_and_unclipped():
    # row 0: A = +1, s = e^0.001 > H -> clipped at H, no gradient
    # row 1: A = -1, s = e^-0.002 < L -> max(s, L) = L, no gradient
    # row 2: A = +1, s = e^0.0001 inside -> loss -s, gradient -s / 2 per token
    old = torch.zeros(3, 2, dtype=torch.float64)
    lp = torch.tensor([[0.001, 0.001], [-0.002, -0.002], [0.0, 0.0002]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(3, 2, dtype=torch.bool)
    loss, m = gspo_loss(lp, old, adv, mask, LossSpec(lower=L, upper=H, agg="seq-mean-token-mean"))
    s2 = math.exp(0.0001)
    assert float(loss.detach()) == pytest.approx((-H + L - s2) / 3, abs=1e-12)
    loss.backward()
    g = lp.grad
    assert torch.all(g[:2] == 0)
    assert g[2].tolist() == pytest.approx([-s2 / 2 / 3] * 2, abs=1e-12)
    assert m["seq_clipfrac_lower"] == pytest.approx(1 / 3) and m["seq_clipfrac_upper"] == pytest.approx(1 / 3)
    assert m["clipfrac_lower"] == pytest.approx(2 / 6) and m["clipfrac_upper"] == pytest.approx(2 / 6)


def test_gspo_token_equals_sequence_level_objective_and_gradient():
    """Loop reference: -(1/B) sum_i min(s_i A_i, clip(s_i, L, H) A_i) with s_i = exp(mean(lp - old))."""
    g = torch.Generator().manual_seed(0)
    b, t = 6, 5
    old = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1 - 1
    lp0 = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 3e-4
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 3:] = False
    mask[4, 1:] = False
    lp = lp0.clone().requires_grad_(True)
    loss, _ = gspo_loss(lp, old, adv, mask, LossSpec(lower=L, upper=H, agg="seq-mean-token-mean"))
    loss.backward()
    lp_ref = lp0.clone().requires_grad_(True)
    total = 0.0
    for i in range(b):
        sel = mask[i]
        s = torch.exp((lp_ref[i][sel] - old[i][sel]).mean())
        a = adv[i, 0]
        total = total - torch.minimum(s * a, torch.clamp(s, L, H) * a)
    (total / b).backward()
    assert float(loss.detach()) == pytest.approx(float(total.detach() / b), abs=1e-12)
    torch.testing.assert_close(lp.grad, lp_ref.grad, atol=1e-12, rtol=0)


def test_sequence_calibration_hand_values():
    # 4 negative sequences (2 tokens each, equal per-token log-ratio), 2 positive
    s16 = [0.9995, 0.9998, 0.9999, 1.0001, 1.0001, 1.0002]
    s8 = [0.9990, 0.9996, 0.9999, 1.0002, 1.0001, 1.0003]
    advs = [-1.0, -1.0, -1.0, -1.0, 1.0, 1.0]
    tok = lambda xs: torch.tensor([math.log(x) for x in xs for _ in range(2)], dtype=torch.float64)  # noqa: E731
    zeros = torch.zeros(12, dtype=torch.float64)
    seq = torch.arange(6).repeat_interleave(2)
    adv = torch.tensor(advs, dtype=torch.float64).repeat_interleave(2)
    r8, r16, a, ok = sequence_calibration_inputs(
        tok(s8), zeros, tok(s16), zeros, adv, seq, torch.ones(12, dtype=torch.bool)
    )
    assert r8.tolist() == pytest.approx(s8, abs=1e-12) and ok.all()
    cfg = gspo_calibration_config(CalibrationConfig())
    assert (cfg.upper_step, cfg.max_delta, cfg.lower_min, cfg.upper_max) == (1e-5, 7.5e-5, 0.9994, 1.0012)
    res = calibrate(r8, r16, a, ok, standard=StandardClip(GSPO_EPS_LOW, GSPO_EPS_HIGH), config=cfg)
    assert res.alpha == 0.25  # BF16 clips 1 of 4 negative sequences (0.9995 < 0.9997)
    assert res.raw_lower == pytest.approx((0.9990 + 0.9996) / 2, abs=1e-12)
    assert res.lower == pytest.approx(L - 7.5e-5, abs=1e-12)  # one step cap down from 0.9997
    assert cfg.upper_min <= res.raw_upper <= cfg.upper_max


def test_unshadowed_sequences_are_left_out():
    nan = float("nan")
    lp16 = torch.tensor([0.0, 0.0, nan, nan], dtype=torch.float64)
    z = torch.zeros(4, dtype=torch.float64)
    _, _, _, ok = sequence_calibration_inputs(
        z, z, lp16, z, -torch.ones(4, dtype=torch.float64), torch.tensor([7, 7, 9, 9]), torch.ones(4, dtype=torch.bool)
    )
    assert ok.tolist() == [True, False]
