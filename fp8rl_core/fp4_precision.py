"""FP4 precision modes, registered beside the FP8 ones (``fp8rl_core.precision``).

Training (``TRAIN_PRECISIONS``): ``nvfp4`` and ``mxfp4`` convert every decoder
``nn.Linear`` to ``Fp4TrainingLinear`` (NVIDIA's NVFP4 recipe, see
``fp8rl_core.fp4_linear``); lm_head and the embeddings stay in high precision.
Unlike the FP8 modes, which skip a layer their kernel cannot take, a layer whose
dims are not whole FP4 blocks (16 for NVFP4 — both dims, for the 16 x 16 weight
tiles — 32 for MXFP4) is an error naming the layer and why, unless the preset
lists it in ``precision.keep_high_precision`` (fnmatch patterns on module names),
which keeps it in BF16 on purpose. Emulated everywhere: no real FP4 kernel is
wired (Blackwell's would be the GPU path), so ``emulate=False`` is an error.

Rollout (``ROLLOUT_PRECISIONS``): ``nvfp4_w4a4`` and ``mxfp4_w4a4`` (``Fp4RolloutLinear``).

In DESIGN.md's terms (section 2/3): the BF16 shadow pass of an FP4 model is the
same ``bf16_shadow`` (every converted linear runs ``nn.Linear.forward`` on the
master weights), so Calibrated Clipping, r8/r16 and the ``*_fp8`` columns work
unchanged; for these modes "fp8"/"r8" mean "the low-precision pass".
"""

from __future__ import annotations

import fnmatch

from torch import nn

from fp8rl_core.fp4 import MXFP4, NVFP4, FP4Format
from fp8rl_core.fp4_linear import Fp4Recipe, Fp4RolloutLinear, Fp4State, Fp4TrainingLinear
from fp8rl_core.precision import (
    ROLLOUT_PRECISIONS,
    TRAIN_PRECISIONS,
    ConversionReport,
    _decoder_linears,
    _swap,
    _TrainRequest,
)

FP4_TRAIN_MODES = {"nvfp4": NVFP4, "mxfp4": MXFP4}
FP4_ROLLOUT_MODES = {"nvfp4_w4a4": NVFP4, "mxfp4_w4a4": MXFP4}


def fp4_shape_problem(lin: nn.Linear, fmt: FP4Format) -> str | None:
    """Why ``fmt``'s training recipe cannot take this linear, or None."""
    b = fmt.block
    if lin.in_features % b or lin.out_features % b:
        return (f"{fmt.name} training needs in and out features divisible by {b} ({b}x{b} weight tiles, "
                f"1x{b} activation blocks), layer is {lin.in_features}->{lin.out_features}")
    return None


def _train_fp4(req: _TrainRequest, fmt: FP4Format) -> ConversionReport:
    if req.emulate is False:
        raise ValueError(f"precision {req.mode!r}: no real FP4 kernels are wired (emulation only); pass emulate=None or True")
    found, keep = _decoder_linears(req.model)
    patterns = tuple(getattr(req, "keep_high_precision", ()) or ())
    listed = [f for f in found if any(fnmatch.fnmatchcase(f[0], p) for p in patterns)]
    todo = [f for f in found if f not in listed]
    bad = [(name, why) for name, _, _, lin in todo if (why := fp4_shape_problem(lin, fmt)) is not None]
    if bad:
        name, why = bad[0]
        raise ValueError(
            f"precision {req.mode!r}: layer {name}: {why}; list it in precision.keep_high_precision "
            f"to keep it in BF16 ({len(bad)} layer(s) affected)"
        )
    state = Fp4State(getattr(req, "seed", 0))
    recipe = Fp4Recipe(fmt)
    converted, _ = _swap(todo, lambda lin: Fp4TrainingLinear.from_linear(lin, recipe, state), lambda lin: None)
    skipped = tuple((name, "listed in precision.keep_high_precision") for name, *_ in listed)
    return ConversionReport(req.mode, "fp8rl-emulated-fp4", True, converted, skipped, tuple(keep))


for _mode, _fmt in FP4_TRAIN_MODES.items():
    TRAIN_PRECISIONS.register(_mode)(lambda req, _fmt=_fmt: _train_fp4(req, _fmt))

for _mode, _fmt in FP4_ROLLOUT_MODES.items():
    ROLLOUT_PRECISIONS.register(_mode)(lambda lin, _fmt=_fmt: Fp4RolloutLinear(lin.in_features, lin.out_features, fmt=_fmt))
