"""The values the phases of a train step hand each other, in one place.

:func:`stages.trainer.update.policy_update` splits the rows into a :class:`StepRows`
(:func:`stages.trainer.batch.split_rows`) and builds the step's frozen context once
(:class:`TrainStep`); each phase then takes the context and the values the phase before it
returned, and returns its own: :class:`OldPolicy` (:mod:`stages.trainer.old_logp`),
:class:`MicroBatchPass`, :class:`OptimizerStep` and :class:`MinibatchUpdate`
(:mod:`stages.trainer.minibatch`, :mod:`stages.trainer.optimizer`) and :class:`UpdateResult`
(:mod:`stages.trainer.step_stats`). The policy and the optimizer are the one thing a phase
changes, in place: the weights.

Shapes: ``N`` rows of the step's global batch, ``T`` tokens a row (prompt + response + pad),
``K`` score-centering tokens, ``n_r`` rows this rank trains (``+1``: the padding row under
several ranks), ``m`` rows of one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fp8rl_core.calibration.bapo import UpdateBoundsRule
from stages.trainer.collective import Collective

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.campaign import CampaignConfig


@dataclass
class TrainBatch:
    """A step's batch as padded tensors (right padding)."""

    input_ids: torch.Tensor  # [N, T] long: prompt + response + pad
    attention_mask: torch.Tensor  # [N, T] long: 1 on prompt and response tokens
    response_mask: torch.Tensor  # [N, T] float: 1 on response tokens (incl. EOS)
    rollout_logp: torch.Tensor  # [N, T] float32: engine log-probs at response positions
    advantages: torch.Tensor  # [N] float32: per-sequence advantage
    sample_ids: torch.Tensor  # [N] long: sample_id in the rollouts table
    # score centering (algorithm.score_centering_k = K), else None: at response positions, the rollout
    # engine's K most likely tokens and their probabilities renormalized over the K (0 elsewhere)
    center_ids: torch.Tensor | None = None  # [N, T, K] long
    center_mu: torch.Tensor | None = None  # [N, T, K] float32

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def centering(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.center_ids is None else (self.center_ids, self.center_mu)

    def _map(self, fn) -> "TrainBatch":
        return TrainBatch(*(None if t is None else fn(t) for t in (
            self.input_ids, self.attention_mask, self.response_mask, self.rollout_logp, self.advantages,
            self.sample_ids, self.center_ids, self.center_mu,
        )))

    def to(self, device: torch.device | str) -> "TrainBatch":
        return self._map(lambda t: t.to(device))

    def cpu(self) -> "TrainBatch":
        """The batch on the host (its tensors themselves when they are there already)."""
        return self._map(lambda t: t.cpu())

    def rows(self, idx: torch.Tensor) -> "TrainBatch":
        return self._map(lambda t: t[idx])


@dataclass(frozen=True)
class StepRows:
    """This rank's share of a step's global batch: its rows, its micro-batches, its padding row.

    ``plan`` (every epoch's mini-batches, each a list of this rank's micro-batches
    of *global* row indices) comes from :func:`stages.trainer.batch.minibatch_plan`;
    ``local`` holds this rank's rows (plus the padding row under several ranks) on the device.
    The micro-batches of mini-batch ``k`` as *local* row indices (on the host) are read, not
    computed: ``real[k]`` (this rank's), ``padded[k]`` (topped up with padding micro-batches
    to every rank's count) and ``shadowed[k]`` (the rows of each of ``padded[k]`` with shadow
    passes; under several ranks never empty: the padding row instead).
    """

    n: int  # rows of the global batch
    batch: TrainBatch  # the global batch, on the host (where the step's statistics are computed)
    plan: list[list[torch.Tensor]]  # per mini-batch, this rank's micro-batches: [m] long global rows each
    per_epoch: int  # mini-batches per epoch
    mine: torch.Tensor  # [n_r] long: global rows this rank trains (sorted)
    local: TrainBatch  # [n_r (+1 padding row), T] on the device
    local_global: torch.Tensor  # [n_r (+1)] long: global row of each local row
    pad: torch.Tensor | None  # [1] long: local index of the padding row (None in one process)
    where: torch.Tensor  # [N] long: global row -> local row (-1: another rank's)
    sub: torch.Tensor | None  # [n_r (+1)] bool: rows with shadow passes (None: all), on the host like the row indices
    real: list[list[torch.Tensor]]  # per mini-batch, this rank's micro-batches: [m] long local rows each
    padded: list[list[torch.Tensor]]  # ``real`` topped up with padding micro-batches: [m] long local rows each
    shadowed: list[list[torch.Tensor]]  # the rows of each of ``padded`` with shadow passes: [m] long local rows each
    trim: bool = False  # token-budget micro-batches: each forward cut to its micro-batch's longest row


@dataclass(frozen=True)
class TrainStep:
    """A step's frozen context: what every phase of :func:`stages.trainer.update.policy_update` reads.

    Its model, optimizer, config, ranks, clip rule, bounds and rows, and what its clip mode asks for;
    built once per step, after the rows are split, and never changed.
    """

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


@dataclass(frozen=True)
class OldPolicy:
    """π_old of one rank's rows and what the update reads beside it."""

    mask: torch.Tensor  # [n_r (+1), T] float32: response mask
    adv_tok: torch.Tensor  # [n_r (+1), T] float32: advantage on every response token
    old8: torch.Tensor  # [n_r (+1), T] float32: π_old, training precision
    # π_old, BF16 shadow (shadow steps and BF16 clip decisions; NaN on rows without)
    old16: torch.Tensor | None  # [n_r (+1), T] float32
    # TIS weights (None until mini-batch 0 gives its π_old, when it does)
    is_w: torch.Tensor | None  # [n_r (+1), T] float32
    reuse_first: bool  # mini-batch 0's grad forward gives its π_old (stages.trainer.old_logp.first_forward_is_old)
    seconds: dict[str, float]  # old_logp_s, shadow_s


@dataclass(frozen=True)
class OptimizerStep:
    """What one optimizer step leaves besides the weights."""

    loss: float  # the mini-batch's loss, summed over ranks
    grad_norm: float  # before clipping
    skipped: bool  # the loss or the gradient norm was not finite: no step


@dataclass(frozen=True)
class MicroBatchPass:
    """A mini-batch's forward and backward, gradients accumulated on the weights."""

    loss: float  # summed over the micro-batches and the ranks
    # epoch 0: (local rows [m] long, π_θ [m, T] float32, entropy [m, T] float32)
    records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    old: OldPolicy  # π_old after the pass (mini-batch 0 may give its own)


@dataclass(frozen=True)
class MinibatchUpdate:
    """What one optimizer update of a step returns besides the new weights."""

    k: int  # the update's index (epoch-major)
    epoch: int
    index: int  # its mini-batch's index within the epoch
    optimizer: OptimizerStep  # the summed loss, the grad norm, skipped or not
    bounds: Any  # the per-update clip mode's result (``.lower``, ``.upper``); None without one
    # epoch 0: (local rows [m] long, π_θ [m, T] float32, entropy [m, T] float32)
    records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    shadow: list[tuple[torch.Tensor, torch.Tensor]]  # epoch 0 of shadow steps: (local rows [m], BF16 π_θ [m, T])
    old: OldPolicy  # π_old after the update
    shadow_s: float  # seconds of the BF16 shadow forward
    # (local rows [m] long, BF16 clip codes [m, T] int8)
    decisions: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    decision_s: float = 0.0  # seconds of the BF16 forward the clip decisions took beyond the shadow pass


@dataclass(frozen=True)
class UpdateResult:
    """A step's per-token arrays (global, on CPU, valid where ``response_mask``) and its scalars."""

    metrics: dict[str, float]
    logp_fp8: torch.Tensor  # [N, T] float32: π_θ, training precision (epoch 0)
    old_logp_fp8: torch.Tensor  # [N, T] float32: π_old, training precision
    logp_bf16: torch.Tensor | None  # [N, T] float32: π_θ, BF16 shadow (shadow steps; NaN on rows without)
    old_logp_bf16: torch.Tensor | None  # [N, T] float32: π_old, BF16 shadow (shadow steps)
    entropy: torch.Tensor  # [N, T] float32
    tis_weight: torch.Tensor | None  # [N, T] float32: TIS weights (None with ``algorithm.tis`` off)
    minibatch: torch.Tensor  # [N] long: index of the row's mini-batch in epoch 0
    skipped_updates: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    rows: torch.Tensor | None = None  # [n_r] long: global rows this rank trained (its share of the per-token tables)
    # (L, H) of each row's epoch-0 update (bounds per update: BAPO)
    row_bounds: torch.Tensor | None = None  # [N, 2] float32
