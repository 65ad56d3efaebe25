"""FP4 precision modes (their names and the shape rule), registered in ``precision.conversion`` with the FP8 ones.

Training (``TRAIN_PRECISIONS``): ``nvfp4`` and ``mxfp4`` convert every decoder
``nn.Linear`` to ``Fp4TrainingLinear`` (NVIDIA's NVFP4 recipe, see
``fp8rl_core.precision.fp4_linear``); lm_head and the embeddings stay in high precision.
Unlike the FP8 modes, which skip a layer their kernel cannot take, a layer whose
dims are not whole FP4 blocks (16 for NVFP4 — both dims, for the 16 x 16 weight
tiles — 32 for MXFP4) is an error naming the layer and why, unless the preset
lists it in ``precision.keep_high_precision`` (fnmatch patterns on module names),
which keeps it in BF16 on purpose. Emulated everywhere: no real FP4 kernel is
wired (Blackwell's would be the GPU path), so ``emulate=False`` is an error.

Rollout (``ROLLOUT_PRECISIONS``): ``nvfp4_w4a4`` and ``mxfp4_w4a4`` (``Fp4RolloutLinear``).

In the terms of docs/method.md ("Precision modes"): the BF16 shadow pass of an FP4 model is the
same ``bf16_shadow`` (every converted linear runs ``nn.Linear.forward`` on the
master weights), so Calibrated Clipping, r8/r16 and the ``*_fp8`` columns work
unchanged; for these modes "fp8"/"r8" mean "the low-precision pass".
"""

from __future__ import annotations

from fp8rl_core.precision.conversion import FP4_TRAIN_MODES, fp4_shape_problem
from fp8rl_core.precision.rollout import FP4_ROLLOUT_MODES

__all__ = ["FP4_ROLLOUT_MODES", "FP4_TRAIN_MODES", "fp4_shape_problem"]
