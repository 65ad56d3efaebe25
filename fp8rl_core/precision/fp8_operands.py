"""FP8 operand quantization for the emulated linears (``fp8rl_core.precision.fp8_linear``).

Each operand is rounded to the FP8 grid of its scaling groups (``quantize_operand``:
per tensor, row, column, 1x128 tile or 128x128 block) and stored in the compute
dtype; ``_mm`` multiplies two such operands and applies their dequantization scales
to the output. The rounding walks each operand in L2-sized chunks on the calling
thread (``_round_chunked``, ``_on_calling_thread``); ``SharedInputCache`` lets sibling
projections that read one activation round it once. The numerics are described in
``fp8rl_core.precision.fp8_linear``'s docstring.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Literal

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from fp8rl_core.cpu_numerics import cpu_gemm
from fp8rl_core.precision.fp8 import FP8Format, amax_to_qscale

# Scaling-group layouts of a 2-D operand [R, C]
Layout = Literal["tensor", "row", "col", "tile_row", "tile_col", "block"]

# Elements per chunk of the rounding loop: 128K float32 (512 KiB, plus an int32 scratch of
# the same size) stays in a core's L2, so the elementwise passes run at cache speed rather
# than DRAM speed (a rowwise train step: 1.13x BF16 with these chunks, 1.67x with
# whole-tensor passes, one thread).
_CHUNK_ELEMS = 1 << 17
_GPU_CHUNK_FACTOR = 64  # GPUs: few, large launches (8M elements, 32 MiB a chunk)
_GPU_CHUNKS: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8rl_gpu_chunks", default=False)


def _chunk_elems(device: torch.device) -> int:
    """Elements per rounding chunk: L2-sized on the CPU, 64x that on a GPU or under ``gpu_sized_chunks``."""
    return _CHUNK_ELEMS * (_GPU_CHUNK_FACTOR if device.type != "cpu" or _GPU_CHUNKS.get() else 1)


@contextlib.contextmanager
def gpu_sized_chunks() -> Iterator[None]:
    """Round CPU tensors in the chunks a GPU uses (the memory measurement's fake step).

    Chunking changes no value (every pass is elementwise or a per-group amax inside a
    chunk); it sets the scratch buffers' size and the number of ops. The memory plan
    runs the step on fake CPU tensors, where each op costs the same whatever its size,
    so the GPU's chunks make it 64x fewer ops and measure the GPU's scratch.
    """
    token = _GPU_CHUNKS.set(True)
    try:
        yield
    finally:
        _GPU_CHUNKS.reset(token)


@contextlib.contextmanager
def _on_calling_thread(device: torch.device) -> Iterator[None]:
    """Run the rounding passes on the calling thread only (CPU).

    They are short, cache-bound elementwise passes: an OpenMP fork/join per pass
    costs more than it saves, and on a shared CPU one preempted worker stalls
    every barrier (measured with 2 threads under load: rowwise train step 2.0x
    BF16 with parallel passes, 1.0x without). OpenMP's thread count is a
    per-calling-thread setting, restored on exit.
    """
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _grouped(t: torch.Tensor, layout: Layout, block: int) -> torch.Tensor:
    """t [R, C] viewed with its scaling groups as dims (zero-padded to whole tiles).

    tensor/row/col: [R, C]; tile_row (1 x b): [R, 1, C/b, b]; tile_col (b x 1):
    [R/b, b, C, 1]; block (b x b): [R/b, b, C/b, b].
    """
    if layout in ("tensor", "row", "col"):
        return t
    r, c = t.shape
    pr = (-r) % block if layout in ("tile_col", "block") else 0
    pc = (-c) % block if layout in ("tile_row", "block") else 0
    if pr or pc:
        t = nn.functional.pad(t, (0, pc, 0, pr))
    r, c = t.shape
    if layout == "tile_row":
        return t.reshape(r, 1, c // block, block)
    if layout == "tile_col":
        return t.reshape(r // block, block, c, 1)
    return t.reshape(r // block, block, c // block, block)


# Dims of the grouped view that one scaling group spans (see _grouped)
_GROUP_DIMS = {"tensor": None, "col": None, "row": (1,), "tile_row": (3,), "tile_col": (1,), "block": (1, 3)}


def _prepass_amax(g: torch.Tensor, layout: Layout, rows: int, scratch: torch.Tensor) -> torch.Tensor:
    """amax of groups that span chunks: the whole tensor ([]) or each column ([1, C])."""
    if layout == "tensor":
        lo, hi = torch.aminmax(g)  # a full reduction is fast; dim-wise aminmax is not (~20x slower)
        return torch.maximum(-lo, hi)
    amax = None
    for r0 in range(0, g.shape[0], rows):
        n = min(rows, g.shape[0] - r0)
        y = scratch[:n].copy_(g[r0 : r0 + n])
        a = y.abs_().amax(dim=0, keepdim=True)  # [1, C]
        amax = a if amax is None else torch.maximum(amax, a, out=amax)
    return amax


def _round_in_place_(
    y: torch.Tensor,
    qscale: torch.Tensor,
    fmt: FP8Format,
    *,
    pow2: bool,
    dequantize: bool,
    bits: torch.Tensor | None = None,
    rule: str = "torchao",
) -> torch.Tensor:
    """y (float32) <- FP8-rounded ``y * qscale``, divided back by qscale if ``dequantize``
    (``rule="vllm"``: multiplied by ``1 / qscale``, the dequantization scale vLLM's kernels apply).

    The grid rounding of ``fp8.round_to_fp8_grid_`` (magic add). With power-of-two
    scales and dequantization, rounding ``y * qscale`` and dividing by qscale is
    rounding y on the grid scaled by ``1 / qscale`` (exact), so the multiply and
    the divide are skipped: two passes fewer. ``bits``: optional int32 scratch like y.
    """
    factor = 1.5 * 2.0 ** (23 - fmt.mantissa_bits)
    scaled_grid = pow2 and dequantize
    if not scaled_grid:
        y.mul_(qscale)
    exponent_bits = y.view(torch.int32)
    magic = (
        torch.bitwise_and(exponent_bits, 0x7F800000, out=bits)
        if bits is not None
        else torch.bitwise_and(exponent_bits, 0x7F800000)
    ).view(torch.float32)  # 2**floor(log2|y|)
    if scaled_grid:
        torch.maximum(magic, fmt.min_normal / qscale, out=magic)
    else:
        magic.clamp_min_(fmt.min_normal)
    magic.mul_(factor)
    y.add_(magic).sub_(magic)
    if dequantize and not scaled_grid:
        if rule == "vllm":
            y.mul_(torch.reciprocal(qscale))
        else:
            y.div_(qscale)
    return y


@dataclass(frozen=True)
class RoundSpec:
    """How ``_round_chunked`` / ``_round_whole`` round an operand's scaling groups.

    ``layout``: the groups (see ``_grouped``); ``fmt``: the FP8 grid; ``pow2``: power-of-two
    scales; ``dequantize``: divide the rounded values back by their scale; ``out_dtype``: the
    values' dtype; ``rule``: whose scale arithmetic (``fp8.amax_to_qscale``).
    """

    layout: Layout
    fmt: FP8Format
    pow2: bool
    dequantize: bool
    out_dtype: torch.dtype
    rule: str = "torchao"

    def qscale(self, amax: torch.Tensor) -> torch.Tensor:
        """The quantization scale of groups with this amax."""
        return amax_to_qscale(amax, self.fmt, round_scales_to_power_of_2=self.pow2, rule=self.rule)

    def round_(self, y: torch.Tensor, qscale: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
        """``_round_in_place_`` of float32 y with these settings."""
        return _round_in_place_(
            y, qscale, self.fmt, pow2=self.pow2, dequantize=self.dequantize, bits=bits, rule=self.rule
        )


def _round_chunked(g: torch.Tensor, spec: RoundSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8-round the grouped view g group by group; returns (values in spec.out_dtype, qscale).

    Walks the leading dim in cache-sized chunks with two reused float32
    buffers, so the 6-8 elementwise passes (and the per-group amax) run at cache
    speed. No clamp to +-fp8_max: with dynamic scales |g * qscale| <= fp8_max up
    to one float32 ulp, which the grid rounding maps to fp8_max anyway (tested).
    qscale: [] (tensor), [1, C] (col), or g's shape with group dims reduced to 1.
    """
    chunk = _chunk_elems(g.device)
    rows = max(1, min(g.shape[0], chunk // max(1, g[0].numel())))
    if rows == g.shape[0]:
        return _round_whole(g, spec)
    out = torch.empty(g.shape, dtype=spec.out_dtype, device=g.device)
    y_buf = torch.empty((rows, *g.shape[1:]), dtype=torch.float32, device=g.device)
    bits_buf = torch.empty(y_buf.shape, dtype=torch.int32, device=g.device)
    group_dims = _GROUP_DIMS[spec.layout]
    qscale = None
    if group_dims is None:
        qscale = spec.qscale(_prepass_amax(g, spec.layout, rows, y_buf))
    else:
        scale_shape = list(g.shape)
        for d in group_dims:
            scale_shape[d] = 1
        qscale_all = torch.empty(scale_shape, dtype=torch.float32, device=g.device)
    for r0 in range(0, g.shape[0], rows):
        n = min(rows, g.shape[0] - r0)
        y, bits = y_buf[:n], bits_buf[:n]
        y.copy_(g[r0 : r0 + n])
        if group_dims is None:
            qs = qscale
        else:  # groups live inside the chunk: amax while it is in cache
            amax = torch.abs(y, out=bits.view(torch.float32)).amax(dim=group_dims, keepdim=True)
            qs = qscale_all[r0 : r0 + n]
            qs.copy_(spec.qscale(amax))
        spec.round_(y, qs, bits=bits)
        out[r0 : r0 + n].copy_(y)
    return out, (qscale if group_dims is None else qscale_all)


def _round_whole(g: torch.Tensor, spec: RoundSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """``_round_chunked`` for an operand that fits one chunk (decode steps, weights): the
    same arithmetic with no buffers or slicing, since per-op overhead dominates there."""
    y = g.to(torch.float32, copy=True)
    if spec.layout == "tensor":
        lo, hi = torch.aminmax(y)
        amax = torch.maximum(-lo, hi)
    else:
        amax = y.abs().amax(dim=_GROUP_DIMS[spec.layout] or (0,), keepdim=True)
    qscale = spec.qscale(amax)
    spec.round_(y, qscale)
    return y.to(spec.out_dtype), qscale


def quantize_operand(
    t: torch.Tensor,
    fmt: FP8Format,
    layout: Layout,
    *,
    pow2: bool,
    compute_dtype: torch.dtype,
    block: int = 128,
    dequantize: bool = False,
    rule: str = "torchao",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Round a 2-D operand t [R, C] to FP8 and prepare it for a ``compute_dtype`` matmul.

    Returns ``(values [R, C] in compute_dtype, post)``. If ``post`` is None the
    values are already dequantized; otherwise they are the raw FP8 values and
    ``post`` (float32: [], [R, 1] or [1, C]) is the dequantization scale to apply
    to the matmul output along this operand's non-contracted dim.
    Bit-equal to ``fp8.fake_quantize`` on the same groups (tested). ``rule``: whose
    scale arithmetic (``fp8.amax_to_qscale``): the trainer's torchao, or vLLM's for
    what an inference engine quantizes.
    """
    g = _grouped(t, layout, block)
    tiled = g.dim() == 4
    # pow2: dividing by the scale is exact, so dequantized values stay exact in BF16
    dequant = tiled or pow2 or dequantize
    spec = RoundSpec(layout, fmt, pow2=pow2, dequantize=dequant, out_dtype=compute_dtype, rule=rule)
    with _on_calling_thread(t.device):
        y, qscale = _round_chunked(g, spec)
    if tiled:
        y = y.reshape(y.shape[0] * y.shape[1], y.shape[2] * y.shape[3])[: t.shape[0], : t.shape[1]]
    return y, (None if dequant else qscale.reciprocal())


def _scale_output_(out: torch.Tensor, post_a: torch.Tensor | None, post_b: torch.Tensor | None) -> torch.Tensor:
    """out [R, C] *= post_a ([R, 1] or None) * post_b ([1, C] or None), in float32, in place.

    An in-place mixed-dtype multiply (BF16 tensor, float32 scale) is an unvectorized
    slow path on CPU, so each cache-sized row chunk is upcast, scaled and written back.
    """
    rows = max(1, _chunk_elems(out.device) // max(1, out.shape[1]))
    if rows >= out.shape[0]:  # one chunk (decode steps): fewest ops
        y = out.float()
        y = y.mul_(post_a) if post_b is None else (y.mul_(post_b) if post_a is None else y.mul_(post_a).mul_(post_b))
        return out.copy_(y)
    buf = torch.empty((rows, out.shape[1]), dtype=torch.float32, device=out.device)
    with _on_calling_thread(out.device):
        for r0 in range(0, out.shape[0], rows):
            n = min(rows, out.shape[0] - r0)
            y = buf[:n].copy_(out[r0 : r0 + n])
            if post_a is not None:
                y.mul_(post_a[r0 : r0 + n] if post_a.shape[0] > 1 else post_a)
            if post_b is not None:
                y.mul_(post_b)
            out[r0 : r0 + n].copy_(y)
    return out


def _mm(a: torch.Tensor, b: torch.Tensor, post_a: torch.Tensor | None, post_b: torch.Tensor | None) -> torch.Tensor:
    """a [R, K] @ b [K, C], then the dequantization scales of the two operands: post_a of
    a's rows ([] or [R, 1]), post_b of b's columns ([] or [1, C]); None = already applied."""
    out = cpu_gemm.mm(a, b)
    if post_a is None and post_b is None:
        return out
    if post_a is not None and post_b is not None and (post_a.dim() == 0 or post_b.dim() == 0):
        post_a, post_b = post_a * post_b, None  # fold the scalar in: one rounding of the output
    elif post_a is None:
        post_a, post_b = post_b, None
    if post_b is None and post_a.dim() == 0:
        return out.mul_(post_a)  # a 0-dim scale takes the fast scalar path
    if out.dtype == torch.float32:
        return out.mul_(post_a) if post_b is None else out.mul_(post_a).mul_(post_b)
    if post_b is None and post_a.shape[0] == 1:  # a column scale [1, C]
        post_a, post_b = None, post_a
    return _scale_output_(out, post_a, post_b)


def _data_identity(t: torch.Tensor) -> tuple:
    """Where ``t``'s elements live: its data pointer; for a fake tensor (the measured memory plan),
    which has no data and reports pointer 0 for all, its storage object (held by the cache while the
    key is, so the id cannot be reused) and offset."""
    if isinstance(t, FakeTensor):
        return ("fake", id(t.untyped_storage()), t.storage_offset())
    return ("data", t.data_ptr())


class SharedInputCache:
    """One-slot cache of a quantized operand, shared by the FP8 linears of one model.

    Sibling projections read the same activation one after another (q/k/v of
    attention, gate/up of the MLP), in the forward and again in the backward; the
    first quantizes it, the others reuse the result: a decoder layer rounds 4
    activations instead of 7. The key is the data (storage pointer, shape, strides,
    version counter where the tensor has one) plus the quantization settings; the
    slot holds the tensor, so its memory cannot be recycled under the same key.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.held: torch.Tensor | None = None
        self.key: tuple = ()
        self.value: tuple = ()

    @staticmethod
    def _key(t: torch.Tensor, settings: tuple) -> tuple:
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter (and cannot be modified)
            version = None
        return (_data_identity(t), tuple(t.shape), t.stride(), version, *settings)

    def quantize(
        self, t: torch.Tensor, fmt: FP8Format, layout: Layout, **kw
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``quantize_operand(t, fmt, layout, **kw)``, reusing the previous result for the same data."""
        key = self._key(t, (fmt.dtype, layout, *sorted(kw.items())))
        if self.held is None or key != self.key:
            value = quantize_operand(t, fmt, layout, **kw)
            self.held, self.key, self.value = t.detach(), key, value  # detached: keep the storage, not the graph
        return self.value


def _quantize(cache: SharedInputCache | None, t: torch.Tensor, fmt: FP8Format, layout: Layout, **kw):
    return cache.quantize(t, fmt, layout, **kw) if cache is not None else quantize_operand(t, fmt, layout, **kw)


def _t(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None or p.dim() == 0 else p.t()
