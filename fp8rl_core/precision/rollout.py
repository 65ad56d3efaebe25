"""Rollout modes (``convert_for_rollout``, registry ``ROLLOUT_PRECISIONS``): a BF16 inference copy of the
policy for CPU generation, whose decoder linears are ``bf16``, or W8A8 ``fp8_per_tensor`` / ``fp8_per_block``
like vLLM's online FP8, or the emulated FP4 ``*_w4a4`` modes. ``sync_rollout_weights`` refreshes the copy
from the trainer every RL step (FP8 weights are re-quantized there, once per sync, not per forward); the
weight formats and fused projection groups are what an engine's weight sync sends."""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from fp8rl_core.precision.bf16_pass import CONVERTED
from fp8rl_core.precision.conversion import _output_embedding_names
from fp8rl_core.precision.fp4 import MXFP4, NVFP4
from fp8rl_core.precision.fp4_linear import Fp4RolloutLinear
from fp8rl_core.precision.fp8_linear import Fp8RolloutLinear, SharedInputCache
from fp8rl_core.precision.outliers import carry_outliers, outlier_weight
from fp8rl_core.registry import Registry

ROLLOUT_PRECISIONS: Registry[Callable[[nn.Linear], nn.Module]] = Registry("rollout precision mode")


@ROLLOUT_PRECISIONS.register("bf16")
def _rollout_bf16(lin: nn.Linear) -> nn.Module:
    new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
    new.weight, new.bias = lin.weight, lin.bias  # values are refreshed by sync_rollout_weights
    return new


@ROLLOUT_PRECISIONS.register("fp8_per_tensor")
def _rollout_fp8_per_tensor(lin: nn.Linear) -> nn.Module:
    return Fp8RolloutLinear(lin.in_features, lin.out_features, scheme="per_tensor")


@ROLLOUT_PRECISIONS.register("fp8_per_block")
def _rollout_fp8_per_block(lin: nn.Linear) -> nn.Module:
    return Fp8RolloutLinear(lin.in_features, lin.out_features, scheme="per_block")


