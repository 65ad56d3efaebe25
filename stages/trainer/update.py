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

Phases (:func:`policy_update` calls them in order): :func:`split_rows` (the plan
and this rank's rows), :func:`old_logprobs` (steps 1-2), :func:`minibatch_update`
per mini-batch (steps 3-5: the BF16 shadow of π_θ, the clip mode's per-update
bounds, :func:`micro_batch_pass` over the micro-batches, :func:`optimizer_step`),
and :func:`gather_step_stats` (the step's statistics over every rank's tokens).

One forward path and kernel shape contracts: :mod:`stages.trainer.forward`; the
reductions over ranks: :mod:`stages.trainer.collective`.

Data parallelism (SPMD): the mini-batch partition does not depend on the number
of ranks. Mini-batch j is rows ``order[j*B:(j+1)*B]`` of a permutation seeded by
the step, cut into micro-batches of ``micro_batch_size`` as in one process; rank r
of W takes the r-th contiguous run of ``ceil(k/W)`` of its k micro-batches. So the
W ranks together run exactly the micro-batches of the 1-process run, and with
``B/W`` a multiple of the micro-batch size each rank runs the r-th W-th of the
rows. Every batch statistic is global: the token-mean denominator is all-reduced
(an integer count: exact), and the step metrics are computed on the gathered
per-token tensors by the same code as in one process (:class:`Collective`).

Padding micro-batches: every forward and backward under FSDP is a collective, so
all ranks must run as many of them, in every phase. The last mini-batch of a step
whose size is not a multiple of B is partial and leaves some ranks fewer
micro-batches (or none); each rank tops its share up to the most any rank runs
(:func:`plan_depth`, computed locally from the plan's inputs) with a padding
micro-batch: one real row of the batch with loss mask, advantage and rollout
log-probs 0 (:func:`local_rows`), whose loss and gradient are exactly 0 and whose
outputs land in a row that is dropped before anything is gathered. One process
never pads.

Token order: row i of every ``[N, T]`` tensor is sample i of the batch (groups
contiguous); column t is the log-prob of ``input_ids[:, t]`` given its prefix.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from fp8rl_core.calibration.bapo import UpdateBoundsRule
from fp8rl_core.calibration.clip_modes import per_update_rule
from fp8rl_core.objective.corrections import step_weights
from fp8rl_core.objective.losses import importance_ratio, loss_bounds
from fp8rl_core.registered import LOSS_STATISTICS, POLICY_LOSSES
from stages.trainer import old_logp as old_logp
from stages.trainer.collective import SINGLE_PROCESS_COLLECTIVE, Collective
from stages.trainer.forward import policy_logprobs, token_multiple
from stages.trainer.minibatch_plan import check_world_size, minibatch_plan, pad_micros, plan_depth  # noqa: F401  (re-exported)

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.campaign import CampaignConfig


def maybe_fault(stage: str, point: int) -> None:
    """Test hook for crash tests (``FP8RL_FAULT``, see storage.faults); a no-op otherwise."""
    from storage import faults

    faults.point(f"mb{point}")


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

    def to(self, device: torch.device | str) -> "TrainBatch":
        return TrainBatch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.response_mask,
                    self.rollout_logp,
                    self.advantages,
                    self.sample_ids,
                )
            )
        )

    def cpu(self) -> "TrainBatch":
        """The batch on the host (itself when it is there already)."""
        return TrainBatch(
            *(
                t.cpu()
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.response_mask,
                    self.rollout_logp,
                    self.advantages,
                    self.sample_ids,
                )
            )
        )

    def rows(self, idx: torch.Tensor) -> "TrainBatch":
        return TrainBatch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.response_mask[idx],
            self.rollout_logp[idx],
            self.advantages[idx],
            self.sample_ids[idx],
        )


@dataclass
class UpdateResult:
    """Per-token arrays ([N, T], float32, on CPU, valid where response_mask) and step scalars."""

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
    rows: torch.Tensor | None = None  # global rows this rank trained (its share of the per-token tables)
    row_bounds: torch.Tensor | None = None  # [N, 2] (L, H) of each row's epoch-0 update (bounds per update: BAPO)


# --------------------------------------------------------------------------- optimizer


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


