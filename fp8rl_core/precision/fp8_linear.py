"""Emulated FP8 linear layers: training (three FP8 matmuls) and W8A8 inference.

Training (``Fp8TrainingLinear``): a drop-in ``nn.Linear`` subclass whose
forward, grad-input and grad-weight matmuls all take FP8-rounded operands, as
described in ``fp8rl_core.precision.fp8``. Recipes follow torchao's
(``Float8LinearConfig.from_recipe_name``) and DeepSeek-V3:

==========  ===========================  ==========================  =============
recipe      activation / weight          grad_output                 scales
==========  ===========================  ==========================  =============
tensorwise  e4m3, one scale per tensor   e5m2, one scale per tensor  opt. pow-of-2
rowwise     e4m3, per row along the      e4m3, per row / per column  pow-of-2
            contraction dim
blockwise   e4m3, x: 1x128 tiles,        e4m3, 1x128 tiles (dgrad),  opt. pow-of-2
            W: 128x128 blocks            128x1 tiles (wgrad)
==========  ===========================  ==========================  =============

How the emulation stays cheap and exact. FP8 values are exact in BF16, so each
operand is rounded to the FP8 grid (float32 arithmetic, bit-exact with a real
cast) and stored as BF16; a BF16 matmul accumulates in float32, just like the
FP8 tensor cores. Per-tensor and per-row scales sit on dims the matmul does not
contract, so they are applied to the *output* (``out * (1/s_a) * (1/s_b)``);
when scales are powers of two they are folded into the operand instead (exact).
Blockwise scales vary along the contraction dim, so blockwise operands are
dequantized before the matmul: exact for power-of-two scales, otherwise each
operand carries one extra BF16 rounding (relative 2**-9, far below FP8's 2**-4).
Tensorwise keeps the rounded activation from the forward for the grad-weight
matmul (the same tensor scale quantizes it in both), so it is rounded once.

Against torchao's ``emulate=True`` path (the test oracle): rowwise is bit-identical,
forward and gradients, through a whole model. Tensorwise applies its non-power-of-two
scale to the BF16 matmul output, where torchao multiplies float32 dequantized
operands, so each output carries one extra BF16 rounding (a CPU has no BF16 GEMM
with float32 output in eager PyTorch; a float32 matmul would cost ~1.5x the step).

Speed: torchao's emulation costs 1.9-2.7x a BF16 train step on the CPU; this one
1.1-1.3x. The rounding walks each operand in L2-sized chunks on the calling thread
(``fp8rl_core.precision.fp8_operands``), so its ~8 elementwise passes run at
cache speed and never wait at an OpenMP barrier; and sibling projections that read
one activation (q/k/v, gate/up) round it once (``SharedInputCache``).

Inference (``Fp8RolloutLinear``): W8A8 like vLLM 0.33's online FP8 on Hopper. The
weight is quantized once per weight sync, not per forward, and — as in vLLM,
which fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` before
quantizing — sibling projections are quantized as one fused weight
(``Fp8RolloutLinear.refresh_fused``): ``fp8_per_tensor`` has ONE weight scale per
fused layer (the amax of q|k|v, not one per projection), ``fp8_per_block``
128x128 blocks of the fused weight. Activations are quantized dynamically per
token (``fp8_per_tensor``: vLLM's CUTLASS path, ``kFp8DynamicTokenSym``) or in
1x128 tiles (``fp8_per_block``). Left out, as below FP8 resolution: vLLM's
floor on activation scales (amax < 1/512 per token or tile) and its
``x * (1 / s)`` vs our ``x * (448 / amax)`` (one float32 ulp in the scale).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from fp8rl_core.cpu_numerics import cpu_gemm
from fp8rl_core.precision.fp8 import E4M3, E5M2, FP8Format
from fp8rl_core.precision.fp8_operands import (  # quantize_operand and SharedInputCache: public here too
    SharedInputCache,
    _mm,
    _quantize,
    _t,
    quantize_operand,
)


@dataclass(frozen=True)
class Fp8Recipe:
    """FP8 numerics of one training linear: formats per operand, granularity, scales."""

    granularity: Literal["tensorwise", "rowwise", "blockwise"]
    input_format: FP8Format = E4M3
    weight_format: FP8Format = E4M3
    grad_format: FP8Format = E4M3
    round_scales_to_power_of_2: bool = False
    block: int = 128  # tile edge for blockwise (1 x block activation tiles, block x block weight blocks)

    @staticmethod
    def named(granularity: str, *, round_scales_to_power_of_2: bool = False) -> "Fp8Recipe":
        """The recipe of a granularity (tensorwise / rowwise / blockwise), as torchao defines them."""
        if granularity == "tensorwise":
            return Fp8Recipe("tensorwise", E4M3, E4M3, E5M2, round_scales_to_power_of_2)
        if granularity == "rowwise":  # torchao's rowwise recipe always rounds scales to powers of 2
            return Fp8Recipe("rowwise", E4M3, E4M3, E4M3, True)
        if granularity == "blockwise":
            return Fp8Recipe("blockwise", E4M3, E4M3, E4M3, round_scales_to_power_of_2)
        raise ValueError(f"unknown FP8 granularity {granularity!r}; valid: tensorwise, rowwise, blockwise")


# ---------------------------------------------------------------------------
# One operand: round to the FP8 grid, return (values for the matmul, post-scale)
# ---------------------------------------------------------------------------


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x @ W.T + b with all three matmuls in emulated FP8 (see module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp8Recipe, compute_dtype: torch.dtype, cache: SharedInputCache | None):
        # x: [*, K] (any float dtype), weight: [N, K] (master, fp32), bias: [N] or None
        k = x.shape[-1]
        x2 = x.reshape(-1, k)  # [M, K]
        r, b = recipe, recipe.block
        q = dict(pow2=r.round_scales_to_power_of_2, compute_dtype=compute_dtype, block=b)
        with torch.autocast(x.device.type, enabled=False):  # dtypes are chosen explicitly here
            if r.granularity == "tensorwise":
                xv, xp = _quantize(cache, x2, r.input_format, "tensor", **q)
                wv, wp = quantize_operand(weight, r.weight_format, "tensor", **q)
                out = _mm(xv, wv.t(), xp, wp)  # [M, N]
                ctx.save_for_backward(xv, wv, xp, wp)  # same scale in backward: reuse the rounded tensors
            elif r.granularity == "rowwise":
                xv, xp = _quantize(cache, x2, r.input_format, "row", **q)  # per row over K
                wv, wp = quantize_operand(weight, r.weight_format, "row", **q)  # per output channel over K
                out = _mm(xv, wv.t(), xp, _t(wp))
                ctx.save_for_backward(x2, weight)
            else:
                xv, _ = _quantize(cache, x2, r.input_format, "tile_row", **q)  # 1 x 128 tiles
                wv, _ = quantize_operand(weight, r.weight_format, "block", **q)  # 128 x 128 blocks
                out = cpu_gemm.mm(xv, wv.t())
                ctx.save_for_backward(x2, wv)  # 128x128 blocks serve dgrad as they are
            if bias is not None:
                out = out.add_(bias.to(out.dtype))
        ctx.recipe, ctx.compute_dtype, ctx.x_shape, ctx.has_bias = recipe, compute_dtype, x.shape, bias is not None
        ctx.cache = cache
        return out.reshape(*x.shape[:-1], out.shape[-1])  # [*, N]

    @staticmethod
    def backward(ctx, grad_out):
        r, cd = ctx.recipe, ctx.compute_dtype
        q = dict(pow2=r.round_scales_to_power_of_2, compute_dtype=cd, block=r.block)
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [M, N]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if need_w and _STRICT["on"]:
            check_token_multiple(r.granularity, g2.shape[0])
        grad_x = grad_w = None
        with torch.autocast(grad_out.device.type, enabled=False):
            if r.granularity == "tensorwise":
                xv, wv, xp, wp = ctx.saved_tensors
                gv, gp = quantize_operand(g2, r.grad_format, "tensor", **q)
                if need_x:
                    grad_x = _mm(gv, wv, gp, wp)  # [M, K]
                if need_w:
                    grad_w = _mm(gv.t(), xv, gp, xp)  # [N, K]
            elif r.granularity == "rowwise":
                x2, weight = ctx.saved_tensors
                if need_x:
                    gv, gp = quantize_operand(g2, r.grad_format, "row", **q)  # per row over N
                    wv, wp = quantize_operand(weight, r.weight_format, "col", **q)  # per input channel over N
                    grad_x = _mm(gv, wv, gp, wp)
                if need_w:
                    gv, gp = quantize_operand(g2, r.grad_format, "col", **q)  # per output channel over M
                    xv, xp = _quantize(ctx.cache, x2, r.input_format, "col", **q)  # per input channel over M
                    grad_w = _mm(gv.t(), xv, _t(gp), xp)
            else:
                x2, wv = ctx.saved_tensors
                if need_x:
                    gv, _ = quantize_operand(g2, r.grad_format, "tile_row", **q)  # 1 x 128 tiles over N
                    grad_x = cpu_gemm.mm(gv, wv)
                if need_w:
                    gv, _ = quantize_operand(g2, r.grad_format, "tile_col", **q)  # 128 x 1 tiles over M
                    xv, _ = _quantize(ctx.cache, x2, r.input_format, "tile_col", **q)
                    grad_w = cpu_gemm.mm(gv.t(), xv)
        if grad_x is not None:
            grad_x = grad_x.reshape(ctx.x_shape)
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


# ---------------------------------------------------------------------------
# Kernel shape contracts (strict mode)
# ---------------------------------------------------------------------------

# Token-dimension multiple each granularity's hardware kernels need: torch._scaled_mm
# (tensorwise, rowwise) contracts over the tokens in the weight-gradient matmul
# (grad_out.T @ x) and needs every contracted dim divisible by 16; torchao's blockwise
# prototype quantizes grad_out in 128x1 tiles along the tokens for that matmul
# (``triton_fp8_blockwise_act_quant_transposed_lhs`` asserts ``size(0) % 128 == 0``).
TOKEN_MULTIPLE = {"tensorwise": 16, "rowwise": 16, "blockwise": 128}
_STRICT = {"on": os.environ.get("FP8RL_STRICT_FP8_SHAPES", "") not in ("", "0")}


class KernelShapeError(ValueError):
    """A matmul shape the real FP8 kernel would reject (raised by strict emulation)."""


def set_strict_shapes(on: bool) -> bool:
    """Turn strict shape checks of the emulation on/off; returns the previous setting.

    Strict: the emulated FP8 linear rejects exactly the shapes torchao's kernels
    reject (the token count of a weight-gradient matmul not a multiple of
    ``TOKEN_MULTIPLE[granularity]``), so a shape the GPU would crash on fails on
    CPU first. Also on when ``FP8RL_STRICT_FP8_SHAPES=1`` (the test suite sets it).
    """
    prev = _STRICT["on"]
    _STRICT["on"] = bool(on)
    return prev


def strict_shapes() -> bool:
    return _STRICT["on"]


def check_token_multiple(granularity: str, tokens: int, *, where: str = "") -> None:
    """Raise :class:`KernelShapeError` if ``tokens`` breaks ``granularity``'s kernel contract."""
    m = TOKEN_MULTIPLE[granularity]
    if tokens % m:
        raise KernelShapeError(
            f"FP8 {granularity} weight-gradient matmul{' in ' + where if where else ''} contracts over "
            f"{tokens} tokens; the hardware kernel needs a multiple of {m} (pad the micro-batch)"
        )


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype under autocast (BF16: what nn.Linear would output), else x's own dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Fp8TrainingLinear(nn.Linear):
    """``nn.Linear`` training with emulated FP8 matmuls; same parameters, same state_dict keys."""

    recipe: Fp8Recipe

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Fp8Recipe) -> "Fp8TrainingLinear":
        """Wrap ``mod``'s own parameters (no copy: optimizers and ties keep working)."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight = mod.weight
        new.bias = mod.bias
        new.recipe = recipe
        new.input_cache = None  # set by precision.convert_for_training: shared by a model's linears
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [*, K] -> [*, N]
        cache = getattr(self, "input_cache", None)
        return _Fp8LinearFunction.apply(x, self.weight, self.bias, self.recipe, compute_dtype(x), cache)

    def extra_repr(self) -> str:
        r = self.recipe
        return (
            f"{super().extra_repr()}, fp8={r.granularity} (x:{r.input_format.name} w:{r.weight_format.name} "
            f"grad:{r.grad_format.name}, pow2_scales={r.round_scales_to_power_of_2})"
        )


# ---------------------------------------------------------------------------
# W8A8 inference
# ---------------------------------------------------------------------------


class RolloutLinear(nn.Module):
    """What the emulated inference linears share (``Fp8RolloutLinear``, ``fp4_linear.Fp4RolloutLinear``).

    ``refresh_weight`` takes a weight [N, K] in master precision once per sync, checks
    its shape, quantizes it (the subclass's ``_quantize_weight``, into non-persistent
    buffers) and keeps the bias [N] in the compute dtype.
    """

    in_features: int
    out_features: int

    @torch.no_grad()
    def refresh_weight(
        self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        """Quantize ``weight`` [N, K] (master precision) for the next forwards; ``bias`` [N] kept in ``dtype``."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        self._quantize_weight(weight.detach(), dtype)
        self._set_bias(bias, dtype)

    def _quantize_weight(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        """Store the quantized ``weight`` [N, K] (detached) for forwards in ``dtype``."""
        raise NotImplementedError

    def _set_bias(self, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.bias = None if bias is None else bias.detach().to(dtype)


class Fp8RolloutLinear(RolloutLinear):
    """Inference linear with vLLM-style online FP8 W8A8 numerics (e4m3).

    scheme ``"per_tensor"``: weight one scale, activations one scale per token;
    ``"per_block"``: weight 128x128 blocks, activations 1x128 tiles. The FP8
    weight is built by ``refresh_weight`` from a high-precision weight, once per
    sync (stored in the copy's dtype; a BF16 view for autocast is cached on first
    use). Like ``nn.Linear``, it computes in the autocast dtype when autocast is
    on, else in its weight dtype. Not trainable; not in the state_dict.
    """

    def __init__(self, in_features: int, out_features: int, *, scheme: str, block: int = 128) -> None:
        super().__init__()
        if scheme not in ("per_tensor", "per_block"):
            raise ValueError(f"unknown W8A8 scheme {scheme!r}; valid: per_tensor, per_block")
        self.in_features, self.out_features, self.scheme, self.block = in_features, out_features, scheme, block
        self.register_buffer(
            "weight_values", torch.empty(0), persistent=False
        )  # [N, K] FP8 values (per_block: dequantized)
        self.register_buffer("weight_post", torch.empty(0), persistent=False)  # [] dequant scale (per_tensor)
        self.register_buffer("bias", None, persistent=False)  # [N]
        self._by_dtype: dict[torch.dtype, torch.Tensor] = {}
        self.input_cache: SharedInputCache | None = None  # set by precision.convert_for_rollout

    def _quantize_weight(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        layout = "tensor" if self.scheme == "per_tensor" else "block"
        values, post = quantize_operand(
            weight, E4M3, layout, pow2=False, compute_dtype=dtype, block=self.block, rule="vllm"
        )
        self.weight_values = values
        self.weight_post = post if post is not None else torch.empty(0, device=values.device)
        self._by_dtype = {dtype: values}
        if self.input_cache is not None:
            self.input_cache.clear()

    @staticmethod
    @torch.no_grad()
    def refresh_fused(
        mods: "list[Fp8RolloutLinear]",
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None],
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        """Quantize sibling projections as the ONE fused layer vLLM builds from them.

        vLLM 0.33 loads q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``
        and quantizes the fused weight ``cat(weights, dim=0)`` [sum N_i, K]:
        ``fp8_per_tensor`` gets one scale from the amax of all of it
        (``Fp8PerTensorOnlineLinearMethod.process_weights_after_loading``; under
        tensor parallelism the amax is all-reduced over the shards, so the scale is
        the unsharded fused weight's — what this computes); ``fp8_per_block``
        tiles the fused weight in 128x128 blocks, so a block may straddle q and k
        when a projection's rows are not a multiple of 128. Each module keeps its
        rows of the result; per-tensor modules share the one scale.
        """
        scheme = mods[0].scheme
        for mod, w in zip(mods, weights):
            if mod.scheme != scheme or tuple(w.shape) != (mod.out_features, mod.in_features):
                raise ValueError("refresh_fused: modules of one fused layer need one scheme and matching weights")
        fused = torch.cat([w.detach() for w in weights], dim=0)  # [sum N_i, K]
        layout = "tensor" if scheme == "per_tensor" else "block"
        values, post = quantize_operand(
            fused, E4M3, layout, pow2=False, compute_dtype=dtype, block=mods[0].block, rule="vllm"
        )
        row = 0
        for mod, bias in zip(mods, biases):
            mod.weight_values = values[row : row + mod.out_features]
            row += mod.out_features
            mod.weight_post = post if post is not None else torch.empty(0, device=values.device)
            mod._set_bias(bias, dtype)
            mod._by_dtype = {dtype: mod.weight_values}
            if mod.input_cache is not None:
                mod.input_cache.clear()

    def _weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        w = self._by_dtype.get(dtype)
        if w is None or w.device != self.weight_values.device:  # first use of this dtype since the sync (or a move)
            w = self._by_dtype[dtype] = self.weight_values.to(dtype)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [*, K] -> [*, N]
        if self.weight_values.numel() == 0:
            raise RuntimeError("Fp8RolloutLinear used before refresh_weight(); call sync_rollout_weights first")
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        else:
            dtype = self.weight_values.dtype
        w = self._weight_as(dtype)
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        layout = "row" if self.scheme == "per_tensor" else "tile_row"  # per token / 1 x 128 tiles
        xv, xp = _quantize(
            self.input_cache, x2, E4M3, layout, pow2=False, compute_dtype=dtype, block=self.block, rule="vllm"
        )
        if self.scheme == "per_tensor":
            out = _mm(xv, w.t(), xp, self.weight_post)
        else:
            out = cpu_gemm.mm(xv, w.t())
        if self.bias is not None:
            out = out.add_(self.bias.to(dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w8a8=fp8_{self.scheme}"
