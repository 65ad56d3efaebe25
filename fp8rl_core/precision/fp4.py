"""FP4 numerics: NVFP4 and MXFP4 quantize-dequantize, stochastic rounding, Hadamard transform.

Both formats store E2M1 elements: 1 sign, 2 exponent, 1 mantissa bit, values
±{0, 0.5, 1, 1.5, 2, 3, 4, 6} (0.5 is the only subnormal; no inf/NaN; casts
saturate at ±6). They differ in how a block of elements shares a scale:

======  =====  ===============================  ===============================
format  block  block scale                      tensor scale
======  =====  ===============================  ===============================
NVFP4   16     E4M3 (FP8), round-to-nearest     FP32: amax / (448 · 6)
MXFP4   32     E8M0 (a power of two), OCP       none
======  =====  ===============================  ===============================

NVFP4 (NVIDIA 2025): with tensor amax ``A`` the tensor scale is
``s_t = A / (448 · 6)``; a block with amax ``a`` gets the block scale
``s_b = e4m3(clamp((a / 6) / s_t, 2**-6, 448))``; elements are
``e2m1(clamp(x · ((1 / s_t) / s_b), −6, 6))`` and dequantize to ``q · (s_t · s_b)``.
This is torchao's ``nvfp4_quantize`` with a per-tensor scale, operation for
operation (tested bit for bit). ``A`` is floored at ``EPS`` so an all-zero tensor
is not a division by zero (torchao would return NaN there).

MXFP4 (OCP Microscaling v1.0, §6.3, the "floor" scale torchao uses by default):
``s_b = 2**clamp(floor(log2 a) − 2, −127, 128)`` (2 = exponent of E2M1's largest
power of two, 4), floored at the smallest normal float32 as torchao does;
elements are ``e2m1(clamp(x / s_b, −6, 6))``. Because the scale is rounded *down*,
a block's largest element may land in (6, 8) and saturate to 6: MXFP4's known
clipping, which NVFP4's finer E4M3 scale avoids.

Block layouts (``fake_quantize_fp4(..., layout=)``): ``"row"`` = 1 × block along the
last dim (activations, gradients: blocks lie along the contraction dim);
``"col"`` = block × 1 along the first dim (the grad-weight operands, whose
contraction dim is the token dim M: the same blocks as transposing and using
``"row"``, bit for bit, without the transposed copy);
``"block2d"`` = block × block tiles (weights in NVIDIA's training recipe, so the
forward (contract K) and the grad-input matmul (contract N) read *the same*
quantized weight). Dimensions must be whole blocks: a ragged edge is a
``ValueError`` (the kernels' shape contract), never silent padding.

Rounding: round-to-nearest-even (``round_e2m1_``, the magic-number add of
``fp8rl_core.precision.fp8`` with 1 mantissa bit and min normal 1.0 — bit-exact with
torchao's ``f32_to_f4_unpacked``), or stochastic (``stochastic=True`` with a
``torch.Generator``): a value between grid neighbours lo < v < hi becomes hi with
probability (v − lo) / (hi − lo), so the rounding is unbiased in expectation —
the recipe's rule for gradients. It works on float32 bits: 22 random bits are
added to the 22 mantissa bits E2M1 drops, then truncated (probability resolution
2**-22 of a grid step; the GPU's stochastic-rounding cvt instructions likewise add
random bits below the kept ones).

Random Hadamard transform (``random_hadamard``): ``H_16 · diag(signs)`` / 4 applied
to 16-row tiles along a dim. It is orthogonal, so ``(T g)ᵀ (T x) = gᵀ x`` exactly
in real arithmetic; quantizing after the transform spreads a block's outliers
over 16 elements. NVIDIA applies it to both inputs of the weight-gradient matmul
(along the token dim), nowhere else.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn import functional as nn_functional

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6  # smallest normal e4m3 (torch.finfo(float8_e4m3fn).tiny): floor of NVFP4 block scales
F32_MIN_NORMAL = 2.0**-126
EPS = 1e-12  # floor of the NVFP4 tensor amax

Layout = Literal["row", "col", "block2d"]


@dataclass(frozen=True)
class FP4Format:
    """An FP4 block format: E2M1 elements, ``block`` elements per scale, the scale's type."""

    name: str
    block: int
    scale_type: Literal["e4m3", "e8m0"]
    tensor_scale: bool  # NVFP4's second-level FP32 scale

    def __str__(self) -> str:
        return self.name


NVFP4 = FP4Format("nvfp4", 16, "e4m3", True)
MXFP4 = FP4Format("mxfp4", 32, "e8m0", False)
FORMATS: dict[str, FP4Format] = {NVFP4.name: NVFP4, MXFP4.name: MXFP4}