@contextmanager
def lr_override(optimizer: torch.optim.Optimizer, scheduler, lr: float | None) -> Iterator[None]:
    """Train at learning rate ``lr`` inside the block (None: unchanged); the schedule's own LRs come back after."""
    if lr is None:
        yield
        return
    groups = optimizer.param_groups
    saved_base, saved_lr = list(scheduler.base_lrs), [g["lr"] for g in groups]
    scheduler.base_lrs = [lr for _ in saved_base]
    for g in groups:
        g["lr"] = lr
    try:
        yield
    finally:
        scheduler.base_lrs = saved_base
        for g, v in zip(groups, saved_lr):
            g["lr"] = v


def local_rows(
    batch: TrainBatch, mine: torch.Tensor, world_size: int
) -> tuple[TrainBatch, torch.Tensor, torch.Tensor | None]:
    """This rank's rows of the global ``batch`` (in global order) and, under several ranks, a padding row.

    Returns ``(local, rows, pad)``: ``local`` the ``[n_r (+1), T]`` batch, ``rows``
    the global row of each local row, ``pad`` the local index ``[1]`` of the padding
    row (None in one process). The padding row is global row 0 (real tokens, so
    its forward is an ordinary one; it exists whenever the step has rows) with
    response mask, advantage and rollout log-probs 0: any loss over it, and its
    gradient, is exactly 0, and it never enters a token count.
    """
    if world_size == 1:
        return batch.rows(mine), mine, None
    rows = torch.cat([mine, torch.zeros(1, dtype=torch.long)])
    local = batch.rows(rows)
    for t in (local.response_mask, local.rollout_logp, local.advantages):
        t[-1] = 0
    return local, rows, torch.tensor([mine.numel()])


# --------------------------------------------------------------------------- the update