def convert_for_rollout(
    model: nn.Module, mode: str, *, dtype: torch.dtype = torch.bfloat16, weight_format: str = "bf16"
) -> nn.Module:
    """An inference copy of ``model`` for generation in ``mode`` (``ROLLOUT_PRECISIONS``).

    The copy holds ``dtype`` weights, is in eval mode without grads, and its
    decoder linears (not lm_head) are plain linears (``bf16``) or W8A8 FP8 linears
    (``Fp8RolloutLinear``). Like ``nn.Linear``, those compute in the autocast dtype
    under ``autocast_context`` and in ``dtype`` otherwise: a float32 copy under
    autocast has the trainer's BF16-mode numerics, a BF16 copy keeps the whole
    residual stream in BF16 like vLLM. Works on BF16 or FP8-converted training
    models, which it leaves untouched (gradients are not copied). The copy is made
    once; refresh it each step with ``sync_rollout_weights``.

    ``weight_format`` is how the weights travel to the engine (``rollout.weight_format``,
    :data:`WEIGHT_FORMATS`): ``bf16`` (the default; what a GPU engine receives today)
    rounds each quantized linear's weight to BF16 before the engine's own quantization;
    ``native_fp8`` quantizes the trainer's fp32 master weights on the engine's grid
    directly, as the trainer does when it sends FP8 values and their scales.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format == "native_fp8" and mode not in FP8_ROLLOUT_MODES:
        raise ValueError(f"weight_format 'native_fp8' needs an FP8 rollout mode {FP8_ROLLOUT_MODES}, got {mode!r}")
    make = ROLLOUT_PRECISIONS.get(mode)
    grads = {id(p): p.grad for p in model.parameters()}
    for p in model.parameters():  # do not deep-copy gradients
        p.grad = None
    try:
        rollout = copy.deepcopy(model)
    finally:
        for p in model.parameters():
            p.grad = grads[id(p)]
    for mod in rollout.modules():  # a copy made inside bf16_shadow must not keep the patched forwards
        if getattr(mod, CONVERTED, False):
            mod.__dict__.pop("forward", None)
    keep = _output_embedding_names(rollout)
    for parent_name, parent in list(rollout.named_modules()):
        for attr, child in list(parent.named_children()):
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, nn.Linear) and name not in keep:
                setattr(parent, attr, carry_outliers(child, make(child)))  # model.outliers stays with the copy
    cache = SharedInputCache()  # sibling projections quantize their shared input once
    for mod in rollout.modules():
        if isinstance(mod, Fp8RolloutLinear):
            mod.input_cache = cache
    rollout.to(dtype)
    rollout.eval().requires_grad_(False)
    rollout._fp8rl_rollout_mode = mode
    rollout._fp8rl_weight_format = weight_format
    sync_rollout_weights(rollout, model)
    return rollout


@torch.no_grad()
def sync_rollout_weights(rollout_model: nn.Module, train_model: nn.Module) -> None:
    """Copy the trainer's current weights into the rollout copy (in place, no re-allocation
    of the model); FP8 rollout linears re-quantize their weight here, once per sync.

    The quantized linears see the weights as the copy's ``weight_format`` says they
    travel (``convert_for_rollout``): rounded to BF16 first (``bf16``), or the fp32
    masters themselves (``native_fp8``)."""
    source = train_model.state_dict()
    as_sent = _as_sent(getattr(rollout_model, "_fp8rl_weight_format", "bf16"))
    missing = []
    dtype = rollout_model_dtype(rollout_model)
    for group in fused_rollout_groups(rollout_model):
        names = [name for name, _ in group]
        weights = [source.get(f"{name}.weight") for name in names]
        if any(w is None for w in weights):
            missing += [f"{n}.weight" for n, w in zip(names, weights) if w is None]
            continue
        Fp8RolloutLinear.refresh_fused(
            [mod for _, mod in group],
            [as_sent(outlier_weight(mod, w)) for (_, mod), w in zip(group, weights)],
            [source.get(f"{name}.bias") for name in names],
            dtype=dtype,
        )
    for name, mod in rollout_model.named_modules():  # FP4 W4A4 layers: one block-scaled weight each
        if isinstance(mod, Fp4RolloutLinear):
            w = source.get(f"{name}.weight")
            if w is None:
                missing.append(f"{name}.weight")
                continue
            mod.refresh_weight(as_sent(outlier_weight(mod, w)), source.get(f"{name}.bias"), dtype=dtype)
    for name, p in rollout_model.named_parameters():
        src = source.get(name)
        if src is None:
            missing.append(name)
            continue
        if src.shape != p.shape:
            raise ValueError(
                f"sync_rollout_weights: {name} has shape {tuple(src.shape)} in the trainer, "
                f"{tuple(p.shape)} in the rollout copy"
            )
        p.copy_(src)
    if missing:
        raise KeyError(
            f"sync_rollout_weights: the training model lacks {missing[:5]} (of {len(missing)}); "
            "was the rollout copy made from another architecture?"
        )


WEIGHT_FORMATS: tuple[str, ...] = ("bf16", "native_fp8")
"""How trained weights reach the rollout engine (``rollout.weight_format``)."""
FP8_ROLLOUT_MODES: tuple[str, ...] = ("fp8_per_tensor", "fp8_per_block")
"""Rollout modes whose engine can load FP8 values with their scales (``native_fp8``)."""


def _as_sent(weight_format: str):
    """The weight a quantized rollout linear quantizes, given how weights travel to the engine.

    ``bf16``: the engine gets BF16 weights and quantizes those (vLLM's online FP8 on a GPU
    today), so the trainer's fp32 masters are rounded to BF16 first; ``native_fp8``: the
    trainer quantizes its fp32 masters on the engine's grid and sends the FP8 values.
    """
    if weight_format == "native_fp8":
        return lambda w: w
    return lambda w: w.detach().to(torch.bfloat16).to(w.dtype)


FUSED_PROJECTIONS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections vLLM fuses into one layer (``qkv_proj``, ``gate_up_proj``), in its order."""


def fused_rollout_groups(model: nn.Module) -> list[list[tuple[str, Fp8RolloutLinear]]]:
    """The FP8 rollout linears of ``model`` grouped as vLLM fuses them; other linears alone.

    A group is ``[(name, module), ...]`` in fused order (q, k, v / gate, up).
    """
    groups: list[list[tuple[str, Fp8RolloutLinear]]] = []
    for parent_name, parent in model.named_modules():
        children = {attr: mod for attr, mod in parent.named_children() if isinstance(mod, Fp8RolloutLinear)}
        prefix = f"{parent_name}." if parent_name else ""
        for members in FUSED_PROJECTIONS:
            if all(m in children for m in members):
                groups.append([(prefix + m, children.pop(m)) for m in members])
        groups += [[(prefix + attr, mod)] for attr, mod in children.items()]
    return groups


def rollout_model_dtype(model: nn.Module) -> torch.dtype:
    """Floating dtype of a rollout copy's weights (BF16 unless made otherwise)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.bfloat16


# FP4 modes (nvfp4 / mxfp4 training, *_w4a4 rollout) register themselves in the registries above.


FP4_ROLLOUT_MODES = {"nvfp4_w4a4": NVFP4, "mxfp4_w4a4": MXFP4}

for _mode, _fmt in FP4_ROLLOUT_MODES.items():
    ROLLOUT_PRECISIONS.register(_mode)(
        lambda lin, _fmt=_fmt: Fp4RolloutLinear(lin.in_features, lin.out_features, fmt=_fmt)
    )
