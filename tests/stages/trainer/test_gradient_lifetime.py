"""No gradient outlives a train stage: the trainer frees them at every optimizer step, and the measured
memory plan, which counts only parameters and AdamW state as resident between train stages, agrees with
the bytes a real run keeps."""

from __future__ import annotations

import pytest
import torch

from tests.scaleout_common import SMALL, small_batch, small_cfg, small_model

pytestmark = pytest.mark.timeout(120)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _trained(mode: str = "bf16"):
    from stages.trainer.optimizer import make_optimizer
    from stages.trainer.update import UpdateSpec, policy_update

    cfg = small_cfg(mode)
    model = small_model(mode)
    opt, sched = make_optimizer(model, cfg)
    policy_update(model, opt, sched, small_batch(), cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=True, seed=0))
    return model, opt


def test_no_gradient_is_left_after_the_last_update_of_a_train_stage():
    model, opt = _trained("fp8_tensorwise")
    assert len(opt.state) > 0  # it did update
    kept = [n for n, p in model.named_parameters() if p.grad is not None]
    assert kept == []


def test_the_measured_plans_resident_state_is_what_a_run_keeps_between_train_stages():
    """One process of the small model: after a train stage the run holds its fp32 parameters and AdamW
    state and nothing else; the plan's resident bytes, measured on fake tensors of the same architecture
    (one fake rank), are the same number."""
    from flows.plan.measured import resident_bytes
    from stages.trainer.memory_measure import measure_step

    model, opt = _trained("bf16")
    kept = _bytes(model.parameters()) + _bytes(p.grad for p in model.parameters())
    kept += _bytes(v for state in opt.state.values() for v in state.values() if torch.is_tensor(v))
    torch.set_num_threads(1)
    step = measure_step(
        model.config,
        layers=SMALL.num_layers,
        world_size=1,
        mode="bf16",
        micro_batch_size=4,
        seq_len=16,
        activation_checkpointing=False,
    )
    assert resident_bytes(step) == kept
