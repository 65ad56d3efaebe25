"""One RL policy update over a step's batch, with the BF16 shadow passes.

This is the numerical heart of the train stage, kept free of storage so it can be
tested on tensors. Per step (DESIGN.md sections 2-3):

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

One forward path: every forward of a step — π_old, π_θ and both shadow passes —
goes through :func:`policy_logprobs`, which calls
:func:`fp8rl_core.logprobs.sequence_logprobs` (autocast of the inputs' device,
position ids counted over real tokens, log-softmax chunked over the vocabulary).

Kernel shape contracts (DESIGN.md section 3): :func:`policy_logprobs` pads each
micro-batch on the right (attention mask 0, so no real token sees the padding;
loss mask 0, so no padded column enters a loss or a statistic) until its token
count ``rows x T`` is a multiple of :func:`token_multiple` of the precision mode
(16 for tensorwise/rowwise ``_scaled_mm``, 128 for torchao's blockwise backward).
Padding tokens do enter a tensorwise activation amax, as they would on the GPU.

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
from dataclasses import dataclass, field

import torch

from fp8rl_core.config import CampaignConfig
from fp8rl_core.fp8_linear import TOKEN_MULTIPLE
from fp8rl_core.logprobs import sequence_logprobs
from fp8rl_core import bapo as bapo_rule
from fp8rl_core.losses import POLICY_LOSSES, importance_ratio, loss_bounds, policy_loss, tis_weights
import fp8rl_core.gspo  # noqa: F401,E402  registers the "gspo" loss (issue 15)
from fp8rl_core.precision import bf16_shadow
from stages import old_logp
from stages.minibatch_plan import check_world_size, minibatch_plan, pad_micros, plan_depth  # noqa: F401  (re-exported)


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
        return TrainBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.response_mask,
                                                    self.rollout_logp, self.advantages, self.sample_ids)))

    def rows(self, idx: torch.Tensor) -> "TrainBatch":
        return TrainBatch(self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx],
                          self.rollout_logp[idx], self.advantages[idx], self.sample_ids[idx])


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
    row_bounds: torch.Tensor | None = None  # [N, 2] (L, H) of each row's epoch-0 update when bounds vary per update (BAPO)


# --------------------------------------------------------------------------- collectives


class Collective:
    """Global reductions of the trainer; this base class is one process (identity)."""

    rank: int = 0
    world_size: int = 1

    def sum(self, x: float) -> float:
        return x

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``[n_r, ...]`` rows in rank order."""
        return t

    def max(self, x: float) -> float:
        return x


class DistCollective(Collective):
    """Reductions over a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group=None, device: torch.device | str = "cpu") -> None:
        import torch.distributed as dist

        self.dist, self.group, self.device = dist, group, torch.device(device)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def sum(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, group=self.group)
        return float(t.item())

    def max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        n = torch.tensor([t.shape[0]], device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        self.dist.all_gather(sizes, n, group=self.group)
        rows = [int(s.item()) for s in sizes]
        big = max(rows)
        src = t.to(self.device)
        if src.shape[0] < big:  # all_gather needs equal shapes: pad, then cut
            src = torch.cat([src, src.new_zeros((big - src.shape[0], *src.shape[1:]))])
        out = [torch.empty_like(src) for _ in range(self.world_size)]
        self.dist.all_gather(out, src.contiguous(), group=self.group)
        return torch.cat([o[:r] for o, r in zip(out, rows)]).to(t.device)


LOCAL = Collective()


# --------------------------------------------------------------------------- the one forward path


def token_multiple(mode: str) -> int:
    """Token-count multiple a micro-batch must meet for ``mode``'s FP8 kernels (1 for bf16)."""
    for granularity, m in TOKEN_MULTIPLE.items():
        if mode.endswith(granularity):
            return m
    return 1


