"""The phases of one policy update, each on its own: rows, π_old, one mini-batch, the optimizer step, statistics.

``stages.trainer.update.policy_update`` reads as four calls over one frozen step context
(``stages.trainer.types.TrainStep``); these tests pin what each phase does with
hand-checkable expectations on a tiny model, that each returns its values and changes
nothing it was given (but the weights), and that a loss's or a clip mode's behaviour comes
from its registry entry.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fp8rl_core.calibration.bapo import UpdateBoundsRule
from fp8rl_core.calibration.clip_modes import CLIP_MODES, UPDATE_BOUNDS, per_update_rule
from fp8rl_core.objective.losses import LOSS_BOUNDS, LossSpec
from fp8rl_core.registered import CALIBRATION_UNITS, LOSS_STATISTICS, POLICY_LOSSES
from stages.trainer.batch import split_rows
from stages.trainer.collective import SINGLE_PROCESS_COLLECTIVE
from stages.trainer.forward import ForwardSpec, policy_logprobs
from stages.trainer.minibatch import adopt_first_forward, micro_batch_pass, minibatch_update
from stages.trainer.old_logp import old_logprobs
from stages.trainer.optimizer import make_optimizer, optimizer_step
from stages.trainer.step_stats import epoch0_records, gather_step_stats, minibatch_of_rows
from stages.trainer.types import MinibatchUpdate, OptimizerStep, TrainStep
from tests.scaleout_common import small_batch, small_cfg, small_model


def _setup(n: int = 16, shadow_rows=None, **algo):
    cfg = small_cfg("bf16", **algo)
    model = small_model("bf16")
    rows = split_rows(
        small_batch(n=n),
        cfg,
        seed=3,
        collective=SINGLE_PROCESS_COLLECTIVE,
        device=torch.device("cpu"),
        shadow_rows=shadow_rows,
    )
    return cfg, model, rows


def _step(cfg, model, rows, *, shadow=False, rule=None) -> TrainStep:
    opt, sched = make_optimizer(model, cfg)
    return TrainStep(
        model, opt, sched, cfg, SINGLE_PROCESS_COLLECTIVE, rows, (0.8, 1.28), shadow, rule, None
    )


def test_split_rows_in_one_process_takes_every_row_once_per_epoch_and_no_padding():
    cfg, _, rows = _setup(n=16, ppo_epochs=2)
    assert rows.pad is None and rows.sub is None and rows.per_epoch == 2  # 16 rows / mini-batch 8
    assert torch.equal(rows.mine, torch.arange(16)) and torch.equal(rows.where, torch.arange(16))
    for epoch in range(2):
        seen = torch.cat([torch.cat(rows.real[k]) for k in range(epoch * 2, epoch * 2 + 2)])
        assert sorted(seen.tolist()) == list(range(16))
    assert all(len(rows.padded[k]) == 2 for k in range(len(rows.plan)))  # 8 rows in micro-batches of 4


def test_split_rows_keeps_the_shadowed_rows_of_a_subsampled_shadow():
    keep = torch.zeros(16, dtype=torch.bool)
    keep[::4] = True
    _, _, rows = _setup(shadow_rows=keep)
    micro = rows.padded[0][0]
    assert torch.equal(rows.shadowed[0][0], micro[keep[micro]])


def test_old_logprobs_is_the_no_grad_forward_and_nan_where_not_shadowed():
    keep = torch.zeros(16, dtype=torch.bool)
    keep[:5] = True
    cfg, model, rows = _setup(shadow_rows=keep)
    old = old_logprobs(_step(cfg, model, rows, shadow=True))
    x = rows.local
    with torch.no_grad():
        want = policy_logprobs(model, x.input_ids, x.attention_mask, ForwardSpec("bf16", micro_batch_size=4))[0]
    mask = x.response_mask > 0
    assert torch.allclose(old.old8[mask], want[mask], atol=1e-5)
    assert torch.isnan(old.old16[~keep]).all() and torch.isfinite(old.old16[keep]).all()
    assert set(old.seconds) == {"old_logp_s", "shadow_s"} and not old.old8.requires_grad
    assert not old.reuse_first  # two micro-batches per mini-batch: the no-grad pass runs on every row
    assert old.is_w is not None and torch.equal(old.is_w == 0, ~mask | (old.is_w == 0))  # TIS weights only on tokens


def test_micro_batch_pass_sums_to_the_mini_batchs_loss_and_records_epoch_zero():
    cfg, model, rows = _setup()
    step = _step(cfg, model, rows)
    old = old_logprobs(step)
    done = micro_batch_pass(step, old, 0, (0.8, 1.28))
    real = torch.cat(rows.real[0])
    x = rows.local
    lp = policy_logprobs(model, x.input_ids[real], x.attention_mask[real], ForwardSpec("bf16"))[0]
    whole, _ = POLICY_LOSSES.get("ppo")(
        lp,
        old.old8[real],
        old.adv_tok[real],
        old.mask[real],
        LossSpec(lower=0.8,
        upper=1.28,
        is_weights=old.is_w[real],
        global_token_count=float(old.mask[real].sum())),
    )
    # token-mean over the global token count: the micro-batches' losses add up to the mini-batch's
    assert done.loss == pytest.approx(float(whole.detach()), abs=1e-5)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    assert torch.allclose(torch.cat([v for _, v, _ in done.records]), lp.detach())
    assert torch.equal(torch.cat([r for r, _, _ in done.records]), real) and done.old is old


def test_adopting_the_first_forward_returns_a_new_old_policy_and_leaves_the_given_one():
    cfg, model, rows = _setup(ppo_mini_batch_size=4, micro_batch_size=4)
    step = _step(cfg, model, rows)
    old = old_logprobs(step)
    assert old.reuse_first and old.is_w is None  # mini-batch 0 is one micro-batch: its forward gives π_old
    first = rows.padded[0][0]
    before = old.old8.clone()
    logp = torch.full((first.numel(), old.old8.shape[1]), -0.5)
    new = adopt_first_forward(step, old, first, logp)
    assert torch.equal(old.old8, before) and old.is_w is None
    assert torch.equal(new.old8[first], logp) and new.is_w is not None and new.is_w.shape == old.old8.shape


def test_optimizer_step_skips_a_non_finite_loss_and_leaves_the_weights():
    cfg, model, _ = _setup()
    opt, sched = make_optimizer(model, cfg)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    skipped = optimizer_step(model, opt, sched, float("nan"), cfg.algorithm.grad_clip, 1)
    assert skipped.skipped and math.isnan(skipped.loss)
    assert skipped.grad_norm == pytest.approx(math.sqrt(sum(p.numel() for p in before)))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # no gradient now: the norm is 0, a finite step
    assert optimizer_step(model, opt, sched, 0.5, cfg.algorithm.grad_clip, 1) == OptimizerStep(0.5, 0.0, False)


def test_minibatch_update_takes_its_bounds_from_the_clip_modes_hook():
    cfg, model, rows = _setup()
    seen = []

    class Picked:
        lower, upper = 0.5, 1.5

    def bounds(ratio, adv, mask, calibration, distributed):
        seen.append((ratio.numel(), distributed))
        return Picked()

    step = _step(cfg, model, rows, rule=UpdateBoundsRule(bounds, clip_stats=None, summarize=None))
    old = old_logprobs(step)
    u = minibatch_update(step, old, 1)
    assert seen == [(8 * old.mask.shape[1], False)]  # the mini-batch's tokens, one process
    assert (u.k, u.epoch, u.index, u.bounds.lower, u.bounds.upper) == (1, 0, 1, 0.5, 1.5)
    assert u.old is old and u.shadow == [] and len(u.records) == 2 and not u.optimizer.skipped
    minibatch = minibatch_of_rows(step)
    assert sorted(torch.cat(rows.plan[1]).tolist()) == sorted((minibatch == 1).nonzero().flatten().tolist())


def _update(k: int, loss: float, grad_norm: float, old, records=(), shadow=()) -> MinibatchUpdate:
    return MinibatchUpdate(k, 0, k, OptimizerStep(loss, grad_norm, False), None, list(records), list(shadow), old, 0.0)


def test_epoch0_records_put_the_updates_rows_together_nan_where_not_shadowed():
    keep = torch.zeros(16, dtype=torch.bool)
    keep[:5] = True
    cfg, model, rows = _setup(shadow_rows=keep)
    step = _step(cfg, model, rows, shadow=True)
    old = old_logprobs(step)
    r0, r1 = torch.tensor([0, 1]), torch.tensor([2])
    width = old.old8.shape[1]
    updates = [
        _update(0, 1.0, 2.0, old, records=[(r0, torch.ones(2, width), torch.full((2, width), 2.0))]),
        _update(1, 3.0, 4.0, old, records=[(r1, -torch.ones(1, width), torch.zeros(1, width))],
                shadow=[(r1, torch.full((1, width), 7.0))]),
    ]
    rec = epoch0_records(step, old, updates)
    assert torch.equal(rec["logp8"][:2], torch.ones(2, width)) and torch.equal(rec["logp8"][2], -torch.ones(width))
    assert (rec["logp8"][3:] == 0).all() and torch.equal(rec["entropy"][:2], torch.full((2, width), 2.0))
    assert (rec["logp16"][2] == 7.0).all() and torch.isnan(rec["logp16"][3:]).all()
    assert rec["old8"] is old.old8 and rec["is_w"] is old.is_w


def test_gather_step_stats_in_one_process_returns_the_rows_as_they_are():
    cfg, model, rows = _setup()
    step = _step(cfg, model, rows)
    old = old_logprobs(step)
    res = gather_step_stats(
        step, old, [_update(0, 1.0, 2.0, old), _update(1, 3.0, 4.0, old)], lr=1e-3, timings={"update_s": 1.0}
    )
    assert torch.equal(res.old_logp_fp8, old.old8) and res.logp_bf16 is None and res.row_bounds is None
    m = res.metrics
    assert (m["loss"], m["grad_norm"], m["grad_norm_max"], m["updates"], m["lr"]) == (2.0, 3.0, 4.0, 2.0, 1e-3)
    assert m["lower_bound"] == 0.8 and m["upper_bound"] == 1.28
    assert torch.equal(res.minibatch, minibatch_of_rows(step)) and res.timings == {"update_s": 1.0}


def test_the_step_context_and_the_phases_values_are_frozen():
    cfg, model, rows = _setup()
    step = _step(cfg, model, rows)
    old = old_logprobs(step)
    for value, name in ((step, "bounds"), (rows, "plan"), (old, "old8"), (_update(0, 1.0, 2.0, old), "old")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, name, None)


def test_bapo_is_the_one_clip_mode_with_per_update_bounds():
    assert per_update_rule("bapo") is UPDATE_BOUNDS.get("bapo")
    assert all(per_update_rule(m) is None for m in CLIP_MODES.names() if m != "bapo")


def test_every_loss_has_every_hook_and_every_per_update_mode_is_a_clip_mode():
    for name in POLICY_LOSSES.names():
        LOSS_BOUNDS.get(name), LOSS_STATISTICS.get(name), CALIBRATION_UNITS.get(name)  # KeyError if missing
    assert CALIBRATION_UNITS.get("gspo") is not None  # sequence-level calibration
    assert set(UPDATE_BOUNDS.names()) <= set(CLIP_MODES.names())