@dataclass
class StepRows:
    """This rank's share of a step's global batch: its rows, its micro-batches, its padding row.

    ``plan`` (every epoch's mini-batches, each a list of this rank's micro-batches
    of *global* row indices) comes from :func:`minibatch_plan`; ``local`` holds
    this rank's rows (plus the padding row under several ranks) on the device.
    """

    n: int  # rows of the global batch
    plan: list[list[torch.Tensor]]
    per_epoch: int  # mini-batches per epoch
    mine: torch.Tensor  # [n_r] global rows this rank trains (sorted)
    local: TrainBatch  # [n_r (+1 padding row), T] on the device
    local_global: torch.Tensor  # [n_r (+1)] global row of each local row
    pad: torch.Tensor | None  # [1] local index of the padding row (None in one process)
    where: torch.Tensor  # [N] global row -> local row (-1: another rank's)
    depth: list[int]  # micro-batches every rank runs in each mini-batch
    sub: torch.Tensor | None  # [n_r (+1)] bool rows with shadow passes (None: all), on the host like the row indices
    trim: bool = False  # token-budget micro-batches: each forward cut to its micro-batch's longest row

    def logprobs(self, model, r: torch.Tensor, mode: str, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:func:`policy_logprobs` of local rows ``r`` (trimmed to their own width under a token budget)."""
        return policy_logprobs(
            model, self.local.input_ids[r], self.local.attention_mask[r], mode=mode, trim=self.trim, **kw
        )

    def real(self, k: int) -> list[torch.Tensor]:
        """Local row indices of mini-batch ``k``'s micro-batches (this rank's, no padding)."""
        return [self.where[m] for m in self.plan[k]]

    def padded(self, k: int) -> list[torch.Tensor]:
        """Mini-batch ``k``'s micro-batches, topped up with padding ones to every rank's count."""
        return pad_micros(self.real(k), self.depth[k], self.pad)

    def shadowed(self, r: torch.Tensor) -> torch.Tensor:
        """The shadowed rows of micro-batch ``r``; under several ranks never empty (padding instead)."""
        r = r if self.sub is None else r[self.sub[r]]
        return r if r.numel() or self.pad is None else self.pad


def split_rows(
    batch: TrainBatch,
    cfg: CampaignConfig,
    seed: int,
    collective: Collective,
    device: torch.device,
    shadow_rows: torch.Tensor | None,
) -> StepRows:
    """Plan the step's mini-batches and take this rank's rows of ``batch`` onto ``device``."""
    n = batch.size
    budget = cfg.algorithm.max_tokens_per_micro_batch is not None  # token budget: split by length, trimmed
    split = (
        dict(lengths=batch.attention_mask.sum(1).cpu(), multiple=token_multiple(cfg.precision.train)) if budget else {}
    )
    plan = minibatch_plan(n, cfg, seed, rank=collective.rank, world_size=collective.world_size, **split)
    per_epoch = len(plan) // cfg.algorithm.ppo_epochs
    mine = torch.unique(torch.cat([m for mbs in plan[:per_epoch] for m in mbs] or [torch.zeros(0, dtype=torch.long)]))
    local, local_global, pad = local_rows(batch, mine, collective.world_size)
    where = torch.full((n,), -1, dtype=torch.long)
    where[mine] = torch.arange(mine.numel())
    # host, like the micro-batches' row indices it selects from (a device mask cannot index a host tensor)
    sub = None if shadow_rows is None or bool(shadow_rows.all()) else shadow_rows.cpu().bool()[local_global]
    return StepRows(
        n,
        plan,
        per_epoch,
        mine,
        local.to(device),
        local_global,
        pad,
        where,
        plan_depth(n, cfg, seed, collective.world_size, **split),
        sub,
        trim=budget,
    )


@dataclass
class StepTensors:
    """Per-token tensors of one rank's rows (``[n_r (+1), T]``, float32): the update's inputs and records."""

    mask: torch.Tensor  # response mask
    adv_tok: torch.Tensor  # advantage on every response token
    old8: torch.Tensor  # π_old, training precision
    old16: torch.Tensor | None  # π_old, BF16 shadow (shadow steps)
    logp16: torch.Tensor | None  # π_θ before each epoch-0 update, BF16 shadow (shadow steps)
    is_w: torch.Tensor | None  # TIS weights (algorithm.tis)
    logp8: torch.Tensor  # π_θ of each row's epoch-0 update, training precision
    entropy: torch.Tensor
    thresholds: tuple[float, float] | None = None  # the correction's calibrated thresholds (None: configured)


def _no_grad_logprobs(
    model, rows: StepRows, micros: list[torch.Tensor], mode: str, *, shadow: bool, out: torch.Tensor
) -> None:
    """Fill ``out`` with the no-grad log-probs of ``micros`` (BF16 shadow rows only when ``shadow``)."""
    with torch.no_grad():
        for r in micros:
            r = rows.shadowed(r) if shadow else r
            if r.numel():
                out[r] = rows.logprobs(model, r, mode, shadow=shadow)[0]


def old_logprobs(
    model,
    rows: StepRows,
    cfg: CampaignConfig,
    *,
    shadow: bool,
    timings: dict[str, float],
    reuse_first: bool = False,
    thresholds: tuple[float, float] | None = None,
) -> StepTensors:
    """Phase 1: π_old in the training precision and, on shadow steps, in BF16; the TIS weights.

    Runs in the micro-batches of the first epoch's plan (the same ones on 1 or W
    ranks). Rows without a shadow pass (subsampled shadow) hold NaN BF16 values.
    ``reuse_first``: the first micro-batch's π_old is left to its own update's forward
    (:mod:`stages.trainer.old_logp`), and so are the TIS weights, which need all of π_old.
    """
    a, mode, x = cfg.algorithm, cfg.precision.train, rows.local
    first = [r for k in range(rows.per_epoch) for r in rows.padded(k)]
    mask = x.response_mask.float()  # [n_r (+1), T]
    t0 = time.perf_counter()
    old8 = torch.zeros(x.input_ids.shape, dtype=torch.float32, device=mask.device)
    _no_grad_logprobs(model, rows, first[1:] if reuse_first else first, mode, shadow=False, out=old8)
    timings["old_logp_s"] = time.perf_counter() - t0
    old16 = logp16 = None
    if shadow:
        t0 = time.perf_counter()
        old16 = torch.full_like(old8, float("nan") if rows.sub is not None else 0.0)
        _no_grad_logprobs(model, rows, first, mode, shadow=True, out=old16)
        logp16 = torch.zeros_like(old8) if rows.sub is None else torch.full_like(old8, float("nan"))
        timings["shadow_s"] = time.perf_counter() - t0
    is_w = None if reuse_first else step_weights(old8, x.rollout_logp, mask, a, thresholds)
    return StepTensors(
        mask,
        x.advantages.float()[:, None] * mask,
        old8,
        old16,
        logp16,
        is_w,
        torch.zeros_like(old8),
        torch.zeros_like(old8),
        thresholds,
    )


@dataclass
class UpdateLog:
    """What the mini-batch updates of a step leave behind besides the weights."""

    minibatch: torch.Tensor  # [N] mini-batch index of each global row in epoch 0
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    skipped: int = 0
    per_update: list = field(default_factory=list)  # per-update bound results (a per-update clip mode)
    epoch0_bounds: dict[int, tuple[float, float]] = field(default_factory=dict)  # mini-batch -> (L, H)


def update_bounds(
    model,
    rows: StepRows,
    micros: list[torch.Tensor],
    t: StepTensors,
    cfg: CampaignConfig,
    rule: UpdateBoundsRule,
    collective: Collective,
):
    """(L, H) of a clip mode that picks bounds before every update (its registry hook), from the
    update's current ratios over every rank's tokens; returns the hook's result (``.lower``, ``.upper``)."""
    mode = cfg.precision.train
    with torch.no_grad():
        cur = [importance_ratio(rows.logprobs(model, r, mode)[0], t.old8[r]) for r in micros]
    return rule.bounds(
        torch.cat([c.reshape(-1) for c in cur]),
        torch.cat([t.adv_tok[r].reshape(-1) for r in micros]),
        torch.cat([t.mask[r].reshape(-1) for r in micros]),
        cfg.calibration,
        collective.world_size > 1,
    )


