"""CPU arithmetic whose bits do not depend on the CPU: exact GEMMs and library-free transcendentals.

PyTorch's CPU build hands three kinds of work to libraries that choose their code by the CPU
they find: FP32 GEMMs (MKL's SGEMM, also inside the attention kernel), the vector math of
``exp``, ``log``, ``sin``, ``cos``, ``sqrt``, ``tanh`` and ``logsumexp`` on float tensors
(MKL's VML: seen with breakpoints on ``vmsExp``, ``vmsLn``, ... under gdb), and BF16 GEMMs
(oneDNN). MKL's kernels differ between Intel and AMD CPUs and between vector widths, and its
reproducibility branches (``MKL_CBWR``) are honoured on Intel CPUs only. Everything else a
campaign runs is ATen's own code, which ``ATEN_CPU_CAPABILITY=avx2`` makes the same code on
every x86-64 CPU with AVX2 (``fp8rl_core.host.cpu_env``).

This module replaces the library calls with arithmetic that has one answer:

* :func:`exact_matmul` -- a GEMM with one answer. Each row of the left operand and each
  column of the right one is put on a grid of ``2**-GRID_BITS`` of its largest magnitude
  (integers up to ``2**GRID_BITS`` over a power of two); the integer products then sum
  exactly in float64 whatever order the BLAS takes, because every partial sum is an integer
  below ``2**53`` (the inner dimension is split into chunks of :data:`EXACT_CHUNK`, added in
  a fixed order). A BF16 operand (8 significant bits) keeps every bit down to ``2**-11`` of
  its row's largest value (smaller values are rounded to the grid: an error below ``2**-20``
  of that value, far under the BF16 rounding of the output); a float32 operand gets a second
  grid level, about 38 bits in all: more than an FP32 GEMM keeps. The float64 sum is rounded
  once to float32.
* :func:`portable_exp`, :func:`portable_log`, :func:`portable_sin`, :func:`portable_cos`,
  :func:`portable_sqrt`, :func:`portable_tanh`, :func:`portable_logsumexp` -- computed in
  float64 with ATen's own kernels only (``exp2`` and ``log1p``, which ATen vectorizes itself,
  and +, -, *, /, ``round``, ``frexp``, ``rsqrt``) and rounded once to the input's dtype.

Nothing here is fast: it is the price of one set of numbers on every CPU (docs/cpu.md measures
it). Tensors off the CPU, or not float32/float64, are not for these functions: callers route
those to torch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from fp8rl_core.cpu_numerics import exact_kernels

GRID_BITS = 19  # bits of each operand kept on a grid level (integers of magnitude <= 2**19)
EXACT_CHUNK = 1 << (53 - 2 * GRID_BITS - 2)  # inner-dimension chunk whose integer sums stay below 2**53 (8192)
_LOG2E = 1.4426950408889634  # log2(e), the nearest float64
_LN2 = 0.6931471805599453  # ln(2), the nearest float64


# --------------------------------------------------------------------------- exact GEMM


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e as float32 for integer exponents, clamped to [-126, 127], built from the bits (exact)."""
    return ((e.to(torch.int32).clamp(-126, 127) + 127) << 23).view(torch.float32)


_OPERAND_DTYPES = (torch.float32, torch.bfloat16)  # what the grid reads as it is (others are made float32)


