"""One RL policy update over a step's batch, with the BF16 shadow passes.

This is the numerical heart of the train stage, kept free of storage so it can be
tested on tensors. Per step (docs/method.md, "Ratio and policy loss", "Precision modes"):

1. old log-probs are recomputed in the *training* precision, once, on the whole
   batch (π_old); on calibration steps the BF16 shadow forward runs on the same
   master weights (π_old in BF16);
2. TIS weights ``min(exp(old_logp - rollout_logp), C)`` correct the
   rollout-vs-train mismatch (detached), or the weights of the mismatch
   correction ``algorithm.correction`` selects (:mod:`fp8rl_core.objective.corrections`);
3. the batch is split into mini-batches (one optimizer update each), each into
   micro-batches (one forward/backward each, gradients accumulated), so peak
   memory grows with the micro-batch, not the mini-batch;
4. before each mini-batch's update, on calibration steps, the BF16 shadow
   forward of π_θ runs on that mini-batch; the FP8 log-probs of π_θ come from the
   training forward itself, so r8 and r16 are both known for every token;
5. a non-finite loss or gradient skips the update (recorded), leaving the policy
   as it was.

A clip mode whose record decides on the BF16 ratio (the oracle,
:mod:`fp8rl_core.config.clip_mode_kinds`) runs the shadow machinery on every step: π_old in
BF16 in step 1, and the BF16 forward of π_θ before every update of every epoch in step 4; each
token's clip decision is taken on that BF16 ratio and handed to the loss.

:func:`policy_update` reads top to bottom. It splits the rows
(:func:`stages.trainer.batch.split_rows`: the plan and this rank's rows) and builds the
step's frozen context once (:class:`stages.trainer.types.TrainStep`); each phase then takes
the context and what the phase before it returned, and returns its own values
(:mod:`stages.trainer.types`):
:func:`stages.trainer.old_logp.old_logprobs` (steps 1-2),
:func:`stages.trainer.minibatch.minibatch_update` per mini-batch (steps 3-5) and
:func:`stages.trainer.step_stats.gather_step_stats` (the step's statistics over every
rank's tokens). The one forward path and the kernels' shape contracts are
:mod:`stages.trainer.forward`; the reductions over ranks :mod:`stages.trainer.collective`;
the optimizer :mod:`stages.trainer.optimizer`.

Data parallelism (SPMD): the mini-batch partition does not depend on the number of ranks,
and every batch statistic is global (:mod:`stages.trainer.batch`,
:mod:`stages.trainer.step_stats`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fp8rl_core.calibration.clip_modes import per_update_rule
from fp8rl_core.config.clip_mode_kinds import CLIP_MODE_KINDS
from stages.trainer.batch import split_rows
from stages.trainer.collective import SINGLE_PROCESS_COLLECTIVE, Collective
from stages.trainer.minibatch import minibatch_update
from stages.trainer.old_logp import old_logprobs
from stages.trainer.step_stats import gather_step_stats
from stages.trainer.types import MinibatchUpdate, TrainBatch, TrainStep, UpdateResult

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.campaign import CampaignConfig


@dataclass(frozen=True)
class UpdateSpec:
    """What one step's update is asked for, beside the model, the optimizer, the batch and the config."""

    bounds: tuple[float, float]  # (L, H) ratio clip bounds in force
    shadow: bool  # the BF16 shadow forwards run this step
    seed: int  # fixes the mini-batch shuffle (deterministic per step)
    # shadow only these sequences (subsampled shadow passes, ``fp8rl_core.calibration.subsample``); the BF16
    # log-probs of the other rows are NaN. None: every row
    shadow_rows: torch.Tensor | None = None  # [N] bool over the global batch
    correction_thresholds: tuple[float, float] | None = None  # the mismatch correction's, in force (None: configured)


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    batch: TrainBatch,
    cfg: CampaignConfig,
    spec: UpdateSpec,
    *,
    collective: Collective = SINGLE_PROCESS_COLLECTIVE,
) -> UpdateResult:
    """Run ``ppo_epochs`` passes of mini-batch updates over ``batch`` (the *global* batch), as ``spec`` asks.

    Under several ranks each rank passes the same global batch and trains on its
    share of every mini-batch (:func:`stages.trainer.batch.minibatch_plan`), topped
    up with padding micro-batches so that every rank runs as many forwards and backwards
    (a partial last mini-batch; see :mod:`stages.trainer.batch`); the returned per-token
    arrays and metrics are global and identical on every rank.
    """
    rows = split_rows(batch, cfg, spec.seed, collective, next(model.parameters()).device, spec.shadow_rows)
    model.train()
    rule = per_update_rule(cfg.calibration.mode)  # None unless the clip mode picks bounds per update
    step = TrainStep(
        model, optimizer, scheduler, cfg, collective, rows, spec.bounds, spec.shadow, rule, spec.correction_thresholds,
        decides_on_bf16=CLIP_MODE_KINDS.get(cfg.calibration.mode).decides_on_bf16,
    )
    old = old_logprobs(step)  # 1. π_old (+ BF16 shadow)
    t_train = time.perf_counter()
    updates: list[MinibatchUpdate] = []
    for k in range(len(rows.plan)):  # 2. one optimizer update per mini-batch, every epoch
        updates.append(minibatch_update(step, old, k))
        old = updates[-1].old
    timings = dict(old.seconds)
    if spec.shadow:
        for u in updates:
            timings["shadow_s"] += u.shadow_s
    if step.decides_on_bf16:  # the BF16 forwards the clip decisions took beyond the shadow passes
        timings["bf16_decision_s"] = timings.get("bf16_decision_s", 0.0) + sum(u.decision_s for u in updates)
    timings["update_s"] = time.perf_counter() - t_train
    # 3. statistics
    return gather_step_stats(step, old, updates, lr=float(scheduler.get_last_lr()[0]), timings=timings)
