"""π_old batched apart from π_θ (``algorithm.old_logp_micro_batch_size``, stages/trainer/old_logp.py).

By default π_old is recomputed on the training micro-batches, so each token meets the same
rows in π_old as in π_θ and, at the weights the step starts with, the FP8 ratio of the first
mini-batch is exactly 1. Batched apart (verl's log-prob pass: the rank's rows in sample order,
a fixed number at a time), a per-tensor FP8 scale is taken over other rows in π_old than in
π_θ: the ratio moves off 1 before any update, which BF16 (no scales) does not show.
"""

from __future__ import annotations

import pytest
import torch
from test_old_logp_reuse import _batch, _cfg, _model

from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
from stages.trainer.old_logp import apart_micro_batches
from stages.trainer.optimizer import make_optimizer
from stages.trainer.update import UpdateSpec, policy_update

pytestmark = pytest.mark.timeout(120)


def test_apart_micro_batches_take_the_rows_in_sample_order():
    got = [r.tolist() for r in apart_micro_batches(10, 4)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [r.tolist() for r in apart_micro_batches(3, 8)] == [[0, 1, 2]]


def _first_minibatch_ratios(mode: str, apart: int | None) -> tuple[torch.Tensor, list[bool]]:
    cfg = _cfg(mode)
    cfg = CampaignConfig.model_validate(
        cfg.model_dump() | {"algorithm": cfg.algorithm.model_dump() | {"old_logp_micro_batch_size": apart}}
    )
    model = _model(mode)
    opt, sched = make_optimizer(model, cfg)
    forwards: list[bool] = []
    model.register_forward_pre_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    with cpu_bf16_gemm("fp32"):
        res = policy_update(model, opt, sched, _batch(), cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=0))
    b = _batch()
    first = (res.minibatch == 0)[:, None] & (b.response_mask > 0)
    return (res.logp_fp8 - res.old_logp_fp8)[first], forwards


def test_fp8_tensorwise_ratios_move_off_one_only_when_pi_old_is_batched_apart():
    shared, f_shared = _first_minibatch_ratios("fp8_tensorwise", None)
    apart, f_apart = _first_minibatch_ratios("fp8_tensorwise", 8)
    assert torch.all(shared == 0), "pi_old on the training micro-batches: the first update's ratio is exactly 1"
    assert (apart != 0).float().mean() > 0.2, "batched apart, the per-tensor scales differ: ratios off 1"
    # 16 rows, 2 mini-batches of 8: shared takes mini-batch 0's pi_old from its own forward (1 no-grad
    # forward); apart runs its own pass over both halves (2)
    assert (f_shared.count(False), f_apart.count(False)) == (1, 2)


def test_bf16_ratios_stay_at_one_however_pi_old_is_batched():
    apart, _ = _first_minibatch_ratios("bf16", 8)
    assert torch.all(apart == 0)


def test_the_setting_is_validated_when_the_config_loads():
    from flows.campaign.configuration import ConfigError, load_config

    assert load_config("tiny-cpu", ["algorithm.old_logp_micro_batch_size=64"]).algorithm.old_logp_micro_batch_size == 64
    with pytest.raises(ConfigError, match="old_logp_micro_batch_size"):
        load_config("tiny-cpu", ["algorithm.old_logp_micro_batch_size=0"])
