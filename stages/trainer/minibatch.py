"""One optimizer update of a step: a mini-batch's micro-batches forward and backward, then the step.

Per mini-batch ``k`` (docs/method.md, "Ratio and policy loss", "Precision modes"):

1. on calibration steps, in epoch 0, the BF16 shadow forward of π_θ runs on the mini-batch
   before its update; the FP8 log-probs of π_θ come from the training forward itself, so
   r8 and r16 are both known for every token. A clip mode that decides on the BF16 ratio (the
   oracle) runs the same forward before every update of every epoch, and each token's clip
   decision is taken on r16 against the loss's bounds (:func:`bf16_decisions`);
2. a clip mode with bounds per update (its registry hook, BAPO) picks (L, H) from the
   update's current ratios over every rank's tokens (:func:`update_bounds`);
3. the micro-batches run forward and backward one at a time, gradients accumulated
   (:func:`micro_batch_pass`, the one place that iterates micro-batches), so peak memory
   grows with the micro-batch, not the mini-batch; the token-mean denominator is the
   mini-batch's global token count (an integer count summed over ranks: exact);
4. the optimizer step (:func:`stages.trainer.optimizer.optimizer_step`): a non-finite loss
   or gradient skips it (recorded), leaving the policy as it was.

Each returns what it computed (:class:`stages.trainer.types.MicroBatchPass`,
:class:`stages.trainer.types.MinibatchUpdate`); the step's records are put together from
those by :mod:`stages.trainer.step_stats`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from fp8rl_core.objective.corrections import step_weights
from fp8rl_core.objective.losses import LossSpec, clip_decisions, importance_ratio, loss_bounds
from fp8rl_core.registered import POLICY_LOSSES
from stages.trainer.forward import ForwardSpec, no_grad_logprobs, policy_logprobs
from stages.trainer.optimizer import optimizer_step
from stages.trainer.types import MicroBatchPass, MinibatchUpdate, OldPolicy, TrainStep


def maybe_fault(stage: str, point: int) -> None:
    """Test hook for crash tests (``FP8RL_FAULT``, see storage.faults); a no-op otherwise."""
    from storage import faults

    faults.point(f"mb{point}")


def update_bounds(step: TrainStep, old: OldPolicy, micros: list[torch.Tensor]) -> Any:
    """(L, H) of a clip mode that picks bounds before every update (its registry hook), from the
    update's current ratios over every rank's tokens; returns the hook's result (``.lower``, ``.upper``)."""
    cfg, x = step.cfg, step.rows.local
    with torch.no_grad():
        cur = [
            importance_ratio(
                policy_logprobs(step.model, x.input_ids[r], x.attention_mask[r],
                                ForwardSpec(cfg.precision.train, trim=step.rows.trim))[0],
                old.old8[r],
            )
            for r in micros
        ]
    return step.rule.bounds(
        torch.cat([c.reshape(-1) for c in cur]),
        torch.cat([old.adv_tok[r].reshape(-1) for r in micros]),
        torch.cat([old.mask[r].reshape(-1) for r in micros]),
        cfg.calibration,
        step.collective.world_size > 1,
    )


def adopt_first_forward(step: TrainStep, old: OldPolicy, r: torch.Tensor, logp: torch.Tensor) -> OldPolicy:
    """π_old with rows ``r`` taken from mini-batch 0's forward ``logp`` (``[len(r), T]``), and the TIS weights
    of the whole of it: what :func:`stages.trainer.old_logp.old_logprobs` left to that forward (``old.reuse_first``)."""
    x = step.rows.local
    old8 = old.old8.clone()
    old8[r] = logp.detach()
    return replace(old, old8=old8, is_w=step_weights(old8, x.rollout_logp, old.mask, step.cfg.algorithm,
                                                      step.thresholds))


