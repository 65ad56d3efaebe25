"""The BF16 pass of a low-precision policy: the shadow forward and the bf16 parameter casts.

Calibrated Clipping compares, token by token, the training-precision (FP8 or FP4)
log-probs of the policy with the log-probs of the same policy computed in BF16,
the ``bf16`` mode's forward on the same fp32 master weights: the BF16 shadow pass.

- :func:`bf16_shadow`: inside, every converted linear computes as a plain BF16
  linear on the BF16 cast of its master weight, whatever backend converted it (our
  emulated linears, torchao's float8 modules, FP4) and however FSDP2 gathers it
  (with torchao's float8 all-gather, the linear would otherwise hold FP8 values).
- :func:`bf16_parameters`: in one process, every parameter read as its bf16 cast,
  as FSDP2's mixed-precision all-gather hands them over on N ranks, so one process
  computes exactly as N ranks do; :func:`recompute_like_forward` makes
  activation checkpointing recompute on the same casts (and under the same CPU GEMM mode).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl_core.cpu_numerics.cpu_gemm import active_cpu_gemm_mode

CONVERTED = "_fp8rl_converted"  # marker attribute on every linear converted for low-precision training


@contextlib.contextmanager
def bf16_shadow(model: nn.Module) -> Iterator[nn.Module]:
    """Inside: every converted low-precision linear of ``model`` computes as a plain BF16 ``nn.Linear``.

    With the same master weights and ``autocast_context``, the forward is then
    bit-identical to the ``bf16`` mode's (the BF16 shadow pass). Works for our
    linears and torchao's; nests; restores the low-precision forwards on exit.

    The weight it multiplies by is the BF16 cast of the fp32 master, whatever the
    linear's weight is during its forward. That matters under FSDP2 with torchao's
    float8 all-gather (tensorwise FP8 on several GPUs): there each linear receives
    the all-gathered float8 payload (a ``Float8TrainingTensor``), not BF16 values,
    and a plain linear over it would fail, or, were it dequantized, compute on
    FP8-rounded weights. Such a linear gathers the BF16 cast of its master shard
    itself, the all-gather FSDP2 runs for every other parameter (a collective: every
    rank runs the same shadow forwards, as every rank runs the same FP8 forwards).
    """
    sharded = _transformed_gathers(model)
    patched = []
    for mod in model.modules():
        if getattr(mod, CONVERTED, False) and "forward" not in mod.__dict__:
            mod.forward = functools.partial(_bf16_linear_forward, mod, sharded.get(id(mod)))
            patched.append(mod)
    try:
        yield model
    finally:
        for mod in patched:
            del mod.forward


def _bf16_linear_forward(mod: nn.Module, fsdp_param: Any, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` of ``mod`` on the BF16 weight (``x``: ``[..., in]`` -> ``[..., out]``).

    ``fsdp_param``: FSDP2's record of ``mod.weight`` when its all-gather transforms the
    payload (float8 all-gather), else None: the weight in hand is the BF16 one already
    (FSDP2's bf16 all-gather, :func:`bf16_parameters`' cast, or the fp32 master under autocast)."""
    weight = mod.weight
    if fsdp_param is not None:
        # the master shard, cast as FSDP2's bf16 policy casts, gathered; torchao's weight wrapper may come
        # back around the bf16 values (on one rank): its ops compute on the plain values inside
        weight = fsdp_param.sharded_param.detach().to(torch.bfloat16).full_tensor()
    return F.linear(x, weight, mod.bias)


