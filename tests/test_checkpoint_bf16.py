"""Activation checkpointing in one process: the backward recomputes each block on the bf16 casts its forward
read (``fp8rl_core.precision.bf16_pass.bf16_recompute_checkpointing``).

One process computes every forward on the bf16 casts of the fp32 masters, as FSDP2's all-gather
hands them to N ranks (``bf16_parameters``). transformers checkpoints a block's ``forward``; by the
time backward recomputes it the casts are gone, so without the recompute context the recomputation
reads fp32 masters and ``torch.utils.checkpoint`` refuses (the saved tensors were bf16): a
one-process run with ``algorithm.activation_checkpointing: true`` stopped at its first backward.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl_core.precision.bf16_pass import bf16_recompute_checkpointing, enable_activation_checkpointing
from stages.trainer.optimizer import make_optimizer
from stages.trainer.update import policy_update
from tests.scaleout_common import small_batch, small_cfg, small_model


def _update(mode: str, checkpointing: str):
    cfg = small_cfg(mode)
    model = small_model(mode)
    if checkpointing != "off":
        enable_activation_checkpointing(model)
    if checkpointing == "bf16 recompute":
        assert bf16_recompute_checkpointing(model) == 2
    opt, sched = make_optimizer(model, cfg)
    res = policy_update(model, opt, sched, small_batch(), cfg, bounds=(0.8, 1.28), shadow=False, seed=0)
    return res, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["bf16", "fp8_rowwise"])
def test_checkpointed_update_equals_the_uncheckpointed_one_bit_for_bit(mode):
    torch.set_num_threads(1)
    ref, ref_params = _update(mode, "off")
    res, params = _update(mode, "bf16 recompute")
    assert torch.equal(res.logp_fp8, ref.logp_fp8) and res.metrics["loss"] == ref.metrics["loss"]
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))


def test_plain_checkpointing_fails_in_one_process():
    """What a one-process run did before the recompute context: the first backward raises."""
    from torch.utils.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="different metadata"):
        _update("bf16", "plain")