def micro_batch_pass(
    model,
    rows: StepRows,
    micros: list[torch.Tensor],
    t: StepTensors,
    cfg: CampaignConfig,
    *,
    bounds: tuple[float, float],
    tokens: float,
    seqs: float,
    world_size: int,
    record: bool,
    adopt_old: bool = False,
) -> float:
    """Forward and backward of one mini-batch's micro-batches, gradients accumulated; returns the summed loss.

    ``tokens``/``seqs``: the mini-batch's global token and sequence counts (loss
    denominators); ``bounds``: the loss's own (L, H). ``record``: keep π_θ and the
    entropy of these rows (epoch 0). Padding micro-batches have mask 0: they add
    0 to every sum. ``adopt_old``: these forwards run on the step's starting weights, so their
    log-probs are π_old (:mod:`stages.trainer.old_logp`): taken as such, with the TIS weights after them.
    """
    a = cfg.algorithm
    loss_fn = POLICY_LOSSES.get(a.loss)
    total = 0.0
    for r in micros:
        lp, ent = rows.logprobs(model, r, cfg.precision.train, with_entropy=True)
        if adopt_old:
            t.old8[r] = lp.detach()
            t.is_w = step_weights(t.old8, rows.local.rollout_logp, t.mask, a, t.thresholds)
        loss, _ = loss_fn(
            lp,
            t.old8[r],
            t.adv_tok[r],
            t.mask[r],
            lower=bounds[0],
            upper=bounds[1],
            dual_clip=a.dual_clip,
            is_weights=None if t.is_w is None else t.is_w[r],
            agg=a.loss_agg,
            global_token_count=max(tokens, 1.0),
            global_seq_count=seqs,
            norm_len=float(cfg.rollout.max_new_tokens),
        )
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * (ent * t.mask[r]).sum() / max(tokens, 1.0)
        (loss * float(world_size)).backward()  # FSDP/DDP average gradients over ranks: undo it for global sums
        total += float(loss.detach())
        if record:
            t.logp8[r], t.entropy[r] = lp.detach(), ent.detach()
    return total


def optimizer_step(
    model, optimizer, scheduler, loss: float, cfg: CampaignConfig, collective: Collective, log: UpdateLog
) -> None:
    """Clip the gradient and step, unless the loss or the gradient norm is not finite (then skip, recorded).

    The gradients are freed either way (set to None): nothing reads them before the next
    update's backward, and after a stage's last update none stay on the device through the
    rollout and the weight sync (the memory plan counts only parameters and AdamW state there)."""
    gn = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.algorithm.grad_clip)
    grad_norm = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)  # a DTensor under FSDP2
    if math.isfinite(loss) and math.isfinite(grad_norm):
        optimizer.step()
        scheduler.step()
        if collective.world_size > 1:
            from stages.trainer.distributed import after_optimizer_step

            after_optimizer_step(model)
    else:
        log.skipped += 1
    optimizer.zero_grad(set_to_none=True)
    log.losses.append(loss)
    log.grad_norms.append(grad_norm)