def _transformed_gathers(model: nn.Module) -> dict[int, Any]:
    """id(linear) -> FSDP2's parameter record of its weight, for the weights whose all-gather hands the
    module something other than the bf16 cast (an all-gather extension: torchao's float8 all-gather)."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[int, Any] = {}
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        group = mod._get_fsdp_state()._fsdp_param_group  # torch 2.4+: FSDP2's per-module parameter group
        for fp in group.fsdp_params if group is not None else ():
            info = fp._module_info
            local = fp.sharded_param.to_local()
            if info.param_name == "weight" and hasattr(local, "fsdp_pre_all_gather"):
                found[id(info.module)] = fp
    return found


# Set while bf16_parameters reparametrizes a model: a block's checkpoint (entered during that forward) then
# recomputes on the same casts in backward (recompute_like_forward).
_BF16_CASTS_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("fp8rl_bf16_parameters", default=False)


@contextlib.contextmanager
def bf16_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """Inside: ``model``'s floating-point parameters read as their bf16 casts (differentiable: the bf16
    gradient flows back to the fp32 master as an fp32 gradient).

    The cast FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` applies to
    every all-gathered parameter (``stages.trainer.distributed.mixed_precision_policy``), done in one
    process without sharding, so one process computes exactly as N ranks do. A no-op on an
    FSDP2-sharded model (FSDP casts already) and when the parameters are not fp32. With activation
    checkpointing, see :func:`recompute_like_forward`.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.utils.stateless import _reparametrize_module  # what torch.func.functional_call runs

    if isinstance(model, FSDPModule):
        yield model
        return
    casts = {n: p.to(torch.bfloat16) for n, p in model.named_parameters() if p.dtype == torch.float32}
    if not casts:
        yield model
        return
    token = _BF16_CASTS_ON.set(True)
    try:
        with _reparametrize_module(model, casts, tie_weights=True):
            yield model
    finally:
        _BF16_CASTS_ON.reset(token)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """transformers' activation checkpointing of every decoder block, non-reentrant
    (``activation_checkpointing_enable``; its older name where the installed transformers has only that)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def recompute_like_forward(model: nn.Module) -> int:
    """Make every checkpointed block of ``model`` recompute, in backward, as its forward computed;
    returns the number of blocks. Call after :func:`enable_activation_checkpointing`.

    transformers checkpoints a block's ``forward`` (its hooks stay outside); the backward recomputes
    it later, when two things the forward ran under are gone:

    - **the bf16 casts** of an unsharded model (:func:`bf16_parameters` has handed the fp32 masters
      back): the recomputation would compute in fp32, and ``torch.utils.checkpoint`` refuses it (the
      tensors it saved were bf16). An FSDP2-sharded model all-gathers the bf16 parameters again itself.
    - **the CPU GEMM mode** (``cpu_bf16_gemm: fp32`` or ``portable``, a torch-function mode): a
      backward started inside the mode runs inside the mode's own handler, where the mode is off, so
      the recomputation would take PyTorch's native BF16 kernels and the plain transcendental
      functions, saving other tensors than the forward did (refused, or, where the counts happen to
      agree, gradients from other numerics). One process or sharded alike.

    Each block's checkpoint gets a ``context_fn`` whose recompute context restores both, as the
    forward had them (the same bf16 values, the same mode object).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = 0
    for mod in model.modules():
        fn = getattr(mod, "_gradient_checkpointing_func", None)
        if not isinstance(mod, GradientCheckpointingLayer) or not getattr(mod, "gradient_checkpointing", False):
            continue
        if not isinstance(fn, functools.partial):
            raise ValueError(f"{type(mod).__name__}: unexpected checkpointing function {fn!r}")
        if fn.keywords.get("use_reentrant", True):
            raise ValueError("recompute_like_forward needs non-reentrant checkpointing (use_reentrant=False)")
        kw = {**fn.keywords, "context_fn": functools.partial(_recompute_contexts, mod)}
        mod._plain_checkpointing_func = fn  # what a compiled block goes back to (stages.trainer.block_compile)
        mod._gradient_checkpointing_func = functools.partial(fn.func, *fn.args, **kw)
        blocks += 1
    return blocks


def _recompute_contexts(block: nn.Module):
    """``torch.utils.checkpoint``'s (forward, recompute) contexts of ``block``, chosen when its forward runs."""
    mode = active_cpu_gemm_mode()
    casts = _BF16_CASTS_ON.get()
    if mode is None and not casts:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _as_in_forward(block, mode, casts)


@contextlib.contextmanager
def _as_in_forward(block: nn.Module, mode: Any, casts: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if mode is not None and active_cpu_gemm_mode() is not mode:
            stack.enter_context(mode)
        if casts:
            stack.enter_context(_bf16_block(block))
        yield


@contextlib.contextmanager
def _bf16_block(block: nn.Module) -> Iterator[None]:
    from torch.nn.utils.stateless import _reparametrize_module

    casts = {n: p.to(torch.bfloat16) for n, p in block.named_parameters() if p.dtype == torch.float32}
    with _reparametrize_module(block, casts):
        yield
