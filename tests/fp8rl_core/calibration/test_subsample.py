"""Subsampled shadow passes: the stated bound holds over many random subsets; sizes vs a slow loop."""

from __future__ import annotations

import pytest
import torch

from fp8rl_core.calibration.calibrated_clipping import calibrate
from fp8rl_core.calibration.subsample import (
    BootstrapSpec,
    bootstrap_lower_error,
    choose_size,
    level_error,
    lower_error_bound,
    quantile_rule,
    sample_sequences,
)
from fp8rl_core.config.method import CalibrationConfig
from tests.calibration_common import EPS_LOW, STANDARD

pytestmark = pytest.mark.timeout(90)


def _batch(n_seq: int = 2048, seed: int = 0):
    """Sequences of 4..12 tokens; ratios correlated within a sequence (a shared offset)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, 13, (n_seq,), generator=g)
    seq_id = torch.repeat_interleave(torch.arange(n_seq), lens)
    n = int(lens.sum())
    offset = (torch.randn(n_seq, generator=g) * 0.12)[seq_id]
    r16 = torch.exp(offset + torch.randn(n, generator=g) * 0.08)
    r8 = r16 * torch.exp(torch.randn(n, generator=g) * 0.06)
    r8[torch.rand(n, generator=g) < 0.2] = 1.0  # ties, as first mini-batches give
    adv_seq = torch.randn(n_seq, generator=g)
    adv = adv_seq[seq_id]
    return r8, r16, adv, seq_id, lens


def _neg_per_seq(adv, seq_id, n_seq):
    return torch.zeros(n_seq, dtype=torch.long).index_add_(0, seq_id, (adv < 0).long())


def _raw_lower(r8, r16, adv):
    res = calibrate(
        r8,
        r16,
        adv,
        torch.ones_like(adv, dtype=torch.bool),
        standard=STANDARD,
        config=CalibrationConfig(),
    )
    return res.raw_lower, res.alpha


def test_full_subset_is_the_full_batch_quantile():
    r8, r16, adv, seq_id, lens = _batch()
    nps = _neg_per_seq(adv, seq_id, lens.numel())
    keep = torch.ones(lens.numel(), dtype=torch.bool)
    l_full, alpha = _raw_lower(r8, r16, adv)
    b = lower_error_bound(r8[adv < 0], alpha, m=lens.numel(), neg_per_seq=nps, keep=keep, delta=0.05)
    assert b.level_error == 0.0 and b.lower_error_bound == 0.0
    # the module's quantile rule is the calibration's
    v = torch.sort(r8[adv < 0].double()).values
    assert quantile_rule(v, alpha) == pytest.approx(l_full, abs=1e-6)


def test_choose_size_is_smallest_meeting_target_slow_loop():
    _, _, adv, seq_id, lens = _batch(600, seed=3)
    nps = _neg_per_seq(adv, seq_id, lens.numel())
    neg = nps[nps > 0].double()
    n_neg, b, nbar, n = neg.numel(), float(neg.max()), float(neg.mean()), lens.numel()

    def err(k):
        kn = max(1, (k * n_neg) // n)
        return level_error(kn, n_neg, b, nbar, 0.05, int(round(kn * nbar)))

    for target in (0.3, 0.5, 0.8):
        m = choose_size(nps, target, 0.05, min_sequences=4)
        slow = next((k for k in range(4, n + 1) if err(k) <= target), n)
        assert m == slow
        assert m < n  # a real saving at these targets


@pytest.mark.parametrize("m", [512, 1024])
def test_stated_bound_holds_over_many_random_subsets(m):
    r8, r16, adv, seq_id, lens = _batch()
    n_seq = lens.numel()
    nps = _neg_per_seq(adv, seq_id, n_seq)
    l_full, _ = _raw_lower(r8, r16, adv)
    neg_full = r8[adv < 0]
    g = torch.Generator().manual_seed(11)
    delta, trials, fails, errors, widths = 0.05, 200, 0, [], []
    for _ in range(trials):
        keep = sample_sequences(n_seq, m, g)
        tok = keep[seq_id]
        l_sub, a_sub = _raw_lower(r8[tok], r16[tok], adv[tok])
        bound = lower_error_bound(neg_full, a_sub, m=m, neg_per_seq=nps, keep=keep, delta=delta)
        err = abs(l_sub - l_full)
        fails += err > bound.lower_error_bound
        errors.append(err)
        widths.append(bound.lower_error_bound)
    # share of failures <= delta + 3 binomial standard errors of this test's own sampling
    assert fails / trials <= delta + 3 * (delta * (1 - delta) / trials) ** 0.5
    assert max(errors) > 0  # subsets do miss; the check is not vacuous
    assert sum(widths) / trials < 0.5  # and the bound is not the whole ratio range


@pytest.mark.parametrize("n_seq,m", [(512, 128), (512, 256)])
def test_bootstrap_bound_covers_over_many_random_subsets(n_seq, m):
    r8, r16, adv, seq_id, lens = _batch(n_seq, seed=5)
    l_full, _ = _raw_lower(r8, r16, adv)
    g = torch.Generator().manual_seed(7)
    delta, trials, fails, widths, errors = 0.05, 200, 0, [], []
    for _ in range(trials):
        keep = sample_sequences(n_seq, m, g)
        tok = keep[seq_id]
        l_sub, _ = _raw_lower(r8[tok], r16[tok], adv[tok])
        neg = tok & (adv < 0)
        w = bootstrap_lower_error(
            r8[neg],
            r16[neg],
            seq_id[neg],
            BootstrapSpec(threshold=1 - EPS_LOW, delta=delta, m=m, n_total=n_seq, resamples=200),
            generator=g,
        )
        err = abs(l_sub - l_full)
        fails += err > w
        widths.append(w)
        errors.append(err)
    assert fails / trials <= delta + 3 * (delta * (1 - delta) / trials) ** 0.5
    # tight: within a few times the typical error (the guaranteed bound is ~50x wider)
    assert sum(widths) / trials < 5 * sum(errors) / trials
