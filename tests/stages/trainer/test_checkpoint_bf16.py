"""Activation checkpointing: the backward recomputes each block as its forward computed
(``fp8rl_core.precision.bf16_pass.recompute_like_forward``): on the bf16 casts the forward read, and
under the CPU GEMM mode (``cpu_bf16_gemm: fp32`` / ``portable``) the forward ran in.

One process computes every forward on the bf16 casts of the fp32 masters, as FSDP2's all-gather
hands them to N ranks (``bf16_parameters``). transformers checkpoints a block's ``forward``; by the
time backward recomputes it the casts are gone, so without the recompute context the recomputation
reads fp32 masters and ``torch.utils.checkpoint`` refuses (the saved tensors were bf16): a
one-process run with ``algorithm.activation_checkpointing: true`` stopped at its first backward.
"""

from __future__ import annotations

import pytest
import torch

from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
from fp8rl_core.precision.bf16_pass import enable_activation_checkpointing, recompute_like_forward
from stages.trainer.optimizer import make_optimizer
from stages.trainer.update import UpdateSpec, policy_update
from tests.scaleout_common import small_batch, small_cfg, small_model


def _update(mode: str, checkpointing: str, gemm: str = "native"):
    cfg = small_cfg(mode)
    model = small_model(mode)
    if checkpointing != "off":
        enable_activation_checkpointing(model)
    if checkpointing == "bf16 recompute":
        assert recompute_like_forward(model) == 2
    opt, sched = make_optimizer(model, cfg)
    with cpu_bf16_gemm(gemm):
        res = policy_update(model, opt, sched, small_batch(), cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=0))
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


@pytest.mark.parametrize("gemm", ["fp32", "portable"])
@pytest.mark.parametrize("mode", ["bf16", "fp8_blockwise"])
def test_the_recomputation_runs_under_the_forwards_cpu_gemm_mode(mode, gemm):
    """A backward started inside the CPU GEMM mode runs in the mode's own handler, where the mode is
    off: without the recompute context restoring it, the recomputed block took PyTorch's native BF16
    kernels and ``torch.utils.checkpoint`` refused it (the run of a preset with
    ``activation_checkpointing: true`` stopped at its first backward on a CPU)."""
    torch.set_num_threads(1)
    ref, ref_params = _update(mode, "off", gemm)
    res, params = _update(mode, "bf16 recompute", gemm)
    assert torch.equal(res.logp_fp8, ref.logp_fp8) and res.metrics["loss"] == ref.metrics["loss"]
    assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
