"""The precision modes as data: family, bytes per weight, token multiple, minimum compute capability.

Every name of ``precision.train`` (``fp8rl_core.precision.conversion.TRAIN_PRECISIONS``)
and ``precision.rollout`` (``fp8rl_core.precision.rollout.ROLLOUT_PRECISIONS``) has a
record here, and every decision that depends on a mode reads its record, never its
name: the memory plan counts ``bytes_per_weight``, the micro-batch padding meets
``token_multiple``, the GPU check names ``min_capability``.

============== ======== ===== ======== ======== ====================================
mode           family   bytes tokens   min SM   what
============== ======== ===== ======== ======== ====================================
bf16           bf16     2     1        8.0      BF16 matmuls, both uses
fp8_tensorwise fp8      1     16       8.9      training: one scale per tensor
fp8_rowwise    fp8      1     16       8.9      training: one scale per row
fp8_blockwise  fp8      1     128      9.0      training: 1x128 / 128x128 blocks
fp8_per_tensor fp8      1     1        8.9      rollout: W8A8, one weight scale
fp8_per_block  fp8      1     1        8.9      rollout: 128x128 weight blocks
nvfp4          fp4      0.5   1        10.0     training: E2M1, 16-element blocks
mxfp4          fp4      0.5   1        10.0     training: E2M1, 32-element blocks
nvfp4_w4a4     fp4      0.5   1        10.0     rollout
mxfp4_w4a4     fp4      0.5   1        10.0     rollout
============== ======== ===== ======== ======== ====================================

``bytes_per_weight`` is the stored value's width (block scales are extra and small);
``token_multiple`` is the token count a training micro-batch must be a multiple of for
the mode's GPU kernels (``fp8rl_core.precision.fp8_linear.TOKEN_MULTIPLE``); FP4 training
is emulated everywhere, so it asks none.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl_core.registry import Registry

__all__ = ["PRECISION_MODES", "PrecisionMode"]


@dataclass(frozen=True)
class PrecisionMode:
    """One precision mode; see the module docstring."""

    family: str  # bf16 | fp8 | fp4
    bytes_per_weight: float
    token_multiple: int
    min_capability: tuple[int, int]
    trains: bool  # a precision.train mode
    rolls_out: bool  # a precision.rollout mode
    granularity: str | None = None  # the FP8 scale's reach: tensor | row | block
    gpu_backend: str = "none"  # training: the backend a GPU with real kernels gives it (``fp8rl plan``)

    @property
    def quantized(self) -> bool:
        """Weights narrower than BF16 (an FP8 or FP4 mode)."""
        return self.bytes_per_weight < 2

    @property
    def sm(self) -> str:
        """The minimum compute capability as NVIDIA writes it, e.g. ``SM89``."""
        return f"SM{self.min_capability[0]}{self.min_capability[1]}"


PRECISION_MODES: Registry[PrecisionMode] = Registry("precision mode")
for _name, _mode in {
    "bf16": PrecisionMode("bf16", 2.0, 1, (8, 0), True, True),
    "fp8_tensorwise": PrecisionMode("fp8", 1.0, 16, (8, 9), True, False, "tensor", "torchao"),
    "fp8_rowwise": PrecisionMode("fp8", 1.0, 16, (8, 9), True, False, "row", "torchao"),
    "fp8_blockwise": PrecisionMode("fp8", 1.0, 128, (9, 0), True, False, "block", "torchao-blockwise"),
    "fp8_per_tensor": PrecisionMode("fp8", 1.0, 1, (8, 9), False, True, "tensor"),
    "fp8_per_block": PrecisionMode("fp8", 1.0, 1, (8, 9), False, True, "block"),
    "nvfp4": PrecisionMode("fp4", 0.5, 1, (10, 0), True, False, "block", "fp8rl-emulated-fp4"),
    "mxfp4": PrecisionMode("fp4", 0.5, 1, (10, 0), True, False, "block", "fp8rl-emulated-fp4"),
    "nvfp4_w4a4": PrecisionMode("fp4", 0.5, 1, (10, 0), False, True),
    "mxfp4_w4a4": PrecisionMode("fp4", 0.5, 1, (10, 0), False, True),
}.items():
    PRECISION_MODES.register(_name)(_mode)
