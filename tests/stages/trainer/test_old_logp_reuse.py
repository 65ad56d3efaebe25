"""π_old of the first mini-batch taken from its own forward (stages/trainer/old_logp.py).

* the property the reuse rests on: on CPU a forward with grad gives the same log-probs,
  bit for bit, as the no-grad one, in every training precision and with either BF16 GEMM
  path;
* a step with the reuse equals a step without it, bit for bit (π_old, π_θ, TIS weights,
  metrics, the updated weights), and runs one forward fewer (the old trainer ran the
  no-grad pass over every micro-batch: the forward count fails on it);
* BAPO (reads π_old before the forward) and a first mini-batch of several micro-batches
  keep the separate pass.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.tasks.tiny_model import build_tiny_model
from stages.trainer import old_logp as old_logp
from stages.trainer.forward import ForwardSpec, policy_logprobs
from stages.trainer.optimizer import make_optimizer
from stages.trainer.types import TrainBatch
from stages.trainer.update import UpdateSpec, policy_update
from tests.scaleout_common import ragged_batch

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128)


def _cfg(mode: str, mini: int = 8, micro: int = 8, calibration: str = "calibrated") -> CampaignConfig:
    return CampaignConfig.model_validate(
        {
            "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 8},
            "algorithm": {"ppo_mini_batch_size": mini, "micro_batch_size": micro, "lr": 1e-3, "tis": True},
            "precision": {"train": mode},
            "calibration": {"mode": calibration},
        }
    )


def _batch(n=16, p=7, r=9, seed=0) -> TrainBatch:
    return ragged_batch(n, p, r, seed=seed)


def _model(mode: str):
    torch.manual_seed(0)
    m = build_tiny_model(SMALL)
    convert_for_training(m, mode, emulate=True)
    return m


@pytest.mark.parametrize("mode", ["bf16", "fp8_tensorwise", "nvfp4"])
@pytest.mark.parametrize("gemm", ["fp32", "native"])
def test_a_forward_with_grad_gives_the_no_grad_log_probs_bit_for_bit(mode, gemm):
    model, b = _model(mode), _batch()
    model.train()
    with cpu_bf16_gemm(gemm):
        with torch.no_grad():
            ref = policy_logprobs(model, b.input_ids, b.attention_mask, ForwardSpec(mode))[0]
        got, _ = policy_logprobs(model, b.input_ids, b.attention_mask, ForwardSpec(mode, with_entropy=True))
    assert torch.equal(got.detach(), ref)


def _update(mode: str, reuse: bool | None, monkeypatch, shadow: bool, cfg: CampaignConfig | None = None):
    cfg = cfg or _cfg(mode)
    if reuse is False:
        monkeypatch.setattr(old_logp, "first_forward_is_old", lambda *a, **k: False)
    model = _model(mode)
    opt, sched = make_optimizer(model, cfg)
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    with cpu_bf16_gemm("fp32"):
        res = policy_update(model, opt, sched, _batch(), cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=shadow, seed=0))
    monkeypatch.undo()
    return res, model, forwards


@pytest.mark.parametrize("mode,shadow", [("bf16", False), ("fp8_tensorwise", True)])
def test_the_step_with_the_reuse_equals_the_step_without_it_and_skips_one_forward(mode, shadow, monkeypatch):
    (a, ma, fa), (b, mb, fb) = (_update(mode, r, monkeypatch, shadow) for r in (None, False))
    for name in ("old_logp_fp8", "logp_fp8", "tis_weight", "entropy", "logp_bf16", "old_logp_bf16"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    assert a.metrics.keys() == b.metrics.keys()
    assert all(
        a.metrics[k] == b.metrics[k] or a.metrics[k] != a.metrics[k]
        for k in a.metrics
        if not k.endswith(("_s", "_seconds"))
    )
    assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters()))
    # 16 rows, 2 mini-batches of one micro-batch: π_old 2 -> 1 no-grad forwards, π_θ 2 with grad
    assert (fb.count(False) - fa.count(False), fa.count(True), fb.count(True)) == (1, 2, 2)


def test_bapo_and_a_split_first_mini_batch_keep_the_no_grad_pass():
    from fp8rl_core.calibration.clip_modes import per_update_rule

    device = torch.device("cpu")
    one = [[torch.arange(8)]]
    assert per_update_rule("bapo") is not None  # BAPO reads the current ratios before the loss
    assert not old_logp.first_forward_is_old(one, device, 1, per_update_bounds=True)
    split = [[torch.arange(4), torch.arange(4, 8)]]  # mini-batch 8 in micro-batches of 4
    assert not old_logp.first_forward_is_old(split, device, 1, per_update_bounds=False)
    plan = [[torch.arange(8)], [torch.arange(8, 16)]]
    assert old_logp.first_forward_is_old(plan, device, 1, per_update_bounds=False)
    assert not old_logp.first_forward_is_old(plan, device, 2, per_update_bounds=False)
    assert not old_logp.first_forward_is_old(plan, torch.device("meta"), 1, per_update_bounds=False)
