"""The step's records and statistics: every rank's per-token tensors gathered, the metrics computed on them.

Every batch statistic is global: the per-token tensors of each rank's rows are gathered into
``[N, T]`` tensors on the host (the padding row dropped first), and the step's metrics are
computed on them by the same code as in one process (:func:`step_metrics`), so one process and
W ranks report alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fp8rl_core.objective.losses import CLIP_DUAL, CLIP_LOWER, CLIP_UPPER, LossSpec
from fp8rl_core.registered import LOSS_STATISTICS
from stages.trainer.types import MinibatchUpdate, OldPolicy, TrainBatch, TrainStep, UpdateResult

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.campaign import CampaignConfig


def epoch0_records(step: TrainStep, old: OldPolicy, updates: list[MinibatchUpdate]) -> dict[str, torch.Tensor | None]:
    """This rank's ``[n_r (+1), T]`` records of the step, put together from its epoch-0 updates: π_θ and
    the entropy of each row's update, the BF16 shadow of π_θ (shadow steps; NaN on rows without shadow
    passes), and π_old, its BF16 shadow and the TIS weights as the updates left them; ``decision``: the clip
    codes of each row's epoch-0 update where the clip mode decides on the BF16 ratio (else None)."""
    logp8, entropy = torch.zeros_like(old.old8), torch.zeros_like(old.old8)
    logp16 = None
    if step.shadow:
        logp16 = torch.zeros_like(old.old8) if step.rows.sub is None else torch.full_like(old.old8, float("nan"))
    decision = torch.zeros_like(old.old8) if any(u.decisions for u in updates) else None
    for u in updates:
        for r, lp, ent in u.records:
            logp8[r], entropy[r] = lp, ent
        for r, lp in u.shadow:
            logp16[r] = lp
        for r, codes in u.decisions if u.epoch == 0 else ():
            decision[r] = codes.float()
    old16 = old.old16 if step.shadow else None  # BF16 columns only on shadow steps (the oracle has it on every step)
    return dict(logp8=logp8, old8=old.old8, logp16=logp16, old16=old16, entropy=entropy, is_w=old.is_w,
                decision=decision)


def minibatch_of_rows(step: TrainStep) -> torch.Tensor:
    """``[N]`` long: each global row's mini-batch index in epoch 0, over every rank's rows."""
    rows, collective = step.rows, step.collective
    minibatch = torch.zeros(rows.n, dtype=torch.long)
    for k in range(rows.per_epoch):
        for m in rows.plan[k]:
            minibatch[m] = k
    if collective.world_size == 1:
        return minibatch
    # each row's index as set by the rank that trained it
    owned_rows, owned = collective.gather_rows(rows.mine), collective.gather_rows(minibatch[rows.mine])
    return torch.zeros(rows.n, dtype=torch.long).index_copy_(0, owned_rows, owned)


