"""The step's π_old: the log-probs of the weights the step starts with, and the TIS weights after them.

:func:`old_logprobs` recomputes π_old in the *training* precision, once, on this rank's rows,
in the micro-batches of the first epoch's plan (the same ones on 1 or W ranks), or, with
``algorithm.old_logp_micro_batch_size``, in micro-batches of its own (:func:`apart_micro_batches`); on
calibration steps the BF16 shadow forward runs on the same master weights (π_old in BF16).
TIS weights ``min(exp(old_logp - rollout_logp), C)`` correct the rollout-vs-train mismatch
(detached), or the weights of the mismatch correction ``algorithm.correction`` selects
(:mod:`fp8rl_core.objective.corrections`).

Taking π_old from the first mini-batch's own forward (:func:`first_forward_is_old`): the
update needs π_old for every token before its first optimizer update. The first mini-batch's
forward (with grad) runs on exactly those weights, so its log-probs *are* π_old for its rows:
the separate no-grad forward of those rows is redundant. It costs one forward of the
mini-batch (in TRL's shape, 16 prompts x 8 samples in one update, a third of the train
stage's passes; in the tiny default, 2 mini-batches of 256, half of the π_old pass).

Reused only where the values are bit-identical to the no-grad pass's:

* the same micro-batch: the first mini-batch is one micro-batch, so its grad forward runs
  the rows, padding and shapes that the no-grad pass would (several micro-batches would
  have to keep every graph alive until the last one's π_old is known);
* the same kernels: on CPU the forward's kernels do not depend on grad mode (checked bit
  for bit in BF16, FP8 tensorwise/rowwise and NVFP4, with either BF16 GEMM path:
  ``tests/stages/trainer/test_old_logp_reuse.py``); on CUDA that is not verified, so the pass stays;
* nothing reads π_old before the forward: BAPO picks its bounds from the current ratios
  before the loss, so it keeps the pass; one process (several ranks pad micro-batches).

TIS weights are computed from the complete π_old tensor, as before, right after the reuse.
"""

from __future__ import annotations

import time

import torch

from fp8rl_core.objective.corrections import step_weights
from stages.trainer.forward import ForwardSpec, no_grad_logprobs
from stages.trainer.types import OldPolicy, TrainStep


def first_forward_is_old(
    plan: list[list[torch.Tensor]], device: torch.device, world_size: int, *, per_update_bounds: bool,
    apart: bool = False,
) -> bool:
    """True if the first mini-batch's grad forward may stand in for its no-grad π_old forward
    (``per_update_bounds``: the clip mode reads the current ratios before the loss, as BAPO does;
    ``apart``: π_old has micro-batches of its own, :func:`apart_micro_batches`)."""
    return (device.type == "cpu" and world_size == 1 and len(plan) > 0 and len(plan[0]) == 1
            and not per_update_bounds and not apart)


def apart_micro_batches(n_rows: int, size: int) -> list[torch.Tensor]:
    """π_old batched apart from π_θ (``algorithm.old_logp_micro_batch_size``): this rank's ``n_rows``
    rows in sample order, ``size`` at a time, as verl's log-prob pass batches them."""
    return [torch.arange(i, min(i + size, n_rows)) for i in range(0, n_rows, size)]


def old_logprobs(step: TrainStep) -> OldPolicy:
    """π_old in the training precision and, on shadow steps, in BF16; the TIS weights.

    Rows without a shadow pass (subsampled shadow) hold NaN BF16 values. Where
    :func:`first_forward_is_old`, the first micro-batch's π_old is left to its own update's
    forward (:func:`stages.trainer.minibatch.adopt_first_forward`), and so are the TIS weights, which need
    all of π_old.
    """
    cfg, rows = step.cfg, step.rows
    apart = cfg.algorithm.old_logp_micro_batch_size
    reuse = first_forward_is_old(
        rows.plan, rows.local.input_ids.device, step.collective.world_size, per_update_bounds=step.rule is not None,
        apart=apart is not None,
    )
    mode, x = cfg.precision.train, rows.local
    if apart is None:  # the training micro-batches of the first epoch: a token meets the same rows as in π_θ
        first = [r for k in range(rows.per_epoch) for r in rows.padded[k]]
    else:
        first = apart_micro_batches(int(x.input_ids.shape[0]), apart)
    mask = x.response_mask.float()  # [n_r (+1), T]
    seconds = {}
    t0 = time.perf_counter()
    old8 = torch.zeros(x.input_ids.shape, dtype=torch.float32, device=mask.device)
    firsts = first[1:] if reuse else first
    ids, am = x.input_ids, x.attention_mask
    for r, lp in no_grad_logprobs(step.model, ids, am, firsts, ForwardSpec(mode, trim=rows.trim)):
        old8[r] = lp
    seconds["old_logp_s"] = time.perf_counter() - t0
    old16 = None
    if step.shadow or step.decides_on_bf16:  # the oracle's clip decisions need BF16 π_old on every step
        t0 = time.perf_counter()
        old16 = torch.full_like(old8, float("nan") if rows.sub is not None else 0.0)
        shadowed = [s for k in range(rows.per_epoch) for s in rows.shadowed[k]]
        for r, lp in no_grad_logprobs(step.model, x.input_ids, x.attention_mask, shadowed,
                                      ForwardSpec(mode, shadow=True, trim=rows.trim)):
            old16[r] = lp
        seconds["shadow_s" if step.shadow else "bf16_decision_s"] = time.perf_counter() - t0
    is_w = None if reuse else step_weights(old8, x.rollout_logp, mask, cfg.algorithm, step.thresholds)
    return OldPolicy(mask, x.advantages.float()[:, None] * mask, old8, old16, is_w, reuse, seconds)