def bf16_decisions(
    step: TrainStep, old: OldPolicy, theta16: list[tuple[torch.Tensor, torch.Tensor]], bounds: tuple[float, float]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each token's clip decision on its BF16 ratio: ``[(r, [len(r), T] int8 codes)]`` for the BF16 π_θ
    ``theta16`` of micro-batches ``r`` (:func:`fp8rl_core.objective.losses.clip_decisions`), against π_old in
    BF16, at ``bounds`` (L, H) and the dual clip."""
    return [
        (r, clip_decisions(importance_ratio(lp16, old.old16[r]), old.adv_tok[r], old.mask[r], lower=bounds[0],
                           upper=bounds[1], dual_clip=step.cfg.algorithm.dual_clip))
        for r, lp16 in theta16
    ]


def _decision_of(decisions: list[tuple[torch.Tensor, torch.Tensor]], i: int, r: torch.Tensor) -> torch.Tensor | None:
    """The clip decisions of micro-batch ``i`` (rows ``r``), None when the loss decides on its own ratio."""
    if not decisions:
        return None
    rows, codes = decisions[i]
    if not torch.equal(rows, r):
        raise RuntimeError(f"micro-batch {i}: its BF16 clip decisions were taken on other rows")
    return codes


def micro_batch_pass(
    step: TrainStep, old: OldPolicy, k: int, bounds: tuple[float, float], *, adopt_old: bool = False,
    decisions: list[tuple[torch.Tensor, torch.Tensor]] = (),
) -> MicroBatchPass:
    """Forward and backward of mini-batch ``k``'s micro-batches at the loss's own ``bounds`` (L, H);
    returns the loss summed over the micro-batches and the ranks.

    The loss's denominators are the mini-batch's global token and sequence counts; padding
    micro-batches have mask 0: they add 0 to every sum. In epoch 0 the pass keeps π_θ and the
    entropy of its rows. ``adopt_old``: these forwards run on the step's starting weights, so
    their log-probs are π_old (:mod:`stages.trainer.old_logp`): taken as such, with the TIS
    weights after them. ``decisions``: per micro-batch of the mini-batch, in order, the clip decisions
    taken on the BF16 ratio (:func:`bf16_decisions`); empty: the loss decides on its own ratio.
    """
    cfg, rows, collective = step.cfg, step.rows, step.collective
    a, x = cfg.algorithm, rows.local
    real = rows.real[k]
    tokens = collective.sum(float(sum(float(old.mask[r].sum()) for r in real)))
    seqs = collective.sum(float(sum(r.numel() for r in real)))
    step.optimizer.zero_grad(set_to_none=True)
    loss_fn = POLICY_LOSSES.get(a.loss)
    total, records = 0.0, []
    for i, r in enumerate(rows.padded[k]):
        center = None if x.center_ids is None else (x.center_ids[r], x.center_mu[r])
        lp, ent = policy_logprobs(step.model, x.input_ids[r], x.attention_mask[r],
                                  ForwardSpec(cfg.precision.train, with_entropy=True, trim=rows.trim), centering=center)
        if adopt_old:
            old = adopt_first_forward(step, old, r, lp)
        spec = LossSpec(
            lower=bounds[0],
            upper=bounds[1],
            dual_clip=a.dual_clip,
            is_weights=None if old.is_w is None else old.is_w[r],
            agg=a.loss_agg,
            global_token_count=max(tokens, 1.0),
            global_seq_count=seqs,
            norm_len=float(cfg.rollout.max_new_tokens),
            clip_decision=_decision_of(decisions, i, r),
        )
        loss, _ = loss_fn(lp, old.old8[r], old.adv_tok[r], old.mask[r], spec)
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * (ent * old.mask[r]).sum() / max(tokens, 1.0)
        (loss * float(collective.world_size)).backward()  # FSDP/DDP average gradients over ranks: undo it
        total += float(loss.detach())
        if k < rows.per_epoch:
            records.append((r, lp.detach(), ent.detach()))
    return MicroBatchPass(collective.sum(total), records, old)


def minibatch_update(step: TrainStep, old: OldPolicy, k: int) -> MinibatchUpdate:
    """Update ``k``: the BF16 shadow of π_θ (epoch 0 of shadow steps; every update where the clip mode
    decides on the BF16 ratio), the clip mode's per-update bounds if it has them, the micro-batches'
    forward/backward, the optimizer step."""
    cfg, rows = step.cfg, step.rows
    epoch, index = divmod(k, rows.per_epoch)
    if epoch == 0:
        maybe_fault("train", index)
    shadow_now = step.shadow and epoch == 0
    theta16, seconds = [], 0.0
    if shadow_now or step.decides_on_bf16:
        t0 = time.perf_counter()
        x = rows.local
        theta16 = no_grad_logprobs(step.model, x.input_ids, x.attention_mask, rows.shadowed[k],
                                   ForwardSpec(cfg.precision.train, shadow=True, trim=rows.trim))
        seconds = time.perf_counter() - t0
    lower, upper = step.bounds
    picked = None
    if step.rule is not None:  # a clip mode with bounds per update (its registry hooks)
        picked = update_bounds(step, old, rows.padded[k])
        lower, upper = picked.lower, picked.upper
    bounds = loss_bounds(cfg.algorithm.loss, lower, upper, cfg.algorithm)
    decisions = bf16_decisions(step, old, theta16, bounds) if step.decides_on_bf16 else []
    done = micro_batch_pass(step, old, k, bounds, adopt_old=old.reuse_first and k == 0, decisions=decisions)
    outcome = optimizer_step(
        step.model, step.optimizer, step.scheduler, done.loss, cfg.algorithm.grad_clip,
        step.collective.world_size,
    )
    return MinibatchUpdate(
        k, epoch, index, outcome, picked, done.records, theta16 if shadow_now else [], done.old,
        seconds if shadow_now else 0.0, decisions, 0.0 if shadow_now else seconds,
    )
