"""Activation outliers put into a policy's low-precision passes, its parameters left plain (``model.outliers``).

Pretrained LLMs carry a few hidden channels whose activations are orders of magnitude above
the rest, the same channels in every block; a per-tensor FP8 scale is set by them and leaves
the other channels few levels. A tiny model trained from scratch has none. This makes them,
in ``channels`` hidden channels (a seeded choice, the same in every block) of the input of
every projection an RMSNorm feeds (q/k/v after ``input_layernorm``, gate/up after
``post_attention_layernorm``): with ``s`` = ``2**log2_scale`` on those channels and 1 elsewhere,
such a projection ``y = x @ W.T`` computes

    y = (x * s) @ (W / s).T        x: [*, K] its input, W: [N, K] its weight, s: [K]

the activation carrying the outliers and the weight's matching input columns divided by them,
as if the norm's weight had been multiplied by ``s``. Powers of two make ``x * s`` and ``W / s``
exact in fp32 and in bf16 (barring overflow and underflow), so in real arithmetic ``y`` is the
plain model's. Where the bits go:

* **Low-precision passes see the outliers**: every linear that quantizes its operands (the FP8
  and FP4 training linears, forward and both backward matmuls; the FP8/FP4 rollout linears)
  quantizes ``x * s`` and ``W / s``, so per-tensor (and per-row) scales are set by the outlier
  channels. That is the lever: more FP8 noise, on every pass that has FP8 noise.
* **BF16 passes keep the plain model's bits**: the BF16 training forward and backward, the BF16
  shadow pass and a BF16 rollout do not apply the factors at all. Applied, they would cancel in
  the products, but not in every GEMM: the CPU's exact GEMM (``cpu_numerics.portable_math``) puts
  each row of an operand on a grid of its largest value, and an outlier 2**14 above its
  neighbours rounds their low bits away.
* **The trained parameters are the plain ones.** ``s`` is a fixed, non-persistent buffer
  (``outlier_scale``, not in ``state_dict``, never optimized), applied in the forward. The
  optimizer, gradient clipping and checkpoints see ``W`` and its gradient: through ``W / s`` the
  gradient of ``W`` is the gradient of ``W / s`` divided by ``s``, the plain one up to FP8
  noise. (Folding ``s`` into the stored weights instead makes Adam, which moves every entry by
  about the learning rate, move a column divided by 2**14 as much as any other: 2**14 times too
  far in the plain model's terms.)

Apply it after ``convert_for_training`` (which replaces the linears); ``convert_for_rollout``
carries it to the rollout copy, whose quantized weights are refreshed as ``W / s``
(:func:`outlier_weight`). A training linear reads ``W / s`` by the swap ``torch.func.functional_call``
makes (its ``_parameters`` entry, for the forward only). Checked on one process with the emulated
linears; FSDP2 shards and compiled blocks have not run with it (vLLM engines are refused).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from fp8rl_core.precision.bf16_pass import CONVERTED

# RMSNorm of a Qwen3/Llama decoder block -> the projections that read its output
FEEDS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}
BUFFER = "outlier_scale"  # [K] float32: 2**log2_scale on the outlier channels, 1 elsewhere
_SHARED = "_fp8rl_outlier_input"  # the _ScaledInput of the projections that read one norm's output


def outlier_channels(hidden_size: int, channels: int, seed: int) -> list[int]:
    """The ``channels`` hidden channels made outliers: a seeded choice, the same in every block."""
    g = torch.Generator().manual_seed(int(seed))
    return sorted(torch.randperm(hidden_size, generator=g)[:channels].tolist())


class _ScaledInput:
    """``x * s`` of the last input, shared by sibling projections (q/k/v, gate/up): they read one
    tensor, and handing them one scaled tensor keeps the FP8 linears' shared input cache working
    (one quantization per activation, not one per projection). The input is held weakly."""

    def __init__(self) -> None:
        self._src: weakref.ref | None = None
        self._out: torch.Tensor | None = None
        self._version: int | None = None

    def __call__(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # x: [*, K], scale: [K]
        version = _version(x)
        if self._src is not None and self._src() is x and self._version == version and self._out is not None:
            return self._out
        out = x * scale.to(x.dtype)
        self._src, self._out, self._version = weakref.ref(x), out, version
        return out

    def __deepcopy__(self, memo: dict) -> "_ScaledInput":  # a model's copy shares nothing with it
        return _ScaledInput()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter (and cannot be modified)
        return None


def _quantizes(mod: nn.Module) -> bool:
    """Whether ``mod`` quantizes its operands in this forward: a converted training linear outside the
    BF16 shadow (which patches ``forward`` on the instance), or a low-precision rollout linear."""
    if getattr(mod, CONVERTED, False):
        return "forward" not in mod.__dict__
    return hasattr(mod, "weight_values")  # Fp8RolloutLinear, Fp4RolloutLinear: weights quantized at sync


def _before(mod: nn.Module, args: tuple) -> tuple | None:
    if not _quantizes(mod):
        return None  # a BF16 pass: the plain model's operands, the plain model's bits
    scale = mod.get_buffer(BUFFER)
    weight = mod._parameters.get("weight")
    if weight is not None:  # a training linear: its forward reads W / s (as torch.func.functional_call swaps)
        mod.__dict__["_fp8rl_outlier_weight"] = weight
        mod._parameters["weight"] = weight / scale.to(weight.dtype)
    return (getattr(mod, _SHARED)(args[0], scale), *args[1:])


def _after(mod: nn.Module, args: tuple, out: torch.Tensor) -> None:
    weight = mod.__dict__.pop("_fp8rl_outlier_weight", None)
    if weight is not None:
        mod._parameters["weight"] = weight


def _attach(mod: nn.Module, scale: torch.Tensor, shared: _ScaledInput) -> None:
    mod.register_buffer(BUFFER, scale, persistent=False)
    setattr(mod, _SHARED, shared)
    mod.register_forward_pre_hook(_before)
    mod.register_forward_hook(_after, always_call=True)


@torch.no_grad()
def inject_outliers(model: nn.Module, channels: int, log2_scale: int, seed: int) -> list[int]:
    """Give ``model``'s fed projections the outlier scale (module docstring), in place; returns the
    channels. Call after ``convert_for_training``. A no-op for ``channels == 0``."""
    if channels == 0:
        return []
    layers = model.model.layers
    hidden = layers[0].input_layernorm.weight.shape[0]
    chosen = outlier_channels(hidden, channels, seed)
    scale = torch.ones(hidden, dtype=torch.float32, device=layers[0].input_layernorm.weight.device)
    scale[torch.tensor(chosen)] = float(2**log2_scale)
    for block in layers:
        for projections in FEEDS.values():
            shared = _ScaledInput()
            for path in projections:
                mod = block.get_submodule(path)
                if BUFFER in mod._buffers:
                    raise ValueError(f"{path} already carries model.outliers")
                _attach(mod, scale.clone(), shared)
    return chosen


def carry_outliers(old: nn.Module, new: nn.Module) -> nn.Module:
    """``new`` (the linear of a model's copy that replaces ``old``, of the same copy) with ``old``'s
    outlier scale and shared input, if it has them (``convert_for_rollout``)."""
    if BUFFER in old._buffers:
        _attach(new, old.get_buffer(BUFFER).clone(), getattr(old, _SHARED))
    return new


def outlier_weight(mod: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """The weight ``[N, K]`` a low-precision rollout linear quantizes at a weight sync: ``weight / s``
    where ``mod`` carries the outlier scale, else ``weight``."""
    if BUFFER not in mod._buffers:
        return weight
    return weight / mod.get_buffer(BUFFER).to(device=weight.device, dtype=weight.dtype)


__all__ = ["FEEDS", "carry_outliers", "inject_outliers", "outlier_channels", "outlier_weight"]