def _levels(
    x: torch.Tensor, dim: int, levels: int, bf16: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``x`` on ``levels`` grid levels of ``GRID_BITS`` bits per slice along ``dim`` (-1: each row,
    -2: each column): ``x ≈ (l[0] + l[1] / 2**GRID_BITS) / up`` with integer-valued float64 ``l[i]``;
    ``up`` (float32, powers of two) keeps ``dim`` with size 1. ``bf16``: the grid of ``x``'s BF16 value
    (the BF16 rule's operand). Every step is exact in float32: the scaling is by a power of two, and a
    value minus its rounding is representable. The compiled kernel (:mod:`exact_kernels`) computes the
    same values in one pass where it runs."""
    if x.dtype not in _OPERAND_DTYPES:
        x = x.float()
    kernels = exact_kernels.ops()
    if kernels is not None and x.dim() >= 2 and x.device.type == "cpu":
        return _levels_compiled(kernels, x, dim, levels, bf16)
    x = x.to(torch.bfloat16).float() if bf16 or x.dtype == torch.bfloat16 else x
    _, e = torch.frexp(x.abs().amax(dim=dim, keepdim=True))  # largest |x| < 2**e (e = 0 for an all-zero slice)
    up = _pow2(GRID_BITS - e)
    scaled = x * up
    ints = torch.round(scaled)
    out = [_f64(ints)]
    if levels > 1:
        out.append(_f64(torch.round((scaled - ints) * float(1 << GRID_BITS))))
    return out, up


def _levels_compiled(kernels, x: torch.Tensor, dim: int, levels: int, bf16: bool):
    """:func:`_levels` by ``fp8rl_exact::grid`` on ``[batch, rows, cols]``; a 2-D operand held transposed
    (a weight's ``.T``) is read in its own layout, along the other axis, and its levels handed back
    transposed (the BLAS takes either layout)."""
    axis = 2 if dim in (-1, x.dim() - 1) else 1
    to_bf16 = bf16 and x.dtype == torch.float32
    if x.dim() == 2 and not x.is_contiguous() and x.mT.is_contiguous():
        up, *grid = kernels.grid(x.mT.unsqueeze(0), 3 - axis, levels, to_bf16)
        return [lv[0].mT for lv in grid], up[0].mT
    shape = x.shape
    up, *grid = kernels.grid(x.reshape(-1, shape[-2], shape[-1]), axis, levels, to_bf16)
    return [lv.view(shape) for lv in grid], up.view(*shape[:-2], *up.shape[1:])


def _f64(x: torch.Tensor) -> torch.Tensor:
    """float64 for the BLAS; batched operands contiguous (a strided batched float64 GEMM is ~2x slower)."""
    return x.double() if x.dim() <= 2 else x.to(torch.float64, memory_format=torch.contiguous_format)


def _int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of integer-valued float64 operands of magnitude <= 2**GRID_BITS, exact: each chunk of
    the inner dimension sums below 2**53 in any order; the chunks add up in index order."""
    k = a.shape[-1]
    out = a[..., :EXACT_CHUNK] @ b[..., :EXACT_CHUNK, :]
    for s in range(EXACT_CHUNK, k, EXACT_CHUNK):
        out = out + a[..., s : s + EXACT_CHUNK] @ b[..., s : s + EXACT_CHUNK, :]
    return out


def _finish(out: torch.Tensor, ua: torch.Tensor, ub: torch.Tensor, to_bf16: bool) -> torch.Tensor:
    """The float64 sums rounded once to float32, then divided by the two scales (rounding commutes
    with powers of two barring underflow), and rounded on to BF16 when ``to_bf16``. A new tensor in
    ``out``'s shape (not a view)."""
    kernels = exact_kernels.ops()
    if kernels is None or out.dim() < 2:
        res = out.float().div_(ua).div_(ub)
        return res.to(torch.bfloat16) if to_bf16 else res
    batch, (m, n) = out.shape[:-2], out.shape[-2:]
    return kernels.finish(out, ua.expand(*batch, m, 1), ub.expand(*batch, 1, n), to_bf16)


def exact_matmul_values(
    a: torch.Tensor,
    b: torch.Tensor,
    levels: int = 2,
    b_grid: tuple[list[torch.Tensor], torch.Tensor] | None = None,
    to_bf16: bool = False,
) -> torch.Tensor:
    """``a @ b`` (CPU, float operands, ``a``: [..., m, k], ``b``: [..., k, n]) as float32 (BF16 when
    ``to_bf16``: the float32 result's BF16 rounding), the same bits on every CPU (module docstring).
    ``levels=1`` for operands that hold BF16 values (one grid level: every bit of a BF16 value down to
    2**-11 of its row's largest), 2 for float32 ones. BF16 or float32 operands are read as they are
    (no copy); others are made float32. ``b_grid``: ``b``'s grid levels (:func:`weight_grid`), when
    already made. No autograd: see :func:`exact_matmul`."""
    la, ua = _levels(a, -1, levels)
    lb, ub = b_grid if b_grid is not None else _levels(b, -2, levels)
    out = _int_matmul(la[0], lb[0])
    if levels > 1:  # the second level, added in a fixed order
        low = _int_matmul(la[0], lb[1]) + _int_matmul(la[1], lb[0])
        out = out + low / float(1 << GRID_BITS)
    return _finish(out, ua, ub, to_bf16)


# --------------------------------------------------------------------------- a weight's grid, made once


class _WeightGrids:
    """The grid levels of weights while they cannot change (:func:`reuse_weight_grids`).

    An entry is keyed by the weight tensor itself and checked against its storage, shape,
    strides and version counter (every in-place write through autograd's view of the tensor
    -- an optimizer step, ``load_state_dict``, a ``copy_`` -- moves the counter); the store is
    emptied when the outermost scope ends, so no grid outlives the call that made it."""

    def __init__(self) -> None:
        self.depth = 0
        self.store: dict[tuple, tuple[torch.Tensor, tuple, tuple[list[torch.Tensor], torch.Tensor]]] = {}
        self.hits = 0
        self.made = 0

    def get(self, weight: torch.Tensor, levels: int) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        if self.depth == 0 or weight.requires_grad and torch.is_grad_enabled():
            return None
        try:
            stamp = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight._version)
        except RuntimeError:  # an inference tensor keeps no version counter: nothing proves it unchanged
            return None
        key = (id(weight), levels)
        entry = self.store.get(key)
        if entry is not None and entry[0] is weight and entry[1] == stamp:
            self.hits += 1
            return entry[2]
        grid = _levels(weight.transpose(-1, -2), -2, levels, bf16=levels == 1)
        self.store[key] = (weight, stamp, grid)
        self.made += 1
        return grid


_WEIGHT_GRIDS = _WeightGrids()


@contextlib.contextmanager
def reuse_weight_grids() -> Iterator[_WeightGrids]:
    """Within this scope a linear layer's weight is put on its grid once and reused by every
    no-grad GEMM on it (a generation's prefill and decoding steps, a no-grad log-prob pass): the
    same integers as making it again, so the same bits. Nested scopes share the outermost's store."""
    _WEIGHT_GRIDS.depth += 1
    try:
        yield _WEIGHT_GRIDS
    finally:
        _WEIGHT_GRIDS.depth -= 1
        if _WEIGHT_GRIDS.depth == 0:
            _WEIGHT_GRIDS.store.clear()


def weight_grid(weight: torch.Tensor, levels: int) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """``weight``ᵀ's grid levels for ``x @ weight.T`` (``levels`` 1: of its BF16 value, the BF16 rule's
    operand), reused within :func:`reuse_weight_grids`; None outside it or where the GEMM needs the
    weight's gradient."""
    return _WEIGHT_GRIDS.get(weight, levels)


class _ExactMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, levels: int, to_bf16: bool) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.levels = levels
        return exact_matmul_values(a, b, levels, to_bf16=to_bf16)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        n = ctx.levels
        ga = exact_matmul_values(grad, b.transpose(-1, -2), n) if ctx.needs_input_grad[0] else None
        gb = None
        if ctx.needs_input_grad[1]:
            rows, g = a, grad
            if a.dim() > 2 and b.dim() == 2:  # a weight's gradient: one GEMM over every row, summed exactly
                rows, g = a.reshape(-1, a.shape[-1]), grad.reshape(-1, grad.shape[-1])
            gb = exact_matmul_values(rows.transpose(-1, -2), g, n)
        if ga is not None and ga.shape != a.shape:
            ga = ga.sum_to_size(a.shape)
        if gb is not None and gb.shape != b.shape:
            gb = gb.sum_to_size(b.shape)
        return ga, gb, None, None


def exact_matmul(a: torch.Tensor, b: torch.Tensor, levels: int = 2, to_bf16: bool = False) -> torch.Tensor:
    """:func:`exact_matmul_values` with gradients (computed by the same exact GEMM, with the same
    ``levels``: 1 under the BF16 rule, whose gradients are BF16 values too). A 1-D operand is
    promoted as ``torch.matmul`` does. ``to_bf16``: the result rounded on to BF16 in the same pass
    (the BF16 rule's output), as ``.to(torch.bfloat16)`` of the float32 result gives."""
    if a.dim() == 1:
        return exact_matmul(a.unsqueeze(0), b, levels, to_bf16).squeeze(-2)
    if b.dim() == 1:
        return exact_matmul(a, b.unsqueeze(-1), levels, to_bf16).squeeze(-1)
    # [..., m, k] @ [k, n] is one GEMM over every row, and its weight gradient sums all rows in one
    # (backward); the output is a new tensor, not a view, as a BF16 GEMM's is
    return _ExactMatmul.apply(_operand(a), _operand(b), levels, to_bf16)


def _operand(t: torch.Tensor) -> torch.Tensor:
    """A GEMM operand as the grid reads it: BF16 and float32 as they are, anything else as float32."""
    return t if t.dtype in _OPERAND_DTYPES else t.float()


# --------------------------------------------------------------------------- transcendentals


def _as(x: torch.Tensor, y64: torch.Tensor) -> torch.Tensor:
    return y64 if x.dtype == torch.float64 else y64.to(x.dtype)


def portable_exp(x: torch.Tensor) -> torch.Tensor:
    """e**x as 2**(x·log2 e) in float64 (ATen's own ``exp2``), rounded to ``x``'s dtype."""
    return _as(x, torch.exp2(x.double() * _LOG2E))


def _log64(x: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(x.double())  # x = m * 2**e, m in [0.5, 1): m - 1 is exact
    return torch.log1p(m - 1.0) + e.double() * _LN2


def portable_log(x: torch.Tensor) -> torch.Tensor:
    """ln x as log1p(m - 1) + e·ln 2 for x = m·2**e (float64, ATen's own ``log1p``), rounded."""
    return _as(x, _log64(x))


_HALF_PI = (1.5707963267948966, 6.123233995736766e-17)  # pi/2 as a float64 pair (Cody-Waite)
_SIN = [(-1) ** i / math.factorial(2 * i + 1) for i in range(10)]  # Taylor terms, |r| <= pi/4
_COS = [(-1) ** i / math.factorial(2 * i) for i in range(10)]


def _poly(r2: torch.Tensor, coefs: list[float]) -> torch.Tensor:
    acc = torch.full_like(r2, coefs[-1])
    for c in reversed(coefs[:-1]):
        acc = acc * r2 + c
    return acc


def _sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) in float64: x = q·pi/2 + r, |r| <= pi/4, Taylor series of r, the quadrant
    from q mod 4. Accurate for |x| up to ~1e6 (rotary angles are positions times frequencies <= 1)."""
    x = x.double()
    q = torch.round(x / _HALF_PI[0])
    r = (x - q * _HALF_PI[0]) - q * _HALF_PI[1]
    r2 = r * r
    s, c = r * _poly(r2, _SIN), _poly(r2, _COS)
    quad = torch.remainder(q, 4.0)
    sin = torch.where(quad == 0, s, torch.where(quad == 1, c, torch.where(quad == 2, -s, -c)))
    cos = torch.where(quad == 0, c, torch.where(quad == 1, -s, torch.where(quad == 2, -c, s)))
    return sin, cos


def portable_sin(x: torch.Tensor) -> torch.Tensor:
    return _as(x, _sincos64(x)[0])


def portable_cos(x: torch.Tensor) -> torch.Tensor:
    return _as(x, _sincos64(x)[1])


def portable_sqrt(x: torch.Tensor) -> torch.Tensor:
    """sqrt(x): a float64 estimate x·rsqrt(x) (ATen's own ``rsqrt``) and one Newton step, rounded.
    0 -> 0, +inf -> inf, negative or NaN -> NaN, as ``torch.sqrt``."""
    x64 = x.double()
    s = x64 * torch.rsqrt(x64)
    s = s + (x64 - s * s) * (0.5 / s)
    s = torch.where((x64 == 0) | (x64 == math.inf), x64, s)
    return _as(x, s)


def portable_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh x = sign(x)·(1 - 2 / (e**(2|x|) + 1)) in float64, rounded (small |x|: its series)."""
    x64 = x.double()
    a = x64.abs()
    big = 1.0 - 2.0 / (torch.exp2(2.0 * _LOG2E * a) + 1.0)
    a2 = a * a
    small = a * (1.0 + a2 * (-1.0 / 3 + a2 * (2.0 / 15 + a2 * (-17.0 / 315 + a2 * 62.0 / 2835))))
    return _as(x, torch.copysign(torch.where(a < 0.0625, small, big), x64))


def portable_logsumexp(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    """log Σ e**x over ``dim`` with the largest value taken out first, in float64, rounded."""
    x64 = x.double()
    m = x64.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # all -inf (or an inf) rows: no shift
    out = _log64(torch.exp2((x64 - m) * _LOG2E).sum(dim=dim, keepdim=True)) + m
    if not keepdim:
        out = out.squeeze(dim) if isinstance(dim, int) else out.squeeze(tuple(dim))
    return _as(x, out)
