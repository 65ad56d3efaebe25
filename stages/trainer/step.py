"""One train step's frozen context: what every phase of :func:`stages.trainer.update.policy_update` reads.

Built once per step, after the rows are split (:func:`stages.trainer.batch.split_rows`), and
never changed: a phase takes the context and the values the phase before it returned, and
returns its own (:class:`stages.trainer.old_logp.OldPolicy`,
:class:`stages.trainer.minibatch.MinibatchUpdate`, :class:`stages.trainer.step_stats.UpdateResult`).
The policy and the optimizer are the one thing a phase changes, in place: the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fp8rl_core.calibration.bapo import UpdateBoundsRule
from stages.trainer.batch import StepRows
from stages.trainer.collective import Collective

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.campaign import CampaignConfig


@dataclass(frozen=True)
class TrainStep:
    """A step's model, optimizer, config, ranks, clip rule, bounds and rows, and what its clip mode asks for."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    cfg: CampaignConfig
    collective: Collective
    rows: StepRows  # the global batch and this rank's share of it
    bounds: tuple[float, float]  # (L, H) in force (the calibrator's)
    shadow: bool  # BF16 shadow passes this step
    rule: UpdateBoundsRule | None  # the clip mode's per-update bounds (None: ``bounds`` throughout)
    thresholds: tuple[float, float] | None  # the mismatch correction's calibrated thresholds (None: configured)
    decides_on_bf16: bool = False  # the clip mode decides each token's clip on its BF16 ratio (its record)