def minibatch_update(
    model,
    optimizer,
    scheduler,
    rows: StepRows,
    k: int,
    t: StepTensors,
    cfg: CampaignConfig,
    *,
    bounds: tuple[float, float],
    shadow: bool,
    collective: Collective,
    log: UpdateLog,
    timings: dict[str, float],
    rule: UpdateBoundsRule | None = None,
    reuse_first: bool = False,
) -> None:
    """Phase 2, one update: the BF16 shadow of π_θ (epoch 0 of shadow steps), the clip mode's
    per-update bounds if it has them, the micro-batches' forward/backward, the optimizer step."""
    epoch, mb_index = divmod(k, rows.per_epoch)
    micros = rows.padded(k)
    if epoch == 0:
        for m in rows.plan[k]:
            log.minibatch[m] = mb_index
        maybe_fault("train", mb_index)
    if shadow and epoch == 0:
        t0 = time.perf_counter()
        _no_grad_logprobs(model, rows, micros, cfg.precision.train, shadow=True, out=t.logp16)
        timings["shadow_s"] += time.perf_counter() - t0
    lower, upper = bounds
    if rule is not None:  # a clip mode with bounds per update (its registry hooks)
        b = update_bounds(model, rows, micros, t, cfg, rule, collective)
        log.per_update.append(b)
        if epoch == 0:
            log.epoch0_bounds.setdefault(mb_index, (b.lower, b.upper))
        lower, upper = b.lower, b.upper
    real = rows.real(k)
    tokens = collective.sum(float(sum(float(t.mask[r].sum()) for r in real)))
    seqs = collective.sum(float(sum(r.numel() for r in real)))
    optimizer.zero_grad(set_to_none=True)
    loss = micro_batch_pass(
        model,
        rows,
        micros,
        t,
        cfg,
        bounds=loss_bounds(cfg.algorithm.loss, lower, upper, cfg.algorithm),
        tokens=tokens,
        seqs=seqs,
        world_size=collective.world_size,
        record=epoch == 0,
        adopt_old=reuse_first and k == 0,
    )
    optimizer_step(model, optimizer, scheduler, collective.sum(loss), cfg, collective, log)


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
    collective: Collective = SINGLE_PROCESS_COLLECTIVE,
    shadow_rows: torch.Tensor | None = None,
    correction_thresholds: tuple[float, float] | None = None,
) -> UpdateResult:
    """Run ``ppo_epochs`` passes of mini-batch updates over ``batch`` (the *global* batch).

    ``bounds`` = (L, H) ratio clip bounds in force; ``shadow`` turns on the BF16
    shadow forwards; ``seed`` fixes the mini-batch shuffle (deterministic per step).
    Under several ranks each rank passes the same global batch and trains on its
    share of every mini-batch (:func:`minibatch_plan`), topped up with padding
    micro-batches so that every rank runs as many forwards and backwards (a partial
    last mini-batch; see the module docstring); the returned per-token arrays and
    metrics are global and identical on every rank.
    ``shadow_rows`` (``[N]`` bool over the global batch, optional): shadow only
    these sequences (subsampled shadow passes, ``fp8rl_core.calibration.subsample``); the
    BF16 log-probs of the other rows are NaN. ``correction_thresholds``: the mismatch
    correction's calibrated thresholds in force (None: the configured ones).
    """
    check_world_size(cfg, collective.world_size)
    rows = split_rows(batch, cfg, seed, collective, next(model.parameters()).device, shadow_rows)
    timings: dict[str, float] = {}
    model.train()
    rule = per_update_rule(cfg.calibration.mode)  # None unless the clip mode picks bounds per update
    reuse = old_logp.first_forward_is_old(
        rows.plan, rows.local.input_ids.device, collective.world_size, per_update_bounds=rule is not None
    )  # π_old of mini-batch 0 from its update
    t = old_logprobs(  # 1. π_old (+ BF16 shadow)
        model, rows, cfg, shadow=shadow, timings=timings, reuse_first=reuse, thresholds=correction_thresholds
    )
    log = UpdateLog(minibatch=torch.zeros(rows.n, dtype=torch.long))
    t_train = time.perf_counter()
    for k in range(len(rows.plan)):  # 2. one optimizer update per mini-batch, every epoch
        minibatch_update(
            model,
            optimizer,
            scheduler,
            rows,
            k,
            t,
            cfg,
            bounds=bounds,
            shadow=shadow,
            collective=collective,
            log=log,
            timings=timings,
            rule=rule,
            reuse_first=reuse,
        )
    timings["update_s"] = time.perf_counter() - t_train
    return gather_step_stats(
        batch,
        rows,
        t,
        log,
        cfg,
        bounds=bounds,
        collective=collective,  # 3. statistics
        lr=float(scheduler.get_last_lr()[0]),
        timings=timings,
        rule=rule,
    )


