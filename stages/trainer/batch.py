"""The step's batch, its mini-batch plan, and this rank's share of it (rows, micro-batches, a padding row).

Token order: row i of every ``[N, T]`` tensor is sample i of the batch (groups
contiguous); column t is the log-prob of ``input_ids[:, t]`` given its prefix.

The mini-batch plan (:func:`minibatch_plan`), the same for any number of ranks. A step's
global batch of ``n`` rows is shuffled per epoch (seeded by the step), cut into mini-batches
of ``algorithm.ppo_mini_batch_size`` rows and each of those into the 1-process micro-batches
of ``algorithm.micro_batch_size`` rows. Under ``W`` ranks the micro-batches of a mini-batch
are dealt out in contiguous runs (rank r of W takes the r-th run of ``ceil(k/W)`` of its k
micro-batches), so the W ranks together run exactly the micro-batches of the 1-process run.

Padding micro-batches: every forward and backward under FSDP is a collective, so all ranks
must run as many of them, in every phase. The last mini-batch of a step whose size is not a
multiple of B is partial and leaves some ranks fewer micro-batches (or none); each rank tops
its share up to the most any rank runs (:func:`plan_depth`, computed locally from the plan's
inputs) with a padding micro-batch: one real row of the batch with loss mask, advantage and
rollout log-probs 0 (:func:`local_rows`), whose loss and gradient are exactly 0 and whose
outputs land in a row that is dropped before anything is gathered. One process never pads.

Token-budget micro-batches (``algorithm.max_tokens_per_micro_batch``): with
long-tailed response lengths, micro-batches of a fixed row count padded to the
batch's longest row spend most of their GEMM work on padding. With a budget,
each mini-batch's rows are sorted by length and cut greedily
(:func:`token_budget_micros`) so that each micro-batch, padded only to its own
longest row, stays within the budget; the mini-batches, and so the token-mean
denominators and every calibration statistic, are the same as without.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fp8rl_core.config.clip_mode_kinds import CLIP_MODE_KINDS
from stages.trainer.collective import Collective
from stages.trainer.forward import padded_width, token_multiple
from stages.trainer.types import StepRows, TrainBatch

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.campaign import CampaignConfig


def _micro_slices(idx: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [idx[i : i + size] for i in range(0, idx.numel(), size)]


def padded_tokens(rows: int, width: int, multiple: int) -> int:
    """Tokens a micro-batch of ``rows`` rows occupies once padded to ``width`` and the kernel's ``multiple``
    (``rows x T'``, ``T' = padded_width(rows, width, multiple)``)."""
    return rows * padded_width(rows, width, multiple)


def token_budget_micros(
    rows: torch.Tensor, lengths: torch.Tensor, *, max_rows: int, max_tokens: int, multiple: int = 1
) -> list[torch.Tensor]:
    """Split one mini-batch into micro-batches under a token budget (verl's dynamic batch size).

    Args:
        rows: ``[B]`` long, the mini-batch's row indices (in the step's shuffled order).
        lengths: ``[N]`` long, tokens of every row of the batch (prompt + response).
        max_rows: at most this many rows a micro-batch (``micro_batch_size``).
        max_tokens: at most this many padded tokens a micro-batch (:func:`padded_tokens` at its
            own longest row); a row alone over the budget runs alone.
        multiple: the kernel's token multiple (:func:`stages.trainer.forward.token_multiple`).
    Rows are sorted by length, longest first (ties keep their shuffled order), and filled
    greedily: the longest row of each micro-batch is its first. A pure function of its inputs,
    so every rank computes the same split.
    """
    lens = lengths[rows]
    order = torch.sort(lens, descending=True, stable=True).indices
    micros, cur, width = [], [], 0
    for i in order.tolist():
        n = int(lens[i])
        if cur and (len(cur) >= max_rows or padded_tokens(len(cur) + 1, width, multiple) > max_tokens):
            micros.append(rows[torch.tensor(cur, dtype=torch.long)])
            cur = []
        if not cur:
            width = n
        cur.append(i)
    if cur:
        micros.append(rows[torch.tensor(cur, dtype=torch.long)])
    return micros


def check_world_size(cfg: CampaignConfig, world_size: int) -> None:
    """Reject a config the trainer cannot run on ``world_size`` ranks (``ValueError``, one line).

    Full mini-batches must split into the same number of micro-batches per rank (FSDP
    collectives), the ranks together running the 1-process micro-batches. Several PPO
    epochs under several ranks are refused: π_old is computed on each rank's epoch-0
    rows only, and a later epoch's shuffle would hand a rank rows it holds no π_old for; so is
    a clip mode whose record runs in one process only.
    """
    a = cfg.algorithm
    if world_size > 1 and CLIP_MODE_KINDS.get(cfg.calibration.mode).one_process:
        raise ValueError(
            f"calibration.mode {cfg.calibration.mode} runs in one process only (its BF16 forwards are not built "
            f"for {world_size} ranks); use one process or another calibration.mode"
        )
    if a.ppo_mini_batch_size % (world_size * a.micro_batch_size):
        raise ValueError(
            f"algorithm.ppo_mini_batch_size={a.ppo_mini_batch_size} must be a multiple of world size "
            f"{world_size} x algorithm.micro_batch_size={a.micro_batch_size}: every rank must run the "
            "same number of micro-batches (FSDP collectives), and the ranks together the 1-process micro-batches"
        )
    if world_size > 1 and a.ppo_epochs > 1:
        raise ValueError(
            f"algorithm.ppo_epochs={a.ppo_epochs} is not supported on {world_size} ranks yet (each rank holds "
            "π_old for its epoch-0 rows only); use ppo_epochs: 1 (the presets' value) or one process"
        )


def minibatch_plan(
    n: int,
    cfg: CampaignConfig,
    seed: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    lengths: torch.Tensor | None = None,
    multiple: int = 1,
) -> list[list[torch.Tensor]]:
    """Per mini-batch (epoch-major), this rank's micro-batches as row-index tensors of the global batch.

    Independent of ``world_size`` as a set: the k 1-process micro-batches of
    mini-batch j are dealt out in contiguous runs of ``ceil(k/W)``, so the ranks'
    micro-batches together are the 1-process ones (and rank 0 runs the most). A
    partial last mini-batch can leave a rank fewer micro-batches, or none.
    With ``algorithm.max_tokens_per_micro_batch`` set, ``lengths`` (``[n]`` tokens per
    row) and ``multiple`` (the kernel's token multiple) cut each mini-batch by
    :func:`token_budget_micros` instead of in runs of ``micro_batch_size`` rows; the
    mini-batches themselves (and so every token-mean) do not change.
    """
    a = cfg.algorithm
    budget = a.max_tokens_per_micro_batch
    if budget is not None and lengths is None:
        raise ValueError("algorithm.max_tokens_per_micro_batch is set: minibatch_plan needs the rows' lengths")
    gen = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(a.ppo_epochs):
        order = torch.randperm(n, generator=gen)
        for mb in _micro_slices(order, a.ppo_mini_batch_size):
            if budget is None:
                micros = _micro_slices(mb, a.micro_batch_size)
            else:
                micros = token_budget_micros(
                    mb, lengths, max_rows=a.micro_batch_size, max_tokens=budget, multiple=multiple
                )
            share = -(-len(micros) // world_size)
            plan.append(micros[rank * share : (rank + 1) * share])
    return plan


def plan_depth(
    n: int, cfg: CampaignConfig, seed: int, world_size: int, *, lengths: torch.Tensor | None = None, multiple: int = 1
) -> list[int]:
    """Per mini-batch (epoch-major), the most micro-batches any rank runs in :func:`minibatch_plan`.

    A deterministic function of the plan's inputs: every rank computes it locally
    (no communication) and pads its share up to it (:func:`stages.trainer.batch.pad_micros`).
    """
    plans = [
        minibatch_plan(n, cfg, seed, rank=r, world_size=world_size, lengths=lengths, multiple=multiple)
        for r in range(world_size)
    ]
    return [max(len(p[k]) for p in plans) for k in range(len(plans[0]))]


def rank_plan(
    n: int,
    cfg: CampaignConfig,
    seed: int,
    *,
    rank: int,
    world_size: int,
    lengths: torch.Tensor | None = None,
    multiple: int = 1,
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """This rank's :func:`minibatch_plan` and every mini-batch's :func:`plan_depth`, once the config
    is known to fit ``world_size`` ranks (:func:`check_world_size`)."""
    check_world_size(cfg, world_size)
    split = dict(lengths=lengths, multiple=multiple)
    plan = minibatch_plan(n, cfg, seed, rank=rank, world_size=world_size, **split)
    return plan, plan_depth(n, cfg, seed, world_size, **split)


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
    for t in (local.response_mask, local.rollout_logp, local.advantages, local.center_mu):
        if t is not None:
            t[-1] = 0
    return local, rows, torch.tensor([mine.numel()])


def pad_micros(micros: list[torch.Tensor], depth: int, pad: torch.Tensor | None) -> list[torch.Tensor]:
    """``micros`` topped up to ``depth`` micro-batches with the padding micro-batch ``pad`` (None: as is)."""
    return micros if pad is None else micros + [pad] * (depth - len(micros))


def _shadowed(r: torch.Tensor, sub: torch.Tensor | None, pad: torch.Tensor | None) -> torch.Tensor:
    r = r if sub is None else r[sub[r]]
    return r if r.numel() or pad is None else pad


def split_rows(
    batch: TrainBatch,
    cfg: CampaignConfig,
    seed: int,
    collective: Collective,
    device: torch.device,
    shadow_rows: torch.Tensor | None,
) -> StepRows:
    """Plan the step's mini-batches and take this rank's rows of ``batch`` onto ``device``.

    ``shadow_rows`` (``[N]`` bool over the global batch, optional): the rows with shadow passes."""
    n = batch.size
    budget = cfg.algorithm.max_tokens_per_micro_batch is not None  # token budget: split by length, trimmed
    split = (
        dict(lengths=batch.attention_mask.sum(1).cpu(), multiple=token_multiple(cfg.precision.train)) if budget else {}
    )
    plan, depth = rank_plan(n, cfg, seed, rank=collective.rank, world_size=collective.world_size, **split)
    per_epoch = len(plan) // cfg.algorithm.ppo_epochs
    mine = torch.unique(torch.cat([m for mbs in plan[:per_epoch] for m in mbs] or [torch.zeros(0, dtype=torch.long)]))
    local, local_global, pad = local_rows(batch, mine, collective.world_size)
    where = torch.full((n,), -1, dtype=torch.long)
    where[mine] = torch.arange(mine.numel())
    # host, like the micro-batches' row indices it selects from (a device mask cannot index a host tensor)
    sub = None if shadow_rows is None or bool(shadow_rows.all()) else shadow_rows.cpu().bool()[local_global]
    real = [[where[m] for m in mbs] for mbs in plan]
    padded = [pad_micros(r, d, pad) for r, d in zip(real, depth)]
    return StepRows(
        n,
        batch.cpu(),
        plan,
        per_epoch,
        mine,
        local.to(device),
        local_global,
        pad,
        where,
        sub,
        real,
        padded,
        [[_shadowed(r, sub, pad) for r in micros] for micros in padded],
        trim=budget,
    )
