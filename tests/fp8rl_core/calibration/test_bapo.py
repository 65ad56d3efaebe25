"""BAPO as published: the vectorised rule against a literal loop of the paper's pseudo-code."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl_core.calibration.bapo import bapo_bounds, bapo_search, bapo_sums, step_clip_stats, summarize_updates
from fp8rl_core.config.method import BapoConfig
from fp8rl_core.objective.losses import LossSpec, policy_loss

pytestmark = pytest.mark.timeout(60)


def _loop_bapo(r, adv, mask, cfg: BapoConfig):
    """Independent literal implementation: Python floats, one token at a time, re-summed after every move."""
    toks = [
        (float(x), float(a))
        for x, a, m in zip(r.reshape(-1).tolist(), adv.reshape(-1).tolist(), mask.reshape(-1).tolist())
        if m
    ]
    clamp = cfg.boundary == "recipe"

    def rho(lo, hi):
        sp = sn = 0.0
        for x, a in toks:
            if clamp:
                if a >= 0:
                    sp += min(x, hi) * a
                else:
                    sn += max(x, lo) * -a
            else:
                if a > 0 and x < hi:
                    sp += x * a
                elif a < 0 and x > lo:
                    sn += x * -a
        if sn <= 0:
            return 1.0 if cfg.target == "share" else math.inf
        return sp / (sp + sn) if cfg.target == "share" else sp / sn

    def fits(b, step, top):
        return b + step <= top + 1e-9

    def nxt(b, step, top):
        return min(round(b + step, 12), top) if cfg.last_step == "recipe" else round(b + step, 12)

    def can(b, step, top):
        return fits(b, step, top) or (cfg.last_step == "recipe" and b < top - 1e-12)

    lo, hi, it = cfg.lower_start, cfg.upper_start, 0
    p = p0 = rho(lo, hi)
    if cfg.order == "paper":
        while p < cfg.rho0 and can(lo, cfg.lower_step, cfg.lower_max):
            if can(hi, cfg.upper_step, cfg.upper_max):
                hi = nxt(hi, cfg.upper_step, cfg.upper_max)
            else:
                lo = nxt(lo, cfg.lower_step, cfg.lower_max)
            it += 1
            p = rho(lo, hi)
    else:
        while p < cfg.rho0 and can(lo, cfg.lower_step, cfg.lower_max):
            lo, it = nxt(lo, cfg.lower_step, cfg.lower_max), it + 1
            p = rho(lo, hi)
        while p < cfg.rho0 and can(hi, cfg.upper_step, cfg.upper_max):
            hi, it = nxt(hi, cfg.upper_step, cfg.upper_max), it + 1
            p = rho(lo, hi)
    return lo, hi, p, p0, it


def _batch(seed, n=400, neg_shift=0.0, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    r = torch.exp(torch.randn(n, generator=g, dtype=torch.float64) * spread)
    adv = torch.randn(n, generator=g, dtype=torch.float64) - neg_shift
    adv[torch.rand(n, generator=g) < 0.1] = 0.0
    mask = torch.rand(n, generator=g) < 0.9
    return r, adv, mask


def _check(r, adv, mask, cfg):
    res = bapo_bounds(r, adv, mask, cfg)
    lo, hi, p, p0, it = _loop_bapo(r, adv, mask, cfg)
    assert (res.lower, res.upper, res.iterations) == (pytest.approx(lo, abs=1e-12), pytest.approx(hi, abs=1e-12), it)
    assert res.rho == pytest.approx(p, rel=1e-9) and res.rho_start == pytest.approx(p0, rel=1e-9)
    return res


CONVENTIONS = [
    {},
    {"order": "recipe"},
    {"boundary": "recipe"},
    {"target": "ratio"},
    {"last_step": "recipe", "lower_step": 0.07, "upper_step": 0.25},
    {"order": "recipe", "boundary": "recipe", "target": "ratio", "last_step": "recipe"},
]


@pytest.mark.parametrize("conv", CONVENTIONS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "paper")
def test_matches_loop_on_random_batches(conv):
    moved = set()
    for seed in range(10):
        r, adv, mask = _batch(seed, neg_shift=0.15 * (seed % 5), spread=0.2 + 0.1 * (seed % 4))
        cfg = BapoConfig(rho0=[0.4, 0.5, 0.6][seed % 3], **conv)
        res = _check(r, adv, mask, cfg)
        moved.add(res.iterations)
    assert len(moved) >= 2 and max(moved) > 0  # the batches exercise walks of different lengths


def test_edge_rho0_reached_at_start():
    r, adv, mask = _batch(1)
    adv = adv.abs() + 0.1  # positives only: S- = 0
    res = _check(r, adv, mask, BapoConfig())
    assert (res.lower, res.upper, res.iterations, res.rho) == (0.6, 1.2, 0, 1.0)
    r, adv, mask = _batch(2, neg_shift=-1.0)  # mostly positive: rho >= 0.5 at once
    res = _check(r, adv, mask, BapoConfig())
    assert res.iterations == 0 and res.rho_start >= 0.5


def test_edge_upper_range_exhausted_then_lower_moves():
    # very negative batch: c_high goes all the way to b+ = 3.0 (18 moves), then c_low moves
    r, adv, mask = _batch(3, neg_shift=1.2, spread=0.15)
    res = _check(r, adv, mask, BapoConfig())
    assert res.upper == 3.0 and res.lower > 0.6 and res.iterations > 18


def test_edge_lower_range_exhausted():
    # nothing positive ever counts: every move is made, ending at (b-, b+), rho still short
    r = torch.tensor([1.0, 1.1, 0.95, 1.05], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, -1.0, 0.001], dtype=torch.float64)
    mask = torch.ones(4, dtype=torch.bool)
    res = _check(r, adv, mask, BapoConfig())
    assert (res.lower, res.upper) == (0.9, 3.0) and res.iterations == 18 + 6 and res.rho < 0.5
    # a lower range narrower than one step: the paper's loop never starts, even though c_high could move
    res = _check(r, adv, mask, BapoConfig(lower_start=0.88, lower_max=0.9))
    assert (res.lower, res.upper, res.iterations) == (0.88, 1.2, 0)


def test_boundary_token_exactly_at_a_bound():
    # paper: a token exactly at c_high (A>0) or c_low (A<0) is clipped, so it is excluded
    r = torch.tensor([1.2, 0.6, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(3, dtype=torch.bool)
    sums = bapo_sums(r, adv, mask, BapoConfig())
    assert float(sums[0]) == 0.0  # S+ at c_high = 1.2 excludes r = 1.2
    assert float(sums[19]) == 1.0  # S- at c_low = 0.6 (first lower point after 19 upper points) excludes r = 0.6
    rec = bapo_sums(r, adv, mask, BapoConfig(boundary="recipe"))
    assert float(rec[0]) == pytest.approx(1.2) and float(rec[19]) == pytest.approx(1.6)


def test_reduce_hook_gives_the_global_decision():
    # two "ranks": the rule on the summed sums equals the rule on the concatenated tokens
    r1, a1, m1 = _batch(7, neg_shift=0.6)
    r2, a2, m2 = _batch(8, neg_shift=-0.2)
    cfg = BapoConfig()
    other = bapo_sums(r2, a2, m2, cfg)
    res = bapo_bounds(r1, a1, m1, cfg, reduce=lambda s: s + other)
    whole = bapo_bounds(torch.cat([r1, r2]), torch.cat([a1, a2]), torch.cat([m1, m2]), cfg)
    assert (res.lower, res.upper, res.iterations) == (whole.lower, whole.upper, whole.iterations)
    assert res.rho == pytest.approx(whole.rho, rel=1e-12)
    with pytest.raises(ValueError, match="expected"):
        bapo_search([0.0, 1.0], cfg)


def test_summary_and_step_stats():
    res = [bapo_bounds(*_batch(s, neg_shift=0.3 * s), BapoConfig()) for s in range(3)]
    m = summarize_updates(res)
    assert m["bapo_upper_min"] <= m["bapo_upper_mean"] <= m["bapo_upper_max"]
    assert m["bapo_rho_max"] == max(x.rho for x in res) and summarize_updates([]) == {}
    # per-mini-batch bounds: the combined statistics equal the row-wise definition
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(6, 5, generator=g) * 0.3, torch.randn(6, 5, generator=g) * 0.3
    adv = torch.randn(6, 1, generator=g).expand(6, 5).contiguous()
    mask = torch.ones(6, 5, dtype=torch.bool)
    mb = torch.tensor([0, 1, 0, 1, 1, 0])
    stats = step_clip_stats(logp, old, adv, mask, mb, {0: (0.7, 1.2), 1: (0.9, 1.5)}, dual_clip=3.0)
    lo = torch.where(mb == 0, 0.7, 0.9)[:, None]
    hi = torch.where(mb == 0, 1.2, 1.5)[:, None]
    r = torch.exp(logp - old)
    assert stats["clipfrac_lower"] == pytest.approx(float(((adv < 0) & (r < lo)).float().mean()))
    assert stats["clipfrac_upper"] == pytest.approx(float(((adv > 0) & (r > hi)).float().mean()))
    _, whole = policy_loss(logp, old, adv, mask, LossSpec(lower=0.7, upper=1.2))
    assert stats["ppo_kl"] == pytest.approx(whole["ppo_kl"]) and stats["ratio_max"] == pytest.approx(whole["ratio_max"])