def gather_step_stats(
    batch: TrainBatch,
    rows: StepRows,
    t: StepTensors,
    log: UpdateLog,
    cfg: CampaignConfig,
    *,
    bounds: tuple[float, float],
    collective: Collective,
    lr: float,
    timings: dict[str, float],
    rule: UpdateBoundsRule | None = None,
) -> UpdateResult:
    """Phase 3: every rank's per-token tensors gathered into ``[N, T]`` (global, CPU), and the step's
    statistics computed on them by the same code as in one process."""
    n, mine = rows.n, rows.mine

    def glob(x: torch.Tensor | None) -> torch.Tensor | None:
        if x is None:
            return None
        out = torch.zeros((n, *x.shape[1:]), dtype=x.dtype)
        own = x[: mine.numel()]  # without the padding row
        out[collective.gather_rows(mine)] = collective.gather_rows(own.detach().float().cpu())
        return out

    g = {
        k: glob(v)
        for k, v in dict(
            logp8=t.logp8, old8=t.old8, logp16=t.logp16, old16=t.old16, entropy=t.entropy, is_w=t.is_w
        ).items()
    }
    minibatch = log.minibatch if collective.world_size == 1 else _owned_max(collective, log.minibatch, mine, n)
    host = batch.cpu()  # the gathered per-token tensors are on the host: so is the batch they are read with
    metrics = step_metrics(host, g["logp8"], g["old8"], g["entropy"], g["is_w"], cfg, bounds=bounds)
    if rule is not None:  # clip statistics at each row's own update bounds
        fmask = host.response_mask.float()
        metrics.update(
            {
                k: float(v)
                for k, v in rule.clip_stats(
                    g["logp8"],
                    g["old8"],
                    host.advantages.float()[:, None] * fmask,
                    fmask,
                    minibatch,
                    log.epoch0_bounds,
                    dual_clip=cfg.algorithm.dual_clip,
                    is_weights=g["is_w"],
                ).items()
            }
        )
        metrics.update(rule.summarize(log.per_update))
    gn = log.grad_norms
    metrics.update(
        loss=_mean(log.losses),
        grad_norm=_mean(gn),
        grad_norm_max=max(gn) if gn else 0.0,
        lr=lr,
        skipped_updates=float(log.skipped),
        updates=float(len(log.losses)),
    )
    row_bounds = (
        None if rule is None else torch.tensor([log.epoch0_bounds[int(k)] for k in minibatch], dtype=torch.float32)
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
        skipped_updates=log.skipped,
        timings=timings,
        rows=mine,
        row_bounds=row_bounds,
    )


def _owned_max(collective: Collective, minibatch: torch.Tensor, mine: torch.Tensor, n: int) -> torch.Tensor:
    """Each row's mini-batch index, as set by the rank that trained it."""
    rows, owned = collective.gather_rows(mine), collective.gather_rows(minibatch[mine])
    return torch.zeros(n, dtype=torch.long).index_copy_(0, rows, owned)


def step_metrics(batch: TrainBatch, logp8, old8, entropy, is_w, cfg: CampaignConfig, *, bounds) -> dict[str, float]:
    """Clip shares, KL, entropy, TIS and mismatch statistics of a step, over all its tokens."""
    a = cfg.algorithm
    mask = batch.response_mask.float()
    adv_tok = batch.advantages.float()[:, None] * mask
    with torch.no_grad():
        stats_fn = LOSS_STATISTICS.get(a.loss)  # the loss's own clip statistics (gspo: sequence ratios)
        _, stats = stats_fn(
            logp8,
            old8,
            adv_tok,
            mask,
            lower=bounds[0],
            upper=bounds[1],
            dual_clip=a.dual_clip,
            is_weights=is_w,
            agg="token-mean",
        )
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


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


__all__ = [
    "TrainBatch",
    "UpdateResult",
    "make_optimizer",
    "maybe_fault",
    "local_rows",
    "minibatch_plan",
    "pad_micros",
    "plan_depth",
    "policy_update",
    "step_metrics",
]
