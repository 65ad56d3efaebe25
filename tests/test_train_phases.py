"""The phases of one policy update, each on its own: rows, π_old, one mini-batch, the optimizer step, statistics.

``stages.trainer.update.policy_update`` reads as four calls; these tests pin what
each phase does with hand-checkable expectations on a tiny model, and that a
loss's or a clip mode's behaviour comes from its registry entry.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8rl_core.calibration.bapo import UpdateBoundsRule
from fp8rl_core.calibration.clip_modes import CLIP_MODES, UPDATE_BOUNDS
from fp8rl_core.objective.losses import LOSS_BOUNDS
from fp8rl_core.registered import CALIBRATION_UNITS, LOSS_STATISTICS, POLICY_LOSSES
from stages.trainer import update as tc
from stages.trainer.collective import SINGLE_PROCESS_COLLECTIVE
from tests.scaleout_common import small_batch, small_cfg, small_model


def _setup(n: int = 16, shadow_rows=None, **algo):
    cfg = small_cfg("bf16", **algo)
    model = small_model("bf16")
    rows = tc.split_rows(
        small_batch(n=n),
        cfg,
        seed=3,
        collective=SINGLE_PROCESS_COLLECTIVE,
        device=torch.device("cpu"),
        shadow_rows=shadow_rows,
    )
    return cfg, model, rows


def test_split_rows_in_one_process_takes_every_row_once_per_epoch_and_no_padding():
    cfg, _, rows = _setup(n=16, ppo_epochs=2)
    assert rows.pad is None and rows.sub is None and rows.per_epoch == 2  # 16 rows / mini-batch 8
    assert torch.equal(rows.mine, torch.arange(16)) and torch.equal(rows.where, torch.arange(16))
    for epoch in range(2):
        seen = torch.cat([torch.cat(rows.real(k)) for k in range(epoch * 2, epoch * 2 + 2)])
        assert sorted(seen.tolist()) == list(range(16))
    assert all(len(rows.padded(k)) == 2 for k in range(len(rows.plan)))  # 8 rows in micro-batches of 4


def test_split_rows_keeps_the_shadowed_rows_of_a_subsampled_shadow():
    keep = torch.zeros(16, dtype=torch.bool)
    keep[::4] = True
    _, _, rows = _setup(shadow_rows=keep)
    micro = rows.padded(0)[0]
    assert torch.equal(rows.shadowed(micro), micro[keep[micro]])


def test_old_logprobs_is_the_no_grad_forward_and_nan_where_not_shadowed():
    keep = torch.zeros(16, dtype=torch.bool)
    keep[:5] = True
    cfg, model, rows = _setup(shadow_rows=keep)
    timings: dict[str, float] = {}
    t = tc.old_logprobs(model, rows, cfg, shadow=True, timings=timings)
    x = rows.local
    with torch.no_grad():
        want = tc.policy_logprobs(model, x.input_ids, x.attention_mask, mode="bf16", micro_batch_size=4)[0]
    mask = x.response_mask > 0
    assert torch.allclose(t.old8[mask], want[mask], atol=1e-5)
    assert torch.isnan(t.old16[~keep]).all() and torch.isfinite(t.old16[keep]).all()
    assert torch.isnan(t.logp16[~keep]).all()
    assert set(timings) == {"old_logp_s", "shadow_s"} and not t.old8.requires_grad
    assert t.is_w is not None and torch.equal(t.is_w == 0, ~mask | (t.is_w == 0))  # TIS weights only on tokens


def test_micro_batch_pass_sums_to_the_mini_batchs_loss_and_records_epoch_zero():
    cfg, model, rows = _setup()
    t = tc.old_logprobs(model, rows, cfg, shadow=False, timings={})
    micros, real = rows.padded(0), torch.cat(rows.real(0))
    tokens = float(t.mask[real].sum())
    total = tc.micro_batch_pass(
        model, rows, micros, t, cfg, bounds=(0.8, 1.28), tokens=tokens, seqs=8.0, world_size=1, record=True
    )
    x = rows.local
    lp = tc.policy_logprobs(model, x.input_ids[real], x.attention_mask[real], mode="bf16")[0]
    whole, _ = POLICY_LOSSES.get("ppo")(
        lp,
        t.old8[real],
        t.adv_tok[real],
        t.mask[real],
        lower=0.8,
        upper=1.28,
        is_weights=t.is_w[real],
        global_token_count=tokens,
    )
    # token-mean over the global token count: the micro-batches' losses add up to the mini-batch's
    assert total == pytest.approx(float(whole.detach()), abs=1e-5)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert torch.allclose(t.logp8[real], lp.detach())


def test_optimizer_step_skips_a_non_finite_loss_and_leaves_the_weights():
    cfg, model, _ = _setup()
    opt, sched = tc.make_optimizer(model, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    log = tc.UpdateLog(minibatch=torch.zeros(16, dtype=torch.long))
    tc.optimizer_step(model, opt, sched, float("nan"), cfg, SINGLE_PROCESS_COLLECTIVE, log)
    assert log.skipped == 1 and math.isnan(log.losses[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # no gradient now: the norm is 0, a finite step
    tc.optimizer_step(model, opt, sched, 0.5, cfg, SINGLE_PROCESS_COLLECTIVE, log)
    assert log.skipped == 1 and log.grad_norms == [pytest.approx(math.sqrt(sum(p.numel() for p in before))), 0.0]


def test_minibatch_update_takes_its_bounds_from_the_clip_modes_hook():
    cfg, model, rows = _setup()
    opt, sched = tc.make_optimizer(model, cfg)
    t = tc.old_logprobs(model, rows, cfg, shadow=False, timings={})
    seen = []

    class Picked:
        lower, upper = 0.5, 1.5

    def bounds(ratio, adv, mask, calibration, distributed):
        seen.append((ratio.numel(), distributed))
        return Picked()

    rule = UpdateBoundsRule(bounds, clip_stats=None, summarize=None)
    log = tc.UpdateLog(minibatch=torch.zeros(16, dtype=torch.long))
    tc.minibatch_update(
        model,
        opt,
        sched,
        rows,
        1,
        t,
        cfg,
        bounds=(0.8, 1.28),
        shadow=False,
        collective=SINGLE_PROCESS_COLLECTIVE,
        log=log,
        timings={},
        rule=rule,
    )
    assert seen == [(8 * t.mask.shape[1], False)]  # the mini-batch's tokens, one process
    assert log.epoch0_bounds == {1: (0.5, 1.5)} and len(log.per_update) == 1 and len(log.losses) == 1
    assert sorted(torch.cat(rows.plan[1]).tolist()) == sorted((log.minibatch == 1).nonzero().flatten().tolist())


def test_gather_step_stats_in_one_process_returns_the_rows_as_they_are():
    cfg, model, rows = _setup()
    t = tc.old_logprobs(model, rows, cfg, shadow=False, timings={})
    log = tc.UpdateLog(minibatch=torch.arange(16) % 2, losses=[1.0, 3.0], grad_norms=[2.0, 4.0])
    res = tc.gather_step_stats(
        small_batch(n=16),
        rows,
        t,
        log,
        cfg,
        bounds=(0.8, 1.28),
        collective=SINGLE_PROCESS_COLLECTIVE,
        lr=1e-3,
        timings={"update_s": 1.0},
    )
    assert torch.equal(res.old_logp_fp8, t.old8) and res.logp_bf16 is None and res.row_bounds is None
    m = res.metrics
    assert (m["loss"], m["grad_norm"], m["grad_norm_max"], m["updates"], m["lr"]) == (2.0, 3.0, 4.0, 2.0, 1e-3)
    assert m["lower_bound"] == 0.8 and m["upper_bound"] == 1.28


def test_bapo_is_the_one_clip_mode_with_per_update_bounds():
    assert tc.per_update_rule("bapo") is UPDATE_BOUNDS.get("bapo")
    assert all(tc.per_update_rule(m) is None for m in CLIP_MODES.names() if m != "bapo")


def test_every_loss_has_every_hook_and_every_per_update_mode_is_a_clip_mode():
    for name in POLICY_LOSSES.names():
        LOSS_BOUNDS.get(name), LOSS_STATISTICS.get(name), CALIBRATION_UNITS.get(name)  # KeyError if missing
    assert CALIBRATION_UNITS.get("gspo") is not None  # sequence-level calibration
    assert set(UPDATE_BOUNDS.names()) <= set(CLIP_MODES.names())