# ---------------------------------------------------------------------------
# Element rounding
# ---------------------------------------------------------------------------


def round_e2m1_(
    y: torch.Tensor,
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """y (float32, already scaled) <- saturated E2M1 value, in place; returns y.

    Nearest-even by default; stochastic rounding draws 22 random bits per element
    from ``generator`` (required then, so runs are reproducible and resumable).
    ``scratch``: a float32 tensor of y's shape whose contents may be overwritten (saves
    allocating a working buffer; the result does not depend on it).
    """
    if y.dtype != torch.float32:
        raise TypeError(f"round_e2m1_ works on float32, got {y.dtype}")
    if scratch is None or scratch.shape != y.shape or scratch.dtype != torch.float32 or not scratch.is_contiguous():
        scratch = torch.empty_like(y, memory_format=torch.contiguous_format)
    y.clamp_(-E2M1_MAX, E2M1_MAX)
    bits, work = y.view(torch.int32), scratch.view(torch.int32)
    if not stochastic:
        # magic add: 2**floor(log2|y|) (>= 1.0, E2M1's min normal) * 1.5 * 2**(23 - 1)
        magic = torch.bitwise_and(bits, 0x7F800000, out=work).view(torch.float32)
        magic.clamp_min_(1.0).mul_(1.5 * 2.0**22)
        return y.add_(magic).sub_(magic)
    if generator is None:
        raise ValueError("stochastic rounding needs a torch.Generator (its state is part of the checkpoint)")
    # In float32 bits: E2M1 keeps 1 of the 23 mantissa bits. Adding 22 uniform random bits to
    # the 22 discarded ones and truncating rounds |y| up with probability exactly
    # (discarded bits) / 2**22 = frac, the carry moving to the next grid value (1.75 -> 2).
    # Below 1 (E2M1's subnormal 0.5, spacing 0.5) the same is done on |y| + 1 in [1, 2),
    # where float32's 1-mantissa-bit grid has that spacing too, and 1 is taken off after.
    noise = _random_bits22(y.numel(), generator).view(y.shape).to(y.device)
    sign = torch.bitwise_and(bits, -0x80000000, out=work)
    bits.bitwise_and_(0x7FFFFFFF)  # y <- |y|
    small = _below_one(bits)  # 1.0 where |y| < 1 (NaN: 0.0), else 0.0
    y.add_(small)
    bits.add_(noise)
    bits.bitwise_and_(-(1 << 22))  # keep the exponent and the top mantissa bit
    y.sub_(small)
    bits.bitwise_or_(sign)
    return y


def _below_one(bits: torch.Tensor) -> torch.Tensor:
    """Float32 1.0 where the non-negative float32 ``bits`` are below 1.0 (NaN excluded), else 0.0.

    ``(|y| < 1).float()`` in integer arithmetic: the bits of a non-negative float order as
    integers, so ``bits - bits(1.0)`` is negative exactly below 1.0; its sign bit, spread
    over the word by the arithmetic shift, masks the bits of 1.0."""
    d = torch.sub(bits, 0x3F800000)
    return d.bitwise_right_shift_(31).bitwise_and_(0x3F800000).view(torch.float32)


def _random_bits22(n: int, generator: torch.Generator) -> torch.Tensor:
    """n int32 values, each 22 uniform random bits from ``generator`` (two per 64-bit draw)."""
    words = torch.empty((n + 1) // 2, dtype=torch.int64, device=generator.device).random_(
        generator=generator
    )  # [0, 2**63)
    return words.view(torch.int32)[:n].bitwise_and_(0x3FFFFF)


# ---------------------------------------------------------------------------
# Scales
# ---------------------------------------------------------------------------


def nvfp4_tensor_scale(tensor_amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor FP32 scale ``amax / (448 · 6)`` (amax floored at EPS)."""
    return tensor_amax.to(torch.float32).clamp_min(EPS) / (E4M3_MAX * E2M1_MAX)


_E4M3_CAST_BELOW = 4096


def _e4m3_normal_(s: torch.Tensor) -> torch.Tensor:
    """``s.to(float8_e4m3fn).to(float32)`` for float32 ``s`` in E4M3's normal range [2**-6, 448] (or NaN),
    in place: round to nearest even at 3 mantissa bits in the float32 bits. The same value for every
    float32 of that range (checked exhaustively) and the same NaN, several times faster than the FP8 cast."""
    if s.numel() < _E4M3_CAST_BELOW:  # few elements: the two casts are fewer ops
        return s.copy_(s.to(torch.float8_e4m3fn))
    bits = s.view(torch.int32)
    nan = torch.isnan(s)
    odd = torch.bitwise_right_shift(bits, 20).bitwise_and_(1)  # the kept mantissa's last bit: ties to even
    bits.add_(odd.add_(0x7FFFF)).bitwise_and_(-(1 << 20))
    if bool(nan.any()):  # the FP8 cast's NaN: sign kept, float32 bits 0x7FF00000
        bits.copy_(torch.where(nan, bits.bitwise_and(-0x80000000).bitwise_or_(0x7FF00000), bits))
    return s


def block_scales(
    amax: torch.Tensor, fmt: FP4Format, tensor_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(block scale s_b as float32, multiplier or divisor applied to x, "mul"/"div").

    s_b is the stored scale's value (E8M0 2**-127 for an all-zero MXFP4 block);
    the divisor is floored at the smallest normal float32, as in torchao.

    NVFP4: s_b = e4m3(clamp((amax / 6) / s_t, 2**-6, 448)); x is multiplied by
    (1 / s_t) / s_b. MXFP4: s_b = 2**(floor(log2 amax) − 2), clamped like E8M0 and
    floored at the smallest normal float32; x is divided by s_b.
    """
    amax = amax.to(torch.float32)
    if fmt.scale_type == "e4m3":
        if tensor_scale is None:
            raise ValueError("NVFP4 needs its per-tensor scale")
        s = _e4m3_normal_(((amax / E2M1_MAX) / tensor_scale).clamp(E4M3_TINY, E4M3_MAX))
        return s, (1.0 / tensor_scale) / s, "mul"
    # E8M0: the exponent field of amax, minus E2M1's largest exponent (2)
    exp = torch.bitwise_right_shift(amax.view(torch.int32), 23).bitwise_and(0xFF) - 127
    exp = (exp - 2).clamp(-127, 128)
    s = torch.ldexp(torch.ones_like(amax), exp)  # exact; 2**-127 (E8M0's smallest) is a float32 subnormal
    return s, s.clamp_min(F32_MIN_NORMAL), "div"  # torchao divides by the scale floored at the smallest normal


# ---------------------------------------------------------------------------
# Quantize / dequantize
# ---------------------------------------------------------------------------


def _check_blocks(shape: torch.Size, fmt: FP4Format, layout: Layout) -> None:
    if len(shape) != 2:
        raise ValueError(f"{fmt.name}: expected a 2-D tensor, got shape {tuple(shape)}")
    r, c = shape
    if layout == "col":
        if r % fmt.block:
            raise ValueError(f"{fmt.name}: shape {tuple(shape)} is not whole {fmt.block}x1 blocks along the first dim")
        return
    if c % fmt.block or (layout == "block2d" and r % fmt.block):
        need = f"{fmt.block}x{fmt.block} tiles" if layout == "block2d" else f"1x{fmt.block} blocks along the last dim"
        raise ValueError(f"{fmt.name}: shape {tuple(shape)} is not whole {need}")


def _grouped(x: torch.Tensor, fmt: FP4Format, layout: Layout) -> tuple[torch.Tensor, tuple[int, ...]]:
    r, c = x.shape
    b = fmt.block
    if layout == "row":
        return x.reshape(r, c // b, b), (2,)
    if layout == "col":
        return x.reshape(r // b, b, c), (1,)
    if layout == "block2d":
        return x.reshape(r // b, b, c // b, b), (1, 3)
    raise ValueError(f"unknown FP4 layout {layout!r}; valid: row, col, block2d")


def _scale_broadcast(s: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Stored block scales shaped to multiply ``_grouped``'s view."""
    if layout == "row":
        return s.reshape(s.shape[0], s.shape[1], 1)
    if layout == "col":
        return s.reshape(s.shape[0], 1, s.shape[1])
    return s.reshape(s.shape[0], 1, s.shape[1], 1)


def _block_amax(a: torch.Tensor, fmt: FP4Format, layout: Layout) -> torch.Tensor:
    """Block maxima of ``a`` (non-negative float32 [R, C]), shaped to broadcast over ``_grouped``'s view.

    Max pooling with the block as window and stride: the same maxima as ``amax`` over the
    grouped view (max is exact, NaN propagates in both), several times faster on CPU for the
    16- or 32-wide innermost blocks of the row layout."""
    r, c = a.shape
    b = fmt.block
    if layout == "row":
        return nn_functional.max_pool1d(a.view(1, r, c), b, b).view(r, c // b, 1)
    if layout == "col":
        return a.view(r // b, b, c).amax(dim=1, keepdim=True)
    return nn_functional.max_pool2d(a.view(1, 1, r, c), b, b).view(r // b, 1, c // b, 1)


def quantize_fp4(
    x: torch.Tensor,
    fmt: FP4Format,
    layout: Layout = "row",
    *,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    tensor_amax: torch.Tensor | None = None,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [R, C] -> (E2M1 values [R, C] float32, block scales float32, tensor scale or None).

    Block scales: [R, C/b] ("row"), [R/b, C] ("col") or [R/b, C/b] ("block2d"). The dequantized
    tensor is ``values · block scale · tensor scale`` (see ``dequantize_fp4``).
    ``tensor_amax``: NVFP4's amax for the tensor scale (default: x's own).
    ``inplace``: x is a contiguous float32 tensor the caller gives up; the values are computed in it.
    """
    _check_blocks(x.shape, fmt, layout)
    own = inplace and x.dtype == torch.float32 and x.is_contiguous()
    y = x if own else x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    g, _ = _grouped(y, fmt, layout)
    work = y.abs()  # |y|, then round_e2m1_'s working buffer
    amax = _block_amax(work, fmt, layout)
    ts = None
    if fmt.tensor_scale:
        ts = nvfp4_tensor_scale(amax.amax() if tensor_amax is None else tensor_amax)  # max of the block maxima
    s, factor, op = block_scales(amax, fmt, ts)
    g.mul_(factor) if op == "mul" else g.div_(factor)
    round_e2m1_(y, stochastic=stochastic, generator=generator, scratch=work)
    return y, s.reshape(s.shape[0], -1), ts  # drop the grouped view's singleton dims


def dequantize_fp4(
    values: torch.Tensor,
    scales: torch.Tensor,
    tensor_scale: torch.Tensor | None,
    fmt: FP4Format,
    layout: Layout = "row",
) -> torch.Tensor:
    """Inverse of ``quantize_fp4``: values · (tensor scale · block scale), float32."""
    return _dequantize_(values.to(torch.float32, copy=True), scales, tensor_scale, fmt, layout)


def _dequantize_(
    values: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor | None, fmt: FP4Format, layout: Layout
) -> torch.Tensor:
    """``dequantize_fp4`` in place on float32 ``values``."""
    s = scales if tensor_scale is None else tensor_scale * scales  # torchao: per_tensor_scale * e4m3 scale
    g, _ = _grouped(values, fmt, layout)
    return g.mul_(_scale_broadcast(s, layout)).reshape(values.shape)


def fake_quantize_fp4(x: torch.Tensor, fmt: FP4Format, layout: Layout = "row", **kw) -> torch.Tensor:
    """x rounded to ``fmt`` and back (float32, x's shape). Keywords as ``quantize_fp4`` (``inplace=True``:
    computed in x, a contiguous float32 tensor the caller gives up, and returned)."""
    v, s, ts = quantize_fp4(x, fmt, layout, **kw)
    return _dequantize_(v, s, ts, fmt, layout)  # v is quantize_fp4's own float32 copy


def sqnr_db(x: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10·log10(Σx² / Σ(x − approx)²)."""
    x, approx = x.double(), approx.double()
    noise = (x - approx).pow(2).sum().item()
    return math.inf if noise == 0 else 10.0 * math.log10(x.pow(2).sum().item() / noise)


# ---------------------------------------------------------------------------
# Random Hadamard transform
# ---------------------------------------------------------------------------

HADAMARD_SIZE = 16


def hadamard_matrix(n: int = HADAMARD_SIZE) -> torch.Tensor:
    """Sylvester Hadamard matrix of order n (a power of two), normalized: H Hᵀ = I."""
    return _hadamard(n).clone()


@functools.lru_cache(maxsize=8)
def _hadamard(n: int) -> torch.Tensor:
    """``hadamard_matrix(n)``, built once (callers must not write to it)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    """n random ±1 (float32) from ``generator``."""
    return torch.randint(0, 2, (n,), generator=generator).to(torch.float32).mul_(2).sub_(1)


def random_hadamard(t: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """T t along dim 0, in tiles of ``len(signs)`` rows: T = H · diag(signs) (orthogonal).

    t [M, C] with M a multiple of the tile (callers pad with zero rows, which
    the transform keeps zero). Float32 result.
    """
    n = signs.numel()
    m, c = t.shape
    if m % n:
        raise ValueError(f"random_hadamard: {m} rows are not whole tiles of {n}")
    mat = _hadamard(n).to(t.device) * signs.to(t.device)[None, :]  # H diag(s)
    return torch.matmul(mat, t.to(torch.float32).reshape(m // n, n, c)).reshape(m, c)
