"""When the train stage may take π_old from the first mini-batch's own forward.

The update needs π_old, the log-probs of the weights the step starts with, for every token,
before its first optimizer update. The first mini-batch's forward (with grad) runs on exactly
those weights, so its log-probs *are* π_old for its rows: the separate no-grad forward of
those rows is redundant. It costs one forward of the mini-batch (in TRL's shape, 16 prompts
x 8 samples in one update, a third of the train stage's passes; in the tiny default, 2
mini-batches of 256, half of the π_old pass).

Reused only where the values are bit-identical to the no-grad pass's:

* the same micro-batch: the first mini-batch is one micro-batch, so its grad forward runs
  the rows, padding and shapes that the no-grad pass would (several micro-batches would
  have to keep every graph alive until the last one's π_old is known);
* the same kernels: on CPU the forward's kernels do not depend on grad mode (checked bit
  for bit in BF16, FP8 tensorwise/rowwise and NVFP4, with either BF16 GEMM path:
  ``tests/test_old_logp_reuse.py``); on CUDA that is not verified, so the pass stays;
* nothing reads π_old before the forward: BAPO picks its bounds from the current ratios
  before the loss, so it keeps the pass; one process (several ranks pad micro-batches).

TIS weights are computed from the complete π_old tensor, as before, right after the reuse.
"""

from __future__ import annotations

import torch


def first_forward_is_old(
    plan: list[list[torch.Tensor]], device: torch.device, world_size: int, *, per_update_bounds: bool
) -> bool:
    """True if the first mini-batch's grad forward may stand in for its no-grad π_old forward
    (``per_update_bounds``: the clip mode reads the current ratios before the loss, as BAPO does)."""
    return device.type == "cpu" and world_size == 1 and len(plan) > 0 and len(plan[0]) == 1 and not per_update_bounds
