"""One RL policy update over a step's batch, with the BF16 shadow passes.

This is the numerical heart of the train stage, kept free of storage so it can be
tested on tensors. Per step (DESIGN.md section 2 and issue 6):

1. old log-probs are recomputed in the *training* precision, once, on the whole
   batch (π_old); on calibration steps the BF16 shadow forward runs on the same
   master weights (π_old in BF16);
2. TIS weights ``min(exp(old_logp - rollout_logp), C)`` correct the
   rollout-vs-train mismatch (detached);
3. the batch is split into mini-batches (one optimizer update each), each into
   micro-batches (one forward/backward each, gradients accumulated), so peak
   memory grows with the micro-batch, not the mini-batch;
4. before each mini-batch's update, on calibration steps, the BF16 shadow
   forward of π_θ runs on that mini-batch; the FP8 log-probs of π_θ come from the
   training forward itself, so r8 and r16 are both known for every token;
5. a non-finite loss or gradient skips the update (recorded), leaving the policy
   as it was.

Token order: row i of every ``[N, T]`` tensor is sample i of the batch (groups
contiguous); column t is the log-prob of ``input_ids[:, t]`` given its prefix.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from fp8rl_core.config import CampaignConfig
from fp8rl_core.logprobs import sequence_logprobs, token_logprobs_and_entropy
from fp8rl_core.losses import POLICY_LOSSES, policy_loss, tis_weights
import fp8rl_core.gspo  # noqa: F401,E402  registers the "gspo" loss (issue 15)
from fp8rl_core.precision import autocast_context, bf16_shadow


def maybe_fault(stage: str, point: int) -> None:
    """Test hook for crash tests (``FP8RL_FAULT``, see flows.campaign); a no-op otherwise."""
    import os

    if os.environ.get("FP8RL_FAULT"):
        from flows.campaign import fault_point

        fault_point(stage, point)


@dataclass
class TrainBatch:
    """A step's batch as padded tensors (right padding)."""

    input_ids: torch.Tensor  # [N, T] long: prompt + response + pad
    attention_mask: torch.Tensor  # [N, T] long: 1 on prompt and response tokens
    response_mask: torch.Tensor  # [N, T] float: 1 on response tokens (incl. EOS)
    rollout_logp: torch.Tensor  # [N, T] float32: engine log-probs at response positions
    advantages: torch.Tensor  # [N] float32: per-sequence advantage
    sample_ids: torch.Tensor  # [N] long: sample_id in the rollouts table

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class UpdateResult:
    """Per-token arrays ([N, T], float32, valid where response_mask) and step scalars."""

    metrics: dict[str, float]
    logp_fp8: torch.Tensor
    old_logp_fp8: torch.Tensor
    logp_bf16: torch.Tensor | None
    old_logp_bf16: torch.Tensor | None
    entropy: torch.Tensor
    tis_weight: torch.Tensor | None
    minibatch: torch.Tensor  # [N] int: index of the row's mini-batch in epoch 0
    skipped_updates: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def _lr_lambda(warmup: int):
    return lambda n: min(1.0, (n + 1) / warmup) if warmup > 0 else 1.0