def gather_step_stats(
    step: TrainStep, old: OldPolicy, updates: list[MinibatchUpdate], *, lr: float, timings: dict[str, float]
) -> UpdateResult:
    """Every rank's per-token tensors gathered into ``[N, T]`` (global, CPU), and the step's statistics
    computed on them by the same code as in one process."""
    rows, collective, cfg = step.rows, step.collective, step.cfg
    n, mine = rows.n, rows.mine

    def glob(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        out = torch.zeros((n, *x.shape[1:]), dtype=x.dtype)
        own = x[: mine.numel()]  # without the padding row
        out[collective.gather_rows(mine)] = collective.gather_rows(own.detach().float().cpu())
        return out

    g = {k: glob(v) for k, v in epoch0_records(step, old, updates).items()}
    minibatch = minibatch_of_rows(step)
    host = rows.batch  # the gathered per-token tensors are on the host: so is the batch they are read with
    metrics = step_metrics(host, g["logp8"], g["old8"], g["entropy"], g["is_w"], cfg, bounds=step.bounds)
    if g["decision"] is not None:  # what the clip mode deciding on the BF16 ratio clipped in epoch 0
        metrics.update(decided_clip_shares(g["decision"], host.response_mask))
    picked = [u for u in updates if u.bounds is not None]  # a per-update clip mode's bounds
    epoch0_bounds = {u.index: (u.bounds.lower, u.bounds.upper) for u in picked if u.epoch == 0}
    if step.rule is not None:  # clip statistics at each row's own update bounds
        fmask = host.response_mask.float()
        stats = step.rule.clip_stats(
            g["logp8"],
            g["old8"],
            host.advantages.float()[:, None] * fmask,
            fmask,
            minibatch,
            epoch0_bounds,
            dual_clip=cfg.algorithm.dual_clip,
            is_weights=g["is_w"],
        )
        metrics.update({k: float(v) for k, v in stats.items()})
        metrics.update(step.rule.summarize([u.bounds for u in picked]))
    losses = [u.optimizer.loss for u in updates]
    gn = [u.optimizer.grad_norm for u in updates]
    skipped = sum(1 for u in updates if u.optimizer.skipped)
    metrics.update(
        loss=_mean(losses),
        grad_norm=_mean(gn),
        grad_norm_max=max(gn) if gn else 0.0,
        lr=lr,
        skipped_updates=float(skipped),
        updates=float(len(losses)),
    )
    row_bounds = (
        None if step.rule is None else torch.tensor([epoch0_bounds[int(k)] for k in minibatch], dtype=torch.float32)
    )
    return UpdateResult(
        metrics=metrics,
        logp_fp8=g["logp8"],
        old_logp_fp8=g["old8"],
        logp_bf16=g["logp16"],
        old_logp_bf16=g["old16"],
        entropy=g["entropy"],
        tis_weight=g["is_w"],
        minibatch=minibatch,
        skipped_updates=skipped,
        timings=timings,
        rows=mine,
        row_bounds=row_bounds,
    )


def step_metrics(batch: TrainBatch, logp8, old8, entropy, is_w, cfg: CampaignConfig, *, bounds) -> dict[str, float]:
    """Clip shares, KL, entropy, TIS and mismatch statistics of a step, over all its tokens."""
    a = cfg.algorithm
    mask = batch.response_mask.float()
    adv_tok = batch.advantages.float()[:, None] * mask
    with torch.no_grad():
        stats_fn = LOSS_STATISTICS.get(a.loss)  # the loss's own clip statistics (gspo: sequence ratios)
        spec = LossSpec(lower=bounds[0], upper=bounds[1], dual_clip=a.dual_clip, is_weights=is_w, agg="token-mean")
        _, stats = stats_fn(logp8, old8, adv_tok, mask, spec)
    ntok = float(mask.sum().clamp_min(1.0))
    m: dict[str, float] = {k: float(v) for k, v in stats.items()}
    m.update(
        lower_bound=float(bounds[0]),
        upper_bound=float(bounds[1]),
        entropy_mean=float((entropy * mask).sum() / ntok),
        n_tokens=ntok,
        rollout_train_logp_abs_diff=float(((old8 - batch.rollout_logp).abs() * mask).sum() / ntok),
    )
    if is_w is not None:
        w = is_w[mask > 0]
        m.update(
            tis_weight_mean=float(w.mean()),
            tis_weight_min=float(w.min()),
            tis_capped_share=float((w >= a.tis_cap).float().mean()),
        )
    return m


def decided_clip_shares(decision: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """Shares of the valid tokens (``[N, T]`` codes of ``fp8rl_core.objective.losses.clip_decisions``) clipped by
    decisions taken on the BF16 ratio: ``decided_clipfrac_lower``, ``_upper``, ``decided_dualclip_frac`` and
    ``decided_clipfrac`` (lower + upper, as ``clipfrac``)."""
    valid = response_mask > 0
    n = max(float(valid.sum()), 1.0)
    lower, upper, dual = (float((valid & (decision == code)).sum()) / n for code in (CLIP_LOWER, CLIP_UPPER, CLIP_DUAL))
    return {
        "decided_clipfrac": lower + upper,
        "decided_clipfrac_lower": lower,
        "decided_clipfrac_upper": upper,
        "decided_dualclip_frac": dual,
    }


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0
