"""Token-budget micro-batches: the split (a pure function), and a step that trains the same with it.

* every micro-batch holds at most ``micro_batch_size`` rows and, padded to its own
  longest row and the kernel's multiple, at most the token budget (a row over the
  budget alone); the micro-batches of a mini-batch are exactly its rows; rows are
  longest first; hand-checked on a small example;
* the ranks' micro-batches together are the 1-process ones;
* a policy update with the budget gives the same per-token log-probs (up to the
  float rounding of GEMMs of another shape), the same token counts and the same loss
  as without (the token-mean is over the mini-batch), with fewer padded tokens.
"""

from __future__ import annotations

import pytest
import torch

from stages.trainer.batch import minibatch_plan, padded_tokens, token_budget_micros
from stages.trainer.optimizer import make_optimizer
from stages.trainer.update import UpdateSpec, policy_update
from tests.scaleout_common import small_batch, small_cfg, small_model


def test_padded_tokens_meets_the_kernel_multiple():
    assert padded_tokens(3, 10, 1) == 30
    assert padded_tokens(3, 10, 16) == 48  # 3 x 16: T' = 16 is the smallest >= 10 with 3 T' % 16 == 0
    assert padded_tokens(4, 10, 16) == 48  # 4 x 12
    assert padded_tokens(2, 100, 128) == 256  # 2 x 128


def test_a_hand_checked_split():
    lengths = torch.tensor([5, 40, 7, 38, 6, 9, 20, 8])
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    micros = token_budget_micros(rows, lengths, max_rows=4, max_tokens=80, multiple=1)
    # longest first: 40 38 | 20 9 8 7 | 6 5   (40+38 -> 2 x 40 = 80; 20 9 8 7 -> 4 x 20 = 80; rows cap 4)
    assert [m.tolist() for m in micros] == [[1, 3], [6, 5, 7, 2], [4, 0]]
    alone = token_budget_micros(rows, lengths, max_rows=8, max_tokens=30, multiple=1)
    assert alone[0].tolist() == [1] and alone[1].tolist() == [3]  # over the budget alone: alone


@pytest.mark.parametrize("multiple", [1, 16, 128])
def test_every_micro_batch_keeps_the_budget_and_the_mini_batch_is_unchanged(multiple):
    g = torch.Generator().manual_seed(0)
    lengths = (torch.rand(64, generator=g) ** 3 * 480 + 30).long()  # long-tailed, 16x spread
    budget = 4096
    cfg = small_cfg(ppo_mini_batch_size=16, micro_batch_size=8, max_tokens_per_micro_batch=budget)
    plain = minibatch_plan(64, small_cfg(ppo_mini_batch_size=16, micro_batch_size=8), seed=3)
    plan = minibatch_plan(64, cfg, seed=3, lengths=lengths, multiple=multiple)
    assert len(plan) == len(plain) == 4
    for micros, same in zip(plan, plain):
        assert sorted(torch.cat(micros).tolist()) == sorted(torch.cat(same).tolist())  # the same mini-batch
        widths = [int(lengths[m].max()) for m in micros]
        assert widths == sorted(widths, reverse=True)
        for m in micros:
            assert m.numel() <= 8
            assert m.numel() == 1 or padded_tokens(m.numel(), int(lengths[m].max()), multiple) <= budget


def test_the_ranks_together_run_the_one_process_micro_batches():
    lengths = (torch.rand(48, generator=torch.Generator().manual_seed(1)) * 60 + 4).long()
    cfg = small_cfg(ppo_mini_batch_size=16, micro_batch_size=4, max_tokens_per_micro_batch=96)
    one = minibatch_plan(48, cfg, seed=5, lengths=lengths, multiple=16)
    for w in (2, 3):
        ranks = [minibatch_plan(48, cfg, seed=5, rank=r, world_size=w, lengths=lengths, multiple=16) for r in range(w)]
        for k, micros in enumerate(one):
            assert [m.tolist() for r in ranks for m in r[k]] == [m.tolist() for m in micros]


def test_minibatch_plan_without_lengths_under_a_budget_is_an_error():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        minibatch_plan(8, small_cfg(max_tokens_per_micro_batch=64), seed=0)


@pytest.mark.parametrize("mode", ["bf16", "fp8_rowwise"])
def test_an_update_with_a_token_budget_trains_the_same_mini_batches(mode):
    batch = small_batch(n=16, p=7, r=6)
    results, tokens = [], []
    for budget in (None, 30):
        torch.manual_seed(0)
        cfg = small_cfg(mode, max_tokens_per_micro_batch=budget)
        model = small_model(mode)
        seen = []
        model.model.embed_tokens.register_forward_pre_hook(lambda mod, args: seen.append(args[0].numel()))
        opt, sched = make_optimizer(model, cfg)
        spec = UpdateSpec(bounds=(0.8, 1.28), shadow=True, seed=0)
        results.append(policy_update(model, opt, sched, batch, cfg, spec))
        tokens.append(sum(seen))
    plain, budgeted = results
    assert tokens[1] < 0.95 * tokens[0]  # the forwards ran fewer (padded) tokens
    m = batch.response_mask > 0
    assert budgeted.metrics["n_tokens"] == plain.metrics["n_tokens"] and budgeted.metrics["updates"] == 2.0
    assert torch.equal(budgeted.minibatch, plain.minibatch)
    first = m & (plain.minibatch == 0)[:, None]  # before any update: the same weights in both runs
    for name, rows in (("old_logp_fp8", m), ("logp_fp8", first), ("logp_bf16", first)):
        a, b = getattr(plain, name)[rows], getattr(budgeted, name)[rows]
        assert (a - b).abs().max() < 2e-2, name  # bf16 GEMMs of other shapes: a few bf16 ulps of a logit
    lr_moves = (plain.logp_fp8 - budgeted.logp_fp8)[m & ~first].abs().max()
    assert lr_moves < 0.1  # after one update at lr 1e-3, Adam amplifies those roundings: still the same step
    assert budgeted.metrics["loss"] == pytest.approx(plain.metrics["loss"], abs=5e-3)