def make_optimizer(model: torch.nn.Module, cfg: CampaignConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the fp32 master weights plus a linear-warmup schedule (per update)."""
    a = cfg.algorithm
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=a.betas, weight_decay=a.weight_decay, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(a.warmup_steps))
    return opt, sched


def _micro_slices(idx: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [idx[i : i + size] for i in range(0, idx.numel(), size)]


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    batch: TrainBatch,
    cfg: CampaignConfig,
    *,
    bounds: tuple[float, float],
    shadow: bool,
    seed: int,
    shadow_rows: torch.Tensor | None = None,
) -> UpdateResult:
    """Run ``ppo_epochs`` passes of mini-batch updates over ``batch``.

    ``bounds`` = (L, H) ratio clip bounds in force; ``shadow`` turns on the BF16
    shadow forwards; ``seed`` fixes the mini-batch shuffle (deterministic per step).
    ``shadow_rows`` (``[N]`` bool, optional): shadow only these sequences
    (subsampled shadow passes, ``fp8rl_core.subsample``); BF16 log-probs of the
    other rows are NaN.
    """
    a, mode = cfg.algorithm, cfg.precision.train
    lower, upper = bounds
    n, t_len = batch.input_ids.shape
    mask = batch.response_mask.float()  # [N, T]
    adv_tok = batch.advantages.float()[:, None] * mask  # [N, T]
    timings: dict[str, float] = {}
    model.train()

    t0 = time.perf_counter()
    with torch.no_grad():
        old_logp8, _ = sequence_logprobs(
            model, batch.input_ids, batch.attention_mask, mode=mode, micro_batch_size=a.micro_batch_size, with_entropy=False
        )  # [N, T]
    timings["old_logp_s"] = time.perf_counter() - t0
    old_logp16 = None
    sub = None if shadow_rows is None or bool(shadow_rows.all()) else shadow_rows.bool()
    if shadow:
        t0 = time.perf_counter()
        rows = slice(None) if sub is None else sub
        with torch.no_grad(), bf16_shadow(model):
            lp16_old, _ = sequence_logprobs(
                model, batch.input_ids[rows], batch.attention_mask[rows], mode="bf16",
                micro_batch_size=a.micro_batch_size, with_entropy=False,
            )
        old_logp16 = lp16_old if sub is None else torch.full((n, t_len), float("nan")).index_put_((sub,), lp16_old.float())
        timings["shadow_s"] = time.perf_counter() - t0

    is_w = tis_weights(old_logp8, batch.rollout_logp, cap=a.tis_cap) * mask if a.tis else None  # [N, T]

    logp8 = torch.zeros(n, t_len)
    logp16 = (torch.zeros(n, t_len) if sub is None else torch.full((n, t_len), float("nan"))) if shadow else None
    entropy = torch.zeros(n, t_len)
    minibatch = torch.zeros(n, dtype=torch.long)
    loss_fn = POLICY_LOSSES.get(a.loss)
    # CISPO truncates the IS weight at [0, 1 + eps] instead of clipping the ratio.
    loss_lower, loss_upper = (0.0, 1.0 + a.cispo_eps_high) if a.loss == "cispo" else (lower, upper)
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    grad_norms: list[float] = []
    skipped = 0
    t_train = time.perf_counter()
    for epoch in range(a.ppo_epochs):
        order = torch.randperm(n, generator=gen)
        for mb_index, mb in enumerate(_micro_slices(order, a.ppo_mini_batch_size)):
            if epoch == 0:
                minibatch[mb] = mb_index
                maybe_fault("train", mb_index)
            mb_sh = mb if sub is None else mb[sub[mb]]
            if shadow and epoch == 0 and mb_sh.numel():
                t0 = time.perf_counter()
                with torch.no_grad(), bf16_shadow(model):
                    lp16, _ = sequence_logprobs(
                        model, batch.input_ids[mb_sh], batch.attention_mask[mb_sh], mode="bf16",
                        micro_batch_size=a.micro_batch_size, with_entropy=False,
                    )
                logp16[mb_sh] = lp16.float()
                timings["shadow_s"] = timings.get("shadow_s", 0.0) + time.perf_counter() - t0
            optimizer.zero_grad(set_to_none=True)
            mb_tokens = float(mask[mb].sum().clamp_min(1.0))
            mb_loss = 0.0
            for micro in _micro_slices(mb, a.micro_batch_size):
                ids, am = batch.input_ids[micro], batch.attention_mask[micro]
                with autocast_context(mode):
                    logits = model(input_ids=ids, attention_mask=am).logits  # [m, T, V]
                # logits[:, t] predicts ids[:, t+1]
                lp, ent = token_logprobs_and_entropy(logits[:, :-1], ids[:, 1:])  # [m, T-1]
                lp = torch.nn.functional.pad(lp, (1, 0))  # [m, T] aligned to labels
                ent = torch.nn.functional.pad(ent, (1, 0))
                m_mask = mask[micro]
                loss, _ = loss_fn(
                    lp, old_logp8[micro], adv_tok[micro], m_mask,
                    lower=loss_lower, upper=loss_upper, dual_clip=a.dual_clip,
                    is_weights=None if is_w is None else is_w[micro], agg=a.loss_agg,
                    global_token_count=mb_tokens, global_seq_count=float(len(mb)),
                    norm_len=float(cfg.rollout.max_new_tokens),
                )
                if a.entropy_coef > 0:
                    loss = loss - a.entropy_coef * (ent * m_mask).sum() / mb_tokens
                loss.backward()
                mb_loss += float(loss.detach())
                if epoch == 0:
                    logp8[micro] = lp.detach().float()
                    entropy[micro] = ent.detach().float()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip))
            if not (math.isfinite(mb_loss) and math.isfinite(grad_norm)):
                skipped += 1
                optimizer.zero_grad(set_to_none=True)
            else:
                optimizer.step()
                scheduler.step()
            losses.append(mb_loss)
            grad_norms.append(grad_norm)
    timings["update_s"] = time.perf_counter() - t_train

    # Step-level clip statistics over every token of the step (first epoch's π_θ).
    with torch.no_grad():
        _, stats = (loss_fn if a.loss == "gspo" else policy_loss)(  # gspo: sequence-ratio clip shares
            logp8, old_logp8, adv_tok, mask, lower=lower, upper=upper, dual_clip=a.dual_clip, is_weights=is_w, agg="token-mean"
        )
    ntok = float(mask.sum().clamp_min(1.0))
    metrics: dict[str, float] = {k: float(v) for k, v in stats.items()}
    metrics.update(
        loss=_mean(losses),
        grad_norm=_mean(grad_norms),
        grad_norm_max=max(grad_norms) if grad_norms else 0.0,
        lr=float(scheduler.get_last_lr()[0]),
        lower_bound=float(lower),
        upper_bound=float(upper),
        entropy_mean=float((entropy * mask).sum() / ntok),
        skipped_updates=float(skipped),
        updates=float(len(losses)),
        n_tokens=ntok,
        rollout_train_logp_abs_diff=float(((old_logp8 - batch.rollout_logp).abs() * mask).sum() / ntok),
    )
    if is_w is not None:
        w = is_w[mask > 0]
        metrics.update(tis_weight_mean=float(w.mean()), tis_weight_min=float(w.min()), tis_capped_share=float((w >= a.tis_cap).float().mean()))
    return UpdateResult(
        metrics=metrics, logp_fp8=logp8, old_logp_fp8=old_logp8.float(), logp_bf16=logp16,
        old_logp_bf16=None if old_logp16 is None else old_logp16.float(), entropy=entropy,
        tis_weight=is_w, minibatch=minibatch, skipped_updates=skipped, timings=timings,
    )


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0
