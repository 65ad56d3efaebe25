"""FP8 numerics: formats, scales, fake quantization and an emulated scaled matmul.

The three matmuls of a linear layer
-----------------------------------
A linear ``y = x @ W.T`` (x: [M, K] activations, W: [N, K] weight) costs three
matmuls per training step, and FP8 training runs all three with FP8 operands:

1. forward      ``y      = x  @ W.T``   [M, K] x [K, N] -> [M, N]  (contract K)
2. grad-input   ``dL/dx  = dy @ W``     [M, N] x [N, K] -> [M, K]  (contract N)
3. grad-weight  ``dL/dW  = dy.T @ x``   [N, M] x [M, K] -> [N, K]  (contract M)

Each operand is quantized along the dimension its matmul contracts, so one
tensor may need two quantizations (rowwise scaling quantizes ``x`` per row for
the forward and per column for the grad-weight matmul).

Dtypes and scales
-----------------
* e4m3fn: 4 exponent bits, 3 mantissa bits, max 448, no infinities. More
  precision, less range: used for activations and weights (and, in the rowwise
  and blockwise recipes, for gradients too, where finer scales buy back range).
* e5m2: 5 exponent bits, 2 mantissa bits, max 57344. More range, less precision:
  the tensorwise recipe uses it for gradients, whose dynamic range is wide and
  which share a single scale per tensor.

A scaling group (the whole tensor, one row, or one tile) with absolute maximum
``amax`` gets the dequantization scale ``amax / fp8_max`` (amax floored at
``EPS`` so an all-zero group does not divide by zero). Quantization multiplies
by its reciprocal ``qscale = fp8_max / amax`` (computed in float64 and rounded to
float32, exactly as torchao does, so our numbers are bit-equal to torchao's),
saturates to +-fp8_max and rounds to nearest-even on the FP8 grid. Optionally
``qscale`` is rounded *down* to a power of two: then the scaled values never
overflow and multiplying by the scale is exact.

Granularities (``fake_quantize(x, granularity)``):
``"tensorwise"`` one scale; ``"rowwise"`` one scale per row (amax over the last
dim); ``"blockwise"`` one scale per ``block``-shaped tile of the last two dims
(DeepSeek-V3: ``(1, 128)`` activation tiles, ``(128, 128)`` weight blocks);
ragged edge tiles are smaller tiles with their own amax.

Why not just torchao (trade-off)
--------------------------------
torchao's ``Float8Linear`` is the production path on CUDA SM89+ (real
``torch._scaled_mm`` kernels, FSDP2 float8 all-gather, torch.compile fusion) and
we use it there. Its ``emulate=True`` path, however, dequantizes to float32 and
runs float32 matmuls with an unfused cast chain; on CPU that is ~3x a BF16 step,
and FP8->float casts are not vectorized in eager PyTorch. This module instead
rounds to the FP8 grid *in float32 arithmetic* (``round_to_fp8_grid_``: a
magic-number add that is bit-exact with ``x.to(fp8).float()``), keeps the FP8
values in BF16 (which holds every e4m3/e5m2 value exactly) and lets a BF16
matmul with float32 accumulation do the work, applying scales to the output.
``fp8rl_core.precision.fp8_linear`` builds the training linear on these pieces and is
tested against torchao's emulate path as the oracle; ``scaled_mm_emulated``
reproduces ``torch._scaled_mm`` semantics and is tested against it on tiny
shapes (where the CPU ``_scaled_mm`` is affordable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Granularity = Literal["tensorwise", "rowwise", "blockwise"]
GRANULARITIES: tuple[str, ...] = ("tensorwise", "rowwise", "blockwise")

#: Floor of amax, so that an all-zero scaling group gets a finite scale (torchao's value).
EPS = 1e-12


@dataclass(frozen=True)
class FP8Format:
    """An FP8 format: its torch dtype and the constants of its value grid."""

    dtype: torch.dtype
    max: float  # largest finite value
    mantissa_bits: int  # explicit mantissa bits (3 for e4m3, 2 for e5m2)
    min_normal: float  # smallest normal value; below it the grid spacing is constant

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


E4M3 = FP8Format(torch.float8_e4m3fn, 448.0, 3, 2.0**-6)
E5M2 = FP8Format(torch.float8_e5m2, 57344.0, 2, 2.0**-14)
_FORMATS = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}


def fp8_format(dtype: torch.dtype) -> FP8Format:
    """The ``FP8Format`` of ``dtype`` (float8_e4m3fn or float8_e5m2)."""
    try:
        return _FORMATS[dtype]
    except KeyError:
        valid = ", ".join(str(d) for d in _FORMATS)
        raise ValueError(f"unsupported FP8 dtype {dtype}; valid: {valid}") from None


# ---------------------------------------------------------------------------
# Scales
# ---------------------------------------------------------------------------


def round_down_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= ``scale`` (positive, float32), elementwise.

    Uses frexp (exact) rather than ``exp2(floor(log2(s)))``, whose float32 log2
    can round up to an integer for ``s`` just below a power of two.
    """
    mantissa, exponent = torch.frexp(scale)  # scale = m * 2**e, m in [0.5, 1)
    del mantissa
    return torch.ldexp(torch.ones_like(scale), exponent - 1)