def padded_width(rows: int, width: int, multiple: int) -> int:
    """Smallest ``T >= width`` with ``rows * T`` a multiple of ``multiple``."""
    step = multiple // math.gcd(rows, multiple) if rows else 1
    return -(-width // step) * step


def pad_to_contract(input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int,
                    pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``[m, T]`` to ``[m, T']`` with ``m * T'`` a multiple of ``multiple`` (mask 0)."""
    m, t = input_ids.shape
    extra = padded_width(m, t, multiple) - t
    if extra == 0:
        return input_ids, attention_mask
    pad = (0, extra)
    return (torch.nn.functional.pad(input_ids, pad, value=pad_id),
            torch.nn.functional.pad(attention_mask, pad, value=0))


def policy_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    mode: str,
    shadow: bool = False,
    with_entropy: bool = False,
    micro_batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of ``model`` over ``[N, T]``: the step's one forward path.

    Micro-batches of ``micro_batch_size`` rows (None: all at once), each padded to
    ``mode``'s kernel contract; ``shadow`` runs the BF16 shadow pass (same master
    weights, FP8 linears bypassed). Differentiable when grad is enabled. Returns
    float32 ``[N, T]`` (padding columns removed).
    """
    n, t = input_ids.shape
    step = n if micro_batch_size is None else micro_batch_size
    run_mode = "bf16" if shadow else mode
    multiple = token_multiple(run_mode)
    lps, ents = [], []
    for s in range(0, n, max(step, 1)):
        ids, am = pad_to_contract(input_ids[s : s + step], attention_mask[s : s + step], multiple)
        if shadow:
            with bf16_shadow(model):
                lp, ent = sequence_logprobs(model, ids, am, mode=run_mode, with_entropy=with_entropy)
        else:
            lp, ent = sequence_logprobs(model, ids, am, mode=run_mode, with_entropy=with_entropy)
        lps.append(lp[:, :t])
        ents.append(None if ent is None else ent[:, :t])
    if not lps:
        empty = torch.zeros(0, t, device=input_ids.device)
        return empty, (empty if with_entropy else None)
    lp = torch.cat(lps) if len(lps) > 1 else lps[0]
    ent = None if not with_entropy else (torch.cat(ents) if len(ents) > 1 else ents[0])
    return lp, ent


# --------------------------------------------------------------------------- optimizer


def _lr_lambda(warmup: int):
    return lambda n: min(1.0, (n + 1) / warmup) if warmup > 0 else 1.0


def make_optimizer(model: torch.nn.Module, cfg: CampaignConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the fp32 master weights (on their device) plus a linear-warmup schedule (per update)."""
    a = cfg.algorithm
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=a.betas, weight_decay=a.weight_decay, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(a.warmup_steps))
    return opt, sched


def local_rows(batch: TrainBatch, mine: torch.Tensor, world_size: int) -> tuple[TrainBatch, torch.Tensor, torch.Tensor | None]:
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
    collective: Collective = LOCAL,
    shadow_rows: torch.Tensor | None = None,
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
    these sequences (subsampled shadow passes, ``fp8rl_core.subsample``); the
    BF16 log-probs of the other rows are NaN.
    """
    a, mode = cfg.algorithm, cfg.precision.train
    check_world_size(cfg, collective.world_size)
    device = next(model.parameters()).device
    full = batch
    n = full.size
    plan = minibatch_plan(n, cfg, seed, rank=collective.rank, world_size=collective.world_size)
    per_epoch = len(plan) // a.ppo_epochs
    mine = torch.unique(torch.cat([m for mbs in plan[:per_epoch] for m in mbs] or [torch.zeros(0, dtype=torch.long)]))
    local, local_global, pad = local_rows(full, mine, collective.world_size)  # this rank's rows (+ padding row)
    local = local.to(device)
    where = torch.full((n,), -1, dtype=torch.long)
    where[mine] = torch.arange(mine.numel())  # global row -> local row
    depth = plan_depth(n, cfg, seed, collective.world_size)

    def padded(k: int) -> list[torch.Tensor]:
        """Local row indices of mini-batch k's micro-batches, padded to every rank's count."""
        return pad_micros([where[m] for m in plan[k]], depth[k], pad)

    mask = local.response_mask.float()  # [n_r (+1 padding row), T]
    adv_tok = local.advantages.float()[:, None] * mask
    timings: dict[str, float] = {}
    model.train()
    ws = float(collective.world_size)  # FSDP/DDP average gradients over ranks: undo it for global sums

    # 1. π_old (training precision) and its BF16 shadow, in micro-batches
    # (in the micro-batches of the first epoch's plan: the same ones on 1 or W ranks)
    first = [r for k in range(per_epoch) for r in padded(k)]

    sub = None if shadow_rows is None or bool(shadow_rows.all()) else shadow_rows.bool()[local_global].to(device)

    def shadowed(r: torch.Tensor) -> torch.Tensor:
        """The shadowed rows of micro-batch ``r``; under several ranks never empty (padding instead)."""
        r = r if sub is None else r[sub[r]]
        return r if r.numel() or pad is None else pad

    reuse = old_logp.first_forward_is_old(cfg, plan, device, collective.world_size)  # π_old of mini-batch 0

    def no_grad_pass(shadow_pass: bool) -> torch.Tensor:
        fill = float("nan") if shadow_pass and sub is not None else 0.0
        out = torch.full(local.input_ids.shape, fill, dtype=torch.float32, device=device)
        with torch.no_grad():
            for r in first[1:] if reuse and not shadow_pass else first:
                r = shadowed(r) if shadow_pass else r
                if r.numel():
                    out[r] = policy_logprobs(model, local.input_ids[r], local.attention_mask[r], mode=mode, shadow=shadow_pass)[0]
        return out

    t0 = time.perf_counter()
    old8 = no_grad_pass(False)
    timings["old_logp_s"] = time.perf_counter() - t0
    old16 = logp16 = None
    if shadow:
        t0 = time.perf_counter()
        old16 = no_grad_pass(True)
        logp16 = torch.zeros_like(old8) if sub is None else torch.full_like(old8, float("nan"))
        timings["shadow_s"] = time.perf_counter() - t0
    is_w = tis_weights(old8, local.rollout_logp, cap=a.tis_cap) * mask if a.tis and not reuse else None

    # 2. mini-batch updates
    logp8, entropy = torch.zeros_like(old8), torch.zeros_like(old8)
    minibatch = torch.zeros(n, dtype=torch.long)
    loss_fn = POLICY_LOSSES.get(a.loss)
    lower, upper = bounds
    lb = loss_bounds(a.loss, lower, upper, a)  # the loss's own reading of (L, H), from the registry
    bapo_on, bapo_results, bapo_mb = cfg.calibration.mode == "bapo", [], {}  # BAPO: bounds per update
    losses, grad_norms, skipped = [], [], 0
    t_train = time.perf_counter()
    for k, micros in enumerate(plan):
        epoch, mb_index = divmod(k, per_epoch)
        real = [where[m] for m in micros]  # local row indices
        rows = padded(k)  # + padding micro-batches: mask 0, so they add 0 to every sum below
        if epoch == 0:
            for m in micros:
                minibatch[m] = mb_index
            maybe_fault("train", mb_index)
        if shadow and epoch == 0:
            t0 = time.perf_counter()
            with torch.no_grad():
                for r in map(shadowed, rows):
                    if r.numel():
                        logp16[r] = policy_logprobs(model, local.input_ids[r], local.attention_mask[r], mode=mode, shadow=True)[0]
            timings["shadow_s"] += time.perf_counter() - t0
        if bapo_on:  # BAPO as published: bounds from this update's current ratios (global sums), no BF16 pass
            with torch.no_grad():
                cur = [importance_ratio(policy_logprobs(model, local.input_ids[r], local.attention_mask[r], mode=mode)[0],
                                        old8[r]) for r in rows]
            b = bapo_rule.bapo_bounds(torch.cat([c.reshape(-1) for c in cur]),
                                      torch.cat([adv_tok[r].reshape(-1) for r in rows]),
                                      torch.cat([mask[r].reshape(-1) for r in rows]), cfg.calibration.bapo,
                                      reduce=bapo_rule.dist_sum if collective.world_size > 1 else None)
            bapo_results.append(b)
            if epoch == 0:
                bapo_mb.setdefault(mb_index, (b.lower, b.upper))  # epoch 0's bounds, for the step's clip statistics
            lb = loss_bounds(a.loss, b.lower, b.upper, a)
        mb_tokens = collective.sum(float(sum(float(mask[r].sum()) for r in real)))
        mb_seqs = collective.sum(float(sum(r.numel() for r in real)))
        optimizer.zero_grad(set_to_none=True)
        mb_loss = 0.0
        for r in rows:
            lp, ent = policy_logprobs(model, local.input_ids[r], local.attention_mask[r], mode=mode, with_entropy=True)
            if reuse and k == 0:  # π_old = π_θ here, bit for bit (stages/old_logp.py)
                old8[r] = lp.detach()
                is_w = tis_weights(old8, local.rollout_logp, cap=a.tis_cap) * mask if a.tis else None
            loss, _ = loss_fn(
                lp, old8[r], adv_tok[r], mask[r], lower=lb[0], upper=lb[1], dual_clip=a.dual_clip,
                is_weights=None if is_w is None else is_w[r], agg=a.loss_agg,
                global_token_count=max(mb_tokens, 1.0), global_seq_count=mb_seqs, norm_len=float(cfg.rollout.max_new_tokens),
            )
            if a.entropy_coef > 0:
                loss = loss - a.entropy_coef * (ent * mask[r]).sum() / max(mb_tokens, 1.0)
            (loss * ws).backward()
            mb_loss += float(loss.detach())
            if epoch == 0:
                logp8[r], entropy[r] = lp.detach(), ent.detach()
        mb_loss = collective.sum(mb_loss)
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        grad_norm = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)  # a DTensor under FSDP2
        if math.isfinite(mb_loss) and math.isfinite(grad_norm):
            optimizer.step()
            scheduler.step()
            if collective.world_size > 1:
                from stages.distributed import after_optimizer_step

                after_optimizer_step(model)
        else:
            skipped += 1
            optimizer.zero_grad(set_to_none=True)
        losses.append(mb_loss)
        grad_norms.append(grad_norm)
    timings["update_s"] = time.perf_counter() - t_train

    # 3. step metrics over every token of the step (gathered: global, same code as one process)
    def glob(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        out = torch.zeros((n, *t.shape[1:]), dtype=t.dtype)
        own = t[: mine.numel()]  # without the padding row
        out[collective.gather_rows(mine)] = collective.gather_rows(own.detach().float().cpu())
        return out

    g = {k: glob(v) for k, v in dict(logp8=logp8, old8=old8, logp16=logp16, old16=old16, entropy=entropy,
                                     is_w=is_w).items()}
    minibatch = minibatch if collective.world_size == 1 else _owned_max(collective, minibatch, mine, n)
    metrics = step_metrics(full, g["logp8"], g["old8"], g["entropy"], g["is_w"], cfg, bounds=bounds)
    if bapo_on:  # clip statistics at each row's own update bounds
        fmask = full.response_mask.float()
        metrics.update({k: float(v) for k, v in bapo_rule.step_clip_stats(
            g["logp8"], g["old8"], full.advantages.float()[:, None] * fmask, fmask, minibatch, bapo_mb,
            dual_clip=a.dual_clip, is_weights=g["is_w"]).items()})
    metrics.update(bapo_rule.summarize_updates(bapo_results))
    metrics.update(
        loss=_mean(losses), grad_norm=_mean(grad_norms), grad_norm_max=max(grad_norms) if grad_norms else 0.0,
        lr=float(scheduler.get_last_lr()[0]), skipped_updates=float(skipped), updates=float(len(losses)),
    )
    return UpdateResult(
        metrics=metrics, logp_fp8=g["logp8"], old_logp_fp8=g["old8"], logp_bf16=g["logp16"], old_logp_bf16=g["old16"],
        entropy=g["entropy"], tis_weight=g["is_w"], minibatch=minibatch, skipped_updates=skipped, timings=timings,
        rows=mine,
        row_bounds=torch.tensor([bapo_mb[int(k)] for k in minibatch], dtype=torch.float32) if bapo_on else None,
    )


def _owned_max(collective: Collective, minibatch: torch.Tensor, mine: torch.Tensor, n: int) -> torch.Tensor:
    """Each row's mini-batch index, as set by the rank that trained it."""
    return torch.zeros(n, dtype=torch.long).index_copy_(0, collective.gather_rows(mine), collective.gather_rows(minibatch[mine]))


def step_metrics(batch: TrainBatch, logp8, old8, entropy, is_w, cfg: CampaignConfig, *, bounds) -> dict[str, float]:
    """Clip shares, KL, entropy, TIS and mismatch statistics of a step, over all its tokens."""
    a = cfg.algorithm
    mask = batch.response_mask.float()
    adv_tok = batch.advantages.float()[:, None] * mask
    with torch.no_grad():
        stats_fn = POLICY_LOSSES.get("gspo") if a.loss == "gspo" else policy_loss  # gspo: sequence-ratio clip shares
        _, stats = stats_fn(logp8, old8, adv_tok, mask, lower=bounds[0], upper=bounds[1], dual_clip=a.dual_clip,
                            is_weights=is_w, agg="token-mean")
    ntok = float(mask.sum().clamp_min(1.0))
    m: dict[str, float] = {k: float(v) for k, v in stats.items()}
    m.update(
        lower_bound=float(bounds[0]), upper_bound=float(bounds[1]),
        entropy_mean=float((entropy * mask).sum() / ntok), n_tokens=ntok,
        rollout_train_logp_abs_diff=float(((old8 - batch.rollout_logp).abs() * mask).sum() / ntok),
    )
    if is_w is not None:
        w = is_w[mask > 0]
        m.update(tis_weight_mean=float(w.mean()), tis_weight_min=float(w.min()),
                 tis_capped_share=float((w >= a.tis_cap).float().mean()))
    return m


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


__all__ = [
    "Collective", "DistCollective", "LOCAL", "TrainBatch", "UpdateResult", "make_optimizer", "maybe_fault",
    "local_rows", "minibatch_plan", "pad_micros", "pad_to_contract", "padded_width", "plan_depth", "policy_logprobs",
    "policy_update", "step_metrics", "token_multiple",
]
