"""vLLM's ``fp8_per_tensor`` W8A8 linear with the real FP8 GEMM (``torch._scaled_mm``), for gpu-check.

vLLM 0.33 on Hopper runs ``fp8_per_tensor`` as CUTLASS ``scaled_mm`` with a
dynamic per-token activation scale (``s_x = max(amax_row / 448, 1 / (448 * 512))``,
``x_q = fp8(x * (1 / s_x))``) and one per-tensor scale of the fused weight.
:func:`use_scaled_mm` swaps the forward of every per-tensor ``Fp8RolloutLinear``
of a ``convert_for_rollout`` copy for exactly that: the same FP8 weight values
and scale the emulation holds, the activation quantized by vLLM's rule, and the
FP8 x FP8 product with float32 accumulation done by the kernel. Comparing its
log-probs with the emulation's measures the emulation against a real kernel.
``torch._scaled_mm`` also runs (very slowly) on CPU, which is how it is tested.
"""

from __future__ import annotations

import types

import torch

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def scaled_mm_forward(self, x: torch.Tensor) -> torch.Tensor:  # [*, K] -> [*, N]
    x2 = x.reshape(-1, self.in_features)
    s_x = (x2.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)  # [M, 1]
    x_q = (x2.float() * s_x.reciprocal()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    w_q = self.weight_values.to(torch.float8_e4m3fn)  # FP8 values held exactly in the copy's dtype
    s_w = self.weight_post.float().reshape(1, 1).expand(1, self.out_features).contiguous()  # [1, N]
    out = torch._scaled_mm(x_q, w_q.t(), scale_a=s_x, scale_b=s_w, out_dtype=torch.bfloat16)
    if self.bias is not None:
        out = out + self.bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype if x.dtype != torch.float32 else torch.bfloat16)


def use_scaled_mm(model: torch.nn.Module) -> int:
    """Route every per-tensor FP8 rollout linear of ``model`` through ``torch._scaled_mm``; returns how many."""
    from fp8rl_core.precision.fp8_linear import Fp8RolloutLinear

    n = 0
    for mod in model.modules():
        if isinstance(mod, Fp8RolloutLinear) and mod.scheme == "per_tensor":
            mod.forward = types.MethodType(scaled_mm_forward, mod)
            n += 1
    return n
