"""Policy losses: hand-computed values, a per-token loop reference, accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl_core.objective.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossSpec,
    aggregate,
    cispo_loss,
    policy_loss,
    tis_weights,
)

AGGS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _five_tokens():
    """One row, five tokens covering every branch (L=0.8, H=1.28, c=3)."""
    ratio = torch.tensor([[1.5, 0.5, 4.0, 1.1, 0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, -1.0, 2.0]], dtype=torch.float64)
    old = torch.full_like(ratio, -1.0)
    logp = (old + ratio.log()).requires_grad_()
    return logp, old, adv, torch.ones_like(ratio, dtype=torch.bool), ratio


def test_ppo_hand_computed():
    logp, old, adv, mask, ratio = _five_tokens()
    loss, m = policy_loss(logp, old, adv, mask, LossSpec(lower=0.8, upper=1.28, dual_clip=3.0))
    # upper clip -1.28, lower clip 0.8, dual clip 3, unclipped 1.1 and -1.0
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 3.0 + 1.1 - 1.0) / 5, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0, 1.1, -1.0]], dtype=torch.float64) / 5)
    assert m["clipfrac_lower"] == pytest.approx(0.2)
    assert m["clipfrac_upper"] == pytest.approx(0.2)
    assert m["clipfrac"] == pytest.approx(0.4)
    assert m["pg_clipfrac"] == pytest.approx(0.4)
    assert m["dualclip_frac"] == pytest.approx(0.2)
    assert m["ratio_mean"] == pytest.approx(7.6 / 5)
    assert (m["ratio_min"], m["ratio_max"]) == (pytest.approx(0.5), pytest.approx(4.0))
    assert m["ppo_kl"] == pytest.approx(-sum(math.log(x) for x in [1.5, 0.5, 4.0, 1.1, 0.5]) / 5)
    assert m["n_tokens"] == 5.0 and all(isinstance(v, float) for v in m.values())


def test_tis_weights_hand_computed_and_detached():
    old = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    w = tis_weights(old, torch.tensor([[-1.0, -1.5, -3.0]]), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(0.5), 2.0]]))
    assert not w.requires_grad
    logp, old64, adv, mask, _ = _five_tokens()
    isw = torch.tensor([[0.5, 1.0, 1.0, 2.0, 1.5]], dtype=torch.float64)
    loss, m = policy_loss(logp, old64, adv, mask, LossSpec(lower=0.8, upper=1.28, is_weights=isw))
    assert loss.item() == pytest.approx((-1.28 * 0.5 + 0.8 + 3.0 + 1.1 * 2.0 - 1.0 * 1.5) / 5, rel=1e-12)
    assert m["is_weight_mean"] == pytest.approx(6.0 / 5)


def test_cispo_hand_computed():
    logp, old, adv, mask, ratio = _five_tokens()
    loss, m = cispo_loss(logp, old, adv, mask, LossSpec(lower=0.0, upper=1.28))
    weight = torch.clamp(ratio, 0.0, 1.28)
    expected = (-weight * adv * logp.detach()).sum() / 5
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    loss.backward()
    # every token keeps a gradient -clamp(r) * A, the clipped ones included
    torch.testing.assert_close(logp.grad, -weight * adv / 5)
    assert (logp.grad != 0).all()
    assert m["clipfrac_upper"] == pytest.approx(0.2)


def test_aggregation_hand_computed():
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(loss_mat, mask, "token-mean").item() == pytest.approx(7 / 3)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx(3.5)
    assert aggregate(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx(2.75)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx(7 / 3 / 2)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum-norm", norm_len=10).item() == pytest.approx(0.35)
    assert aggregate(loss_mat, mask, "token-mean", global_token_count=14).item() == pytest.approx(0.5)
    assert aggregate(loss_mat, mask, "seq-mean-token-sum", global_seq_count=7).item() == pytest.approx(1.0)


def test_unknown_agg_and_bad_inputs():
    logp, old, adv, mask, _ = _five_tokens()
    with pytest.raises(
        KeyError, match="valid: seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-mean"
    ):
        policy_loss(logp, old, adv, mask, LossSpec(lower=0.8, upper=1.28, agg="token_mean"))
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(logp, old[:, :3], adv, mask, LossSpec(lower=0.8, upper=1.28))
    with pytest.raises(ValueError, match="lower <= upper"):
        policy_loss(logp, old, adv, mask, LossSpec(lower=1.3, upper=1.28))
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo"]  # gspo: objective.gspo, registered with the losses
    assert AGGREGATIONS.names() == sorted(AGGS)


def _random_batch(seed: int, dtype=torch.float64, zero_adv: bool = True):
    gen = torch.Generator().manual_seed(seed)
    b, t = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    old = -torch.rand(b, t, generator=gen, dtype=dtype) * 3
    logp = old + torch.randn(b, t, generator=gen, dtype=dtype) * 0.5
    logp[0, 0] = old[0, 0] + 1.5  # r ~ 4.5: exercises the dual clip
    adv = torch.randn(b, t, generator=gen, dtype=dtype)
    if zero_adv:
        adv[torch.rand(b, t, generator=gen) < 0.1] = 0.0
    mask = torch.rand(b, t, generator=gen) < 0.8
    isw = torch.rand(b, t, generator=gen, dtype=dtype) * 2
    return logp.requires_grad_(), old, adv, mask, isw


def _loop_reference(logp, old, adv, mask, isw, lower, upper, c, agg, loss_name):
    """Per-token Python loop: value and d loss / d logp of one batch."""
    b, t = logp.shape
    per_tok = [[0.0] * t for _ in range(b)]
    grad_tok = [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            lr = float(logp[i, j]) - float(old[i, j])
            r = math.exp(max(-20.0, min(20.0, lr)))
            a, w = float(adv[i, j]), float(isw[i, j])
            if loss_name == "ppo":
                pg1, pg2 = -a * r, -a * min(max(r, lower), upper)
                val = max(pg1, pg2)
                clipped = (a > 0 and r > upper) or (a < 0 and r < lower)
                if a < 0 and -a * c < val:
                    val, clipped = -a * c, True
                per_tok[i][j], grad_tok[i][j] = val * w, (0.0 if clipped else -a * r * w)
            else:
                wr = min(max(r, lower), upper) * w
                per_tok[i][j], grad_tok[i][j] = -wr * a * float(logp[i, j]), -wr * a
    n_tok = max(int(mask.sum()), 1)
    row_tok = [max(int(mask[i].sum()), 1) for i in range(b)]
    if agg == "token-mean":
        scale = [[1.0 / n_tok] * t for _ in range(b)]
    elif agg == "seq-mean-token-sum":
        scale = [[1.0 / b] * t for _ in range(b)]
    elif agg == "seq-mean-token-mean":
        scale = [[1.0 / (row_tok[i] * b)] * t for i in range(b)]
    else:
        scale = [[1.0 / (t * b)] * t for _ in range(b)]
    value = sum(per_tok[i][j] * scale[i][j] for i in range(b) for j in range(t))
    grad = torch.tensor([[grad_tok[i][j] * scale[i][j] for j in range(t)] for i in range(b)], dtype=logp.dtype)
    return value, grad


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("loss_name", ["ppo", "cispo"])
def test_vectorized_matches_loop(seed, loss_name):
    agg = AGGS[seed % 4]
    lower, upper = (0.8, 1.28) if loss_name == "ppo" else (0.0, 1.5)
    logp, old, adv, mask, isw = _random_batch(seed)
    loss, _ = POLICY_LOSSES.get(loss_name)(
        logp, old, adv, mask, LossSpec(lower=lower, upper=upper, dual_clip=3.0, is_weights=isw, agg=agg)
    )
    loss.backward()
    value, grad = _loop_reference(logp.detach(), old, adv, mask, isw, lower, upper, 3.0, agg, loss_name)
    assert loss.item() == pytest.approx(value, rel=1e-10, abs=1e-12)
    torch.testing.assert_close(logp.grad, grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_clipfrac_is_sum_of_sides_when_no_zero_advantage(seed):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(16, 32, generator=gen) * 3
    logp = (old + torch.randn(16, 32, generator=gen) * 0.4).requires_grad_()
    adv = torch.randn(16, 32, generator=gen)
    mask = torch.rand(16, 32, generator=gen) < 0.9
    loss, m = policy_loss(logp, old, adv, mask, LossSpec(lower=0.8, upper=1.28))
    assert m["clipfrac_lower"] > 0 and m["clipfrac_upper"] > 0
    # pg_clipfrac is verl's [pg2 > pg1], computed independently of the two sides
    assert m["pg_clipfrac"] == pytest.approx(m["clipfrac_lower"] + m["clipfrac_upper"], abs=1e-12)
    # each side recounted by hand from its definition (docs/method.md): A<0 and r<L, A>0 and r>H, over valid tokens
    r = torch.exp(logp.detach() - old)
    n = mask.sum().item()
    assert m["clipfrac_lower"] == pytest.approx(((adv < 0) & (r < 0.8) & mask).sum().item() / n, abs=1e-12)
    assert m["clipfrac_upper"] == pytest.approx(((adv > 0) & (r > 1.28) & mask).sum().item() / n, abs=1e-12)
    # and the clipped tokens are exactly the valid tokens whose gradient vanished
    loss.backward()
    dead = (mask & (logp.grad == 0)).sum().item() / mask.sum().item()
    assert dead == pytest.approx(m["clipfrac"] + m["dualclip_frac"], abs=1e-12)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("loss_name", ["ppo", "cispo"])
def test_micro_batches_sum_to_mini_batch(agg, loss_name):
    """With the mini-batch totals as normalizers, micro-batch losses and grads add up."""
    gen = torch.Generator().manual_seed(7)
    old = -torch.rand(8, 10, generator=gen, dtype=torch.float64) * 3
    logp = (old + torch.randn(8, 10, generator=gen, dtype=torch.float64) * 0.3).requires_grad_()
    adv = torch.randn(8, 10, generator=gen, dtype=torch.float64)
    mask = torch.rand(8, 10, generator=gen) < 0.7
    fn = POLICY_LOSSES.get(loss_name)
    full, _ = fn(logp, old, adv, mask, LossSpec(lower=0.8, upper=1.28, agg=agg))
    (g_full,) = torch.autograd.grad(full, logp)
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 3), slice(3, 8)):
        part, _ = fn(
            logp[rows],
            old[rows],
            adv[rows],
            mask[rows],
            LossSpec(lower=0.8,
            upper=1.28,
            agg=agg,
            global_token_count=float(mask.sum()),
            global_seq_count=8.0),
        )
        total = total + part
    (g_acc,) = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_acc, g_full, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_name", ["ppo", "cispo"])
def test_nan_padding_reaches_neither_loss_nor_grad(loss_name):
    logp, old, adv, mask, isw = _random_batch(3, zero_adv=False)
    pad = ~mask
    if not pad.any():
        pad[0, -1] = True
        mask[0, -1] = False
    nan = float("nan")
    logp_nan = torch.where(pad, torch.full_like(logp, nan), logp.detach()).requires_grad_()
    loss, m = POLICY_LOSSES.get(loss_name)(
        logp_nan,
        torch.where(pad, nan, old),
        torch.where(pad, nan, adv),
        mask,
        LossSpec(lower=0.8,
        upper=1.28,
        is_weights=torch.where(pad, nan, isw)),
    )
    loss.backward()
    spec = LossSpec(lower=0.8, upper=1.28, is_weights=isw)
    ref, _ = POLICY_LOSSES.get(loss_name)(logp.detach(), old, adv, mask, spec)
    assert math.isfinite(loss.item()) and torch.isfinite(logp_nan.grad).all()
    assert (logp_nan.grad[pad] == 0).all()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert all(math.isfinite(v) for v in m.values())


def test_empty_mask():
    logp, old, adv, mask, _ = _five_tokens()
    loss, m = policy_loss(logp, old, adv, torch.zeros_like(mask), LossSpec(lower=0.8, upper=1.28))
    assert loss.item() == 0.0
    assert m["clipfrac"] == 0.0 and m["n_tokens"] == 0.0 and math.isnan(m["ratio_mean"])


def test_cispo_gradient_hand_derived_three_tokens():
    """CISPO with verl's example cap (1 + 0.2, lower side unclamped): d loss / d logp_i = -w_i A_i / 3
    with w = sg(min(r, 1.2)). A non-detached weight would add -A_i * r_i * logp_i / 3 where r is not capped."""
    from fp8rl_core.config.method import AlgorithmConfig
    from fp8rl_core.objective.losses import loss_bounds

    lower, upper = loss_bounds("cispo", 0.8, 1.28, AlgorithmConfig())
    assert (lower, upper) == (0.0, pytest.approx(1.2))
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.4]], dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor([[0.25, 0.5, 0.4]], dtype=torch.float64))  # r = 2.0 (capped), 0.6 (kept), 1.0
    adv = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    loss, m = cispo_loss(logp, old, adv, torch.ones(1, 3, dtype=torch.bool), LossSpec(lower=lower, upper=upper))
    # loss = -(1.2*1*log .5 + 0.6*(-2)*log .3 + 1*0.5*log .4) / 3
    expected = -(1.2 * math.log(0.5) - 1.2 * math.log(0.3) + 0.5 * math.log(0.4)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[-0.4, 0.4, -0.5 / 3]], dtype=torch.float64), rtol=1e-12, atol=0
    )
    assert m["clipfrac_upper"] == pytest.approx(1 / 3) and m["clipfrac_lower"] == 0.0
