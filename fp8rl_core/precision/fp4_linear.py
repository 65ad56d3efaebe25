"""Emulated FP4 linear layers: training after NVIDIA's NVFP4 recipe, and W4A4 inference.

Training (``Fp4TrainingLinear``, recipe ``Fp4Recipe``) follows "Pretraining Large
Language Models with NVFP4" (NVIDIA, 2025) as far as emulation allows. What is
implemented, per matmul of ``y = x @ W.T`` (x [M, K], W [N, K], dy [M, N]):

=============  ==============================  =====================================
matmul         operands                        rounding
=============  ==============================  =====================================
forward        x: 1 x b blocks along K         nearest-even
               W: b x b tiles (2-D)            nearest-even
grad-input     dy: 1 x b blocks along N        **stochastic**
               W: the *same* 2-D quantized W   (no re-quantization: fwd and bwd agree)
grad-weight    RHT(dy), RHT(x) along M,        dy: **stochastic**, x: nearest-even
               then b x 1 blocks along M
=============  ==============================  =====================================

b = 16 (NVFP4: E4M3 block scales + FP32 tensor scale) or 32 (MXFP4: E8M0
scales); RHT = the random Hadamard transform of order 16 with one random sign
vector per model (``fp8rl_core.precision.fp4.random_hadamard``), applied only to the
grad-weight inputs, as in the recipe. The token dim M is zero-padded to whole
Hadamard tiles / blocks there (zeros change neither the product nor any block's
amax). Layers the recipe keeps in high precision: lm_head and embeddings
always; any decoder linear the preset lists (``precision.keep_high_precision``,
fnmatch patterns — NVIDIA keeps the last ~15 % of blocks in BF16). Not
implemented: real FP4 tensor-core GEMMs (the emulation multiplies dequantized
values in the compute dtype, BF16 under autocast: one BF16 rounding per
dequantized operand, relative 2**-9, far below E2M1's 2**-2 step), the recipe's
switch to BF16 for the last stretch of training, and FP4 attention (attention
stays BF16 there too).

Stochastic rounding draws from one ``torch.Generator`` per model
(``Fp4State``); its state goes into the checkpoint (``fp4_rng_state`` /
``load_fp4_rng_state``) so a resumed run draws the same numbers as an
uninterrupted one. The random signs of the Hadamard transform are drawn once
from the seed and are part of the same state.

Inference (``Fp4RolloutLinear``): W4A4 like NVFP4 / MXFP4 inference engines —
the weight quantized once per weight sync in 1 x b blocks along K, activations
quantized per forward in 1 x b blocks along K (NVFP4: the activation's tensor
scale is computed dynamically from the batch).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import torch
from torch import nn

from fp8rl_core.cpu_numerics import cpu_gemm
from fp8rl_core.precision.fp4 import HADAMARD_SIZE, FP4Format, fake_quantize_fp4, random_hadamard, random_signs
from fp8rl_core.precision.fp8_linear import RolloutLinear, compute_dtype


@dataclass(frozen=True)
class Fp4Recipe:
    """FP4 numerics of one training linear (defaults: NVIDIA's NVFP4 recipe)."""

    fmt: FP4Format
    weight_2d: bool = True  # b x b weight tiles: forward and grad-input see the same quantized weight
    stochastic_grad: bool = True  # stochastic rounding of dy (both backward matmuls)
    hadamard_wgrad: bool = True  # random Hadamard transform on the grad-weight inputs


class Fp4State:
    """Randomness of a model's FP4 linears: the stochastic-rounding generator and
    the Hadamard signs. One per model, shared by its linears."""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.signs = random_signs(HADAMARD_SIZE, torch.Generator().manual_seed(self.seed + 7_777))

    def state_dict(self) -> dict:
        state = self.generator.get_state().numpy().tobytes()
        return {"seed": self.seed, "generator": base64.b64encode(state).decode()}

    def load_state_dict(self, d: dict) -> None:
        if int(d["seed"]) != self.seed:
            self.seed = int(d["seed"])
            self.signs = random_signs(HADAMARD_SIZE, torch.Generator().manual_seed(self.seed + 7_777))
        self.generator.set_state(torch.frombuffer(bytearray(base64.b64decode(d["generator"])), dtype=torch.uint8))


def _fq(
    t: torch.Tensor,
    fmt: FP4Format,
    layout: str,
    dtype: torch.dtype,
    *,
    state: Fp4State | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Fake-quantize t; stochastic rounding when a state (its generator) is given.
    ``inplace``: t is a float32 tensor of the caller's own that may be computed in.
    Returns a ``cpu_gemm.mm_rounded`` operand in ``dtype`` (float32-held BF16 under the FP32 GEMMs)."""
    if state is None:
        return cpu_gemm.rounded_operand(fake_quantize_fp4(t, fmt, layout, inplace=inplace), dtype)
    gen = state.generator
    if t.device.type != "cpu":  # one generator on the CPU: draw there, reproducible on any device
        y = fake_quantize_fp4(t.cpu(), fmt, layout, stochastic=True, generator=gen)
        return y.to(t.device, dtype)
    y = fake_quantize_fp4(t, fmt, layout, stochastic=True, generator=gen, inplace=inplace)
    return cpu_gemm.rounded_operand(y, dtype)


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-t.shape[0]) % multiple
    return nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


class _Fp4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe: Fp4Recipe, compute_dtype: torch.dtype, state: Fp4State):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)  # [M, K]
        f = recipe.fmt
        with torch.autocast(x.device.type, enabled=False), cpu_gemm.modes_off(x2, weight):
            xq = _fq(x2, f, "row", compute_dtype)  # 1 x b along K
            wq = _fq(weight, f, "block2d" if recipe.weight_2d else "row", compute_dtype)
            out = cpu_gemm.mm_rounded(xq, wq.t(), compute_dtype)
            if bias is not None:
                out = out.add_(bias.to(out.dtype))
        ctx.save_for_backward(x2, wq if recipe.weight_2d else weight)
        ctx.recipe, ctx.compute_dtype, ctx.x_shape, ctx.has_bias, ctx.state = (
            recipe,
            compute_dtype,
            x.shape,
            bias is not None,
            state,
        )
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        r, cd, f = ctx.recipe, ctx.compute_dtype, ctx.recipe.fmt
        x2, w = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])  # [M, N]
        sr = ctx.state if r.stochastic_grad else None
        grad_x = grad_w = None
        tile = max(HADAMARD_SIZE, f.block) if r.hadamard_wgrad else f.block
        g32 = g2.float()  # a copy of the BF16 gradient (g2 itself if it is float32)
        with torch.autocast(grad_out.device.type, enabled=False):
            gp = None
            if ctx.needs_input_grad[1] and r.hadamard_wgrad:  # reads g32 before dgrad quantizes it in place
                gp = random_hadamard(_pad_rows(g32, tile), ctx.state.signs)
            if ctx.needs_input_grad[0]:
                gq = _fq(g32, f, "row", cd, state=sr, inplace=g32 is not g2)  # 1 x b along N
                # 2-D tiles: the forward's quantized weight serves dgrad as it is
                wq = w if r.weight_2d else _fq(w.t().contiguous(), f, "row", cd).t()
                grad_x = cpu_gemm.mm_rounded(gq, wq, cd).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                xp = _pad_rows(x2.float(), tile)
                if r.hadamard_wgrad:
                    xp = random_hadamard(xp, ctx.state.signs)
                else:
                    gp = _pad_rows(g2.float(), tile)
                # blocks along M, down the columns: no transposed copies of [M', N] / [M', K]
                own = r.hadamard_wgrad  # the transform's outputs are fresh tensors: quantized in place
                gt = _fq(gp, f, "col", cd, state=sr, inplace=own)  # [M', N]
                xt = _fq(xp, f, "col", cd, inplace=own)  # [M', K]
                grad_w = cpu_gemm.mm_rounded(gt.t(), xt, cd)
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


class Fp4TrainingLinear(nn.Linear):
    """``nn.Linear`` training with emulated FP4 matmuls; same parameters and state_dict keys."""

    recipe: Fp4Recipe

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Fp4Recipe, state: Fp4State) -> "Fp4TrainingLinear":
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=False)
        new.weight, new.bias = mod.weight, mod.bias
        new.recipe, new.fp4_state = recipe, state
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Fp4LinearFunction.apply(x, self.weight, self.bias, self.recipe, compute_dtype(x), self.fp4_state)

    def extra_repr(self) -> str:
        r = self.recipe
        return (
            f"{super().extra_repr()}, fp4={r.fmt.name} (weight_2d={r.weight_2d}, "
            f"stochastic_grad={r.stochastic_grad}, hadamard_wgrad={r.hadamard_wgrad})"
        )


def fp4_state_of(model: nn.Module) -> Fp4State | None:
    """The model's FP4 randomness, or None if it has no FP4 linear."""
    for mod in model.modules():
        if isinstance(mod, Fp4TrainingLinear):
            return mod.fp4_state
    return None


def fp4_rng_state(model: nn.Module) -> dict | None:
    """JSON-able state of the model's stochastic-rounding generator (None: no FP4 layers)."""
    st = fp4_state_of(model)
    return None if st is None else st.state_dict()


def load_fp4_rng_state(model: nn.Module, state: dict | None) -> None:
    """Inverse of ``fp4_rng_state``; a no-op for models without FP4 layers or without a saved state."""
    st = fp4_state_of(model)
    if st is not None and state:
        st.load_state_dict(state)


class Fp4RolloutLinear(RolloutLinear):
    """Inference linear with emulated W4A4 numerics (NVFP4 or MXFP4, 1 x b blocks along K).

    ``refresh_weight`` quantizes the weight once per sync; activations are
    quantized per forward. Computes in the autocast dtype, else the weight dtype.
    """

    def __init__(self, in_features: int, out_features: int, *, fmt: FP4Format) -> None:
        super().__init__()
        for d, what in ((in_features, "in_features"), (out_features, "out_features")):
            if d % fmt.block:
                raise ValueError(f"{fmt.name} W4A4 needs {what} divisible by {fmt.block}, got {d}")
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.register_buffer("weight_values", torch.empty(0), persistent=False)  # [N, K] dequantized FP4 weight
        self.register_buffer("bias", None, persistent=False)

    def _quantize_weight(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        self.weight_values = fake_quantize_fp4(weight, self.fmt, "row").to(dtype)
        self._weight_f32 = None  # the float32 copy the FP32 GEMMs multiply with, made at first use

    def _gemm_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight operand of ``cpu_gemm.mm_rounded`` in ``dtype``: for BF16 values, one float32
        copy per refresh (the value the FP32 GEMMs upcast to at every call otherwise)."""
        w = self.weight_values
        if dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
            return w.to(dtype)
        if getattr(self, "_weight_f32", None) is None or self._weight_f32[0] is not w:
            self._weight_f32 = (w, w.float())
        return self._weight_f32[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_values.numel() == 0:
            raise RuntimeError("Fp4RolloutLinear used before refresh_weight(); call sync_rollout_weights first")
        dtype = (
            torch.get_autocast_dtype(x.device.type)
            if torch.is_autocast_enabled(x.device.type)
            else self.weight_values.dtype
        )
        x2 = x.reshape(-1, self.in_features)
        with torch.autocast(x.device.type, enabled=False), cpu_gemm.modes_off(x2, self.weight_values):
            xq = cpu_gemm.rounded_operand(fake_quantize_fp4(x2, self.fmt, "row"), dtype)
            out = cpu_gemm.mm_rounded(xq, self._gemm_weight(dtype).t(), dtype)
            if self.bias is not None:
                out = out.add_(self.bias.to(dtype))
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, w4a4={self.fmt.name}"
