"""The optimizer: AdamW over the fp32 master weights, its warmup schedule, one step.

One optimizer step per mini-batch (docs/method.md, "Ratio and policy loss"): the gradient
is clipped to ``algorithm.grad_clip`` and the step taken, unless the loss or the gradient
norm is not finite; then the update is skipped (and recorded), leaving the weights as they were.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from stages.trainer.types import OptimizerStep

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.campaign import CampaignConfig


def _lr_lambda(warmup: int):
    return lambda n: min(1.0, (n + 1) / warmup) if warmup > 0 else 1.0


def make_optimizer(
    model: torch.nn.Module, cfg: CampaignConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the fp32 master weights (on their device) plus a linear-warmup schedule (per update)."""
    a = cfg.algorithm
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=a.betas, weight_decay=a.weight_decay, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(a.warmup_steps))
    return opt, sched


def optimizer_step(model, optimizer, scheduler, loss: float, grad_clip: float, world_size: int) -> OptimizerStep:
    """Clip the gradient and step, unless the loss or the gradient norm is not finite (then skip, recorded).

    The gradients are freed either way (set to None): nothing reads them before the next
    update's backward, and after a stage's last update none stay on the device through the
    rollout and the weight sync (the memory plan counts only parameters and AdamW state there)."""
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    grad_norm = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)  # a DTensor under FSDP2
    skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
    if not skipped:
        optimizer.step()
        scheduler.step()
        if world_size > 1:
            from stages.trainer.distributed import after_optimizer_step

            after_optimizer_step(model)
    optimizer.zero_grad(set_to_none=True)
    return OptimizerStep(loss, grad_norm, skipped)