def amax_to_qscale(
    amax: torch.Tensor, fmt: FP8Format, *, round_scales_to_power_of_2: bool = False, rule: str = "torchao"
) -> torch.Tensor:
    """Quantization multiplier ``fp8_max / max(amax, EPS)`` as float32 (same shape as amax).

    The dequantization scale of docs/method.md ("amax / fp8_max") is its reciprocal.
    ``rule="torchao"``: float64 division then float32 rounding, torchao's multiplier bit
    for bit. ``rule="vllm"``: vLLM's dynamic quantization, which computes the scale
    ``s = amax / fp8_max`` in float32 and multiplies by ``1 / s``, also float32; the two
    multipliers differ by an ulp on some amaxes, which decides the rounding of values that
    land on a tie between two FP8 neighbours (frequent for BF16-valued operands).
    """
    if rule == "vllm":
        s = torch.clamp(amax.to(torch.float32), min=EPS) / fmt.max
        return torch.reciprocal(s)
    if rule != "torchao":
        raise ValueError(f"rule must be 'torchao' or 'vllm', got {rule!r}")
    qscale = (fmt.max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    if round_scales_to_power_of_2:
        qscale = round_down_to_power_of_2(qscale)
    return qscale


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or any((not isinstance(b, int)) or b < 1 for b in block):
        raise ValueError(f"block must be two positive ints (rows, cols), got {block!r}")
    return block[0], block[1]


def _pad_to_blocks(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """Zero-pad the last two dims of ``x`` to multiples of ``block`` (zeros never raise an amax)."""
    rows, cols = x.shape[-2], x.shape[-1]
    pr, pc = (-rows) % block[0], (-cols) % block[1]
    if pr or pc:
        x = torch.nn.functional.pad(x, (0, pc, 0, pr))
    return x, rows, cols


def group_amax(x: torch.Tensor, granularity: str, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Absolute max of each scaling group, shaped to broadcast against ``x``.

    Shapes (x: [..., R, C]): tensorwise -> [] ; rowwise -> [..., R, 1] ;
    blockwise -> [..., R/br, 1, C/bc, 1] broadcasting against the tiled view
    ``[..., R/br, br, C/bc, bc]`` of the zero-padded x (see ``_tiles``).
    """
    if granularity == "tensorwise":
        lo, hi = torch.aminmax(x)
        return torch.maximum(-lo, hi)
    if granularity == "rowwise":
        lo, hi = torch.aminmax(x, dim=-1, keepdim=True)
        return torch.maximum(-lo, hi)
    if granularity == "blockwise":
        tiles = _tiles(x, block)
        return tiles.abs().amax(dim=(-3, -1), keepdim=True)
    raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")


def _tiles(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """View zero-padded ``x`` [..., R, C] as [..., R/br, br, C/bc, bc]."""
    if x.dim() < 2:
        raise ValueError(f"blockwise scaling needs a tensor of >= 2 dims, got shape {tuple(x.shape)}")
    br, bc = _check_block(block)
    xp, _, _ = _pad_to_blocks(x, (br, bc))
    *lead, r, c = xp.shape
    return xp.reshape(*lead, r // br, br, c // bc, bc)


# ---------------------------------------------------------------------------
# Rounding to the FP8 grid without FP8 casts
# ---------------------------------------------------------------------------


def round_to_fp8_grid_(y: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """In place: round float32 ``y`` (|y| <= fmt.max) to the nearest FP8 value, ties to even.

    Bit-exact with ``y.to(fmt.dtype).to(torch.float32)`` but built from
    vectorized float32 ops (FP8->float casts are scalar loops on CPU). Adding
    ``M = 1.5 * 2**(23 - m) * q`` to ``y`` makes float32 round ``y`` to a multiple
    of ``q``, the FP8 grid spacing at ``y``: ``q = 2**e * 2**-m`` for the binade
    ``2**e <= |y|`` (normal range) and ``min_normal * 2**-m`` below it
    (subnormals). ``M / q`` is even, so float32's ties-to-even carries over.
    Subtracting ``M`` is exact. NaN stays NaN.
    """
    if y.dtype != torch.float32:
        raise TypeError(f"round_to_fp8_grid_ works on float32, got {y.dtype}")
    # 2**floor(log2|y|): keep only the exponent bits (0 for zero and fp32 subnormals)
    binade = torch.bitwise_and(y.view(torch.int32), 0x7F800000).view(torch.float32)
    magic = binade.clamp_min_(fmt.min_normal).mul_(1.5 * 2.0 ** (23 - fmt.mantissa_bits))
    return y.add_(magic).sub_(magic)


def _scaled_fp32(x: torch.Tensor, qscale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """float32 copy of ``x * qscale`` saturated to +-fp8_max (``x`` untouched)."""
    y = x.to(torch.float32, copy=True)
    return y.mul_(qscale).clamp_(-fmt.max, fmt.max)


# ---------------------------------------------------------------------------
# Quantize / dequantize / fake-quantize
# ---------------------------------------------------------------------------


def _validate(x: torch.Tensor, granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; valid: {', '.join(GRANULARITIES)}")
    if not x.is_floating_point() or x.element_size() < 2:
        raise TypeError(f"expected a float16/bfloat16/float32 tensor, got {x.dtype}")
    if granularity == "rowwise" and x.dim() < 1:
        raise ValueError("rowwise scaling needs a tensor of >= 1 dim")


def quantize(
    x: torch.Tensor,
    granularity: str,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block: tuple[int, int] = (128, 128),
    round_scales_to_power_of_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` [..., R, C] to FP8: returns ``(q, qscale)`` with ``q`` in ``dtype``.

    ``qscale`` (float32) multiplies ``x`` to give ``q``; shapes: tensorwise [],
    rowwise [..., R, 1], blockwise [..., ceil(R/br), ceil(C/bc)]. This is the
    reference path (real FP8 storage via a saturating cast); ``fake_quantize``
    is its fast equivalent.
    """
    _validate(x, granularity)
    fmt = fp8_format(dtype)
    amax = group_amax(x, granularity, block)
    qscale = amax_to_qscale(amax, fmt, round_scales_to_power_of_2=round_scales_to_power_of_2)
    if granularity == "blockwise":
        tiles = _tiles(x, block).to(torch.float32)  # [..., R/br, br, C/bc, bc]
        q_tiles = (tiles * qscale).clamp(-fmt.max, fmt.max).to(dtype)
        *lead, nr, br, nc, bc = q_tiles.shape
        q = q_tiles.reshape(*lead, nr * br, nc * bc)[..., : x.shape[-2], : x.shape[-1]]
        return q.contiguous(), qscale.squeeze(-1).squeeze(-2)
    q = (x.to(torch.float32) * qscale).clamp(-fmt.max, fmt.max).to(dtype)
    return q, qscale


def dequantize(
    q: torch.Tensor,
    qscale: torch.Tensor,
    granularity: str,
    *,
    block: tuple[int, int] = (128, 128),
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize``: ``q / qscale`` in ``out_dtype`` (q: FP8 [..., R, C])."""
    y = q.to(torch.float32)
    if granularity == "blockwise":
        br, bc = _check_block(block)
        s = qscale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
        s = s[..., : q.shape[-2], : q.shape[-1]]
        return (y / s).to(out_dtype)
    return (y / qscale).to(out_dtype)


def fake_quantize(
    x: torch.Tensor,
    granularity: str,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    block: tuple[int, int] = (128, 128),
    round_scales_to_power_of_2: bool = False,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x.dtype`` and shape, without FP8 storage.

    x: [..., R, C] float16/bfloat16/float32. Bit-equal to the quantize/dequantize
    round trip (tested), but several times faster on CPU.
    """
    _validate(x, granularity)
    fmt = fp8_format(dtype)
    amax = group_amax(x, granularity, block)
    qscale = amax_to_qscale(amax, fmt, round_scales_to_power_of_2=round_scales_to_power_of_2)
    if granularity == "blockwise":
        tiles = _tiles(x, block)  # [..., R/br, br, C/bc, bc] (padded)
        y = _scaled_fp32(tiles, qscale, fmt)
        y = round_to_fp8_grid_(y, fmt).div_(qscale)
        *lead, nr, br, nc, bc = y.shape
        y = y.reshape(*lead, nr * br, nc * bc)[..., : x.shape[-2], : x.shape[-1]]
        return y.to(x.dtype)
    y = round_to_fp8_grid_(_scaled_fp32(x, qscale, fmt), fmt)
    return y.div_(qscale).to(x.dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20 log10(|ref| / |ref - approx|)`` in dB."""
    ref = reference.to(torch.float64)
    noise = torch.linalg.vector_norm(ref - approx.to(torch.float64))
    signal = torch.linalg.vector_norm(ref)
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(signal / noise))


# ---------------------------------------------------------------------------
# Emulated torch._scaled_mm
# ---------------------------------------------------------------------------


def scaled_mm_emulated(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``torch._scaled_mm`` semantics without FP8 hardware.

    a: [M, K] FP8, b: [K, N] FP8; scale_a / scale_b are *dequantization* scales
    (``_scaled_mm``'s convention, i.e. ``1 / qscale``): tensorwise [] or [1],
    rowwise scale_a [M, 1] and scale_b [1, N]. Returns
    ``(a.float() @ b.float()) * scale_a * scale_b (+ bias)`` in out_dtype:
    float32 accumulation, one rounding to out_dtype at the end, like the kernel.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"expected a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in _FORMATS:
            raise TypeError(f"{name} must be an FP8 tensor, got {t.dtype}")
    m, n = a.shape[0], b.shape[1]
    for name, s, ok in (
        ("scale_a", scale_a, scale_a.numel() == 1 or tuple(scale_a.shape) == (m, 1)),
        ("scale_b", scale_b, scale_b.numel() == 1 or tuple(scale_b.shape) == (1, n)),
    ):
        if not ok:
            raise ValueError(f"{name} must be tensorwise ([] or [1]) or rowwise, got shape {tuple(s.shape)}")
    out = (a.to(torch.float32) @ b.to(torch.float32)) * scale_a.to(torch.float32) * scale_b.to(torch.float32)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
