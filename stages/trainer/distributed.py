"""SPMD training on PyTorch's own engine: torch.distributed, FSDP2, distributed checkpoint.

* :func:`init_from_env` joins the process group ``torchrun`` describes
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``):
  NCCL on CUDA, gloo on CPU (how the tests run it).
* :func:`shard_policy` shards the policy with FSDP2: ``fully_shard`` on every
  decoder block, then on the root (embeddings, final norm, lm_head, tied
  weights). Master weights stay float32 DTensors; parameters are all-gathered in
  bf16 and gradients reduced in fp32 (:func:`mixed_precision_policy`, FSDP2's
  ``MixedPrecisionPolicy``), so every forward computes on bf16 weights. With
  torchao's tensorwise FP8 linears (CUDA), torchao's float8 FSDP recipe applies:
  :func:`enable_float8_all_gather` switches on ``enable_fsdp_float8_all_gather``,
  so the all-gather moves FP8 weights, and :func:`after_optimizer_step` calls
  ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step (one
  all-reduce for every layer's amax instead of one per layer per forward).
  ``reshard_after_forward``: see :data:`RESHARD_AFTER_FORWARD`. This CUDA path is
  written against torchao 0.18 and has not run on a GPU here.
* :func:`save_sharded` / :func:`load_sharded` use ``torch.distributed.checkpoint``
  with ``get_state_dict`` / ``set_state_dict``: every rank writes its shards;
  loading reshards, so a checkpoint restores on the same or a different world
  size. :func:`full_model_state` gathers the full (unsharded) state on rank 0 for
  the ``from_pretrained`` export (rollout engines stream theirs per parameter).

Under one process the policy runs unsharded, and every forward of the train
step reads the bf16 casts of its fp32 masters
(:func:`fp8rl_core.precision.bf16_pass.bf16_parameters`): the cast FSDP2 applies, so one
process computes exactly as N ranks do.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn


def init_from_env(device: torch.device | None = None, *, timeout_s: float | None = None) -> tuple[int, int, Any]:
    """(rank, world size, group) of this process; a single process when not under torchrun.

    ``timeout_s``: how long a collective waits for a missing rank before it fails (the campaign
    passes ``timeouts.process_group_s``, longer than any stage's limit); ``None``: torch's default
    (10 minutes for NCCL, 30 for gloo)."""
    import datetime

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    if not dist.is_initialized():
        backend = "nccl" if (device is not None and device.type == "cuda") else "gloo"
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder blocks (model.model.layers) on {type(model).__name__}")
    return list(layers)


def mixed_precision_policy():
    """FSDP2's cast: parameters all-gathered in bf16 (the compute dtype of every mode: FP8 linears quantize
    from bf16, the rest runs under bf16 autocast), gradients reduce-scattered and kept in fp32 (the
    masters' dtype), as torchtitan and torchao's float8 recipes run it. Half the all-gather bytes of
    fp32 gathers; an fp32 reduction keeps the sum over ranks exact to fp32 rounding."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def enable_float8_all_gather(model: nn.Module) -> list[str]:
    """Switch torchao's float8 all-gather on for every torchao tensorwise ``Float8Linear`` (before sharding).

    Does what ``Float8Linear.from_float`` does with ``enable_fsdp_float8_all_gather=True``: the
    config flag, and the weight wrapped in ``WeightWithDynamicFloat8CastTensor``, whose FSDP2 hooks
    cast the local shard to float8 before the all-gather (one byte per weight on the wire) using
    the scale :func:`after_optimizer_step` precomputes. Rowwise, blockwise and our emulated linears
    are left as they are. Returns the names of the linears switched.
    """
    switched = []
    for name, mod in model.named_modules():
        config = getattr(mod, "config", None)
        cast = getattr(config, "cast_config_weight", None)
        if cast is None or not hasattr(mod, "linear_mm_config") or config.enable_fsdp_float8_all_gather:
            continue
        if getattr(cast.scaling_granularity, "value", None) != "tensorwise" or cast.scaling_type.value != "dynamic":
            continue
        import dataclasses

        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        mod.config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        mod.weight = nn.Parameter(
            WeightWithDynamicFloat8CastTensor(mod.weight.data, mod.linear_mm_config, cast.target_dtype),
            requires_grad=mod.weight.requires_grad,
        )
        switched.append(name)
    return switched


# reshard_after_forward: every decoder block frees its gathered parameters after its forward (ZeRO-3:
# only one block is ever unsharded, which the 32B preset needs), except the last, whose backward
# starts right away (re-gathering it would be wasted); the root (embeddings, final norm, lm_head)
# reshards too. As torchtitan's "default" policy.
RESHARD_AFTER_FORWARD = "blocks and root: yes; last block: no (its backward follows at once)"


def forget_sharding_decisions() -> None:
    """Empty DTensor's sharding-propagation caches (the Python one and the C++ fast path's).

    They key each decision on the device mesh's shape, not on the rank, and keep the output
    specs they computed, mesh and rank included. A process that sharded under one process
    group (say, rank 0 of the fake world a memory plan is measured on) and then forks the
    ranks of another would hand every rank rank 0's specs: each rank then believes it holds
    shard 0, and a distributed checkpoint finds half of every tensor missing."""
    try:  # one call clears both where torch has it (2.13 does)
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # older torch (the GPU machine's may be): whichever of the two exist
        from torch.distributed.tensor import DTensor

        cached = getattr(DTensor._op_dispatcher.sharding_propagator, "propagate_op_sharding", None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()
        return
    _clear_sharding_prop_cache()


def shard_policy(
    model: nn.Module, cfg: Any = None, *, device: torch.device | None = None, mesh: Any = None
) -> nn.Module:
    """FSDP2-shard ``model`` in place: each decoder block, then the root, bf16 all-gather with fp32
    gradient reduction, float8 all-gather for torchao tensorwise linears. Returns the model.
    Sharding decisions cached before (under another process group) are forgotten first."""
    from torch.distributed.fsdp import fully_shard

    forget_sharding_decisions()
    enable_float8_all_gather(model)
    mp = mixed_precision_policy()
    blocks = decoder_blocks(model)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    check_own_shards(model)
    return model


def check_own_shards(model: nn.Module) -> None:
    """Every sharded parameter must say it is this rank's shard: its mesh coordinate is this rank's
    place in its mesh. A parameter carrying another rank's (a stale sharding decision, see
    :func:`forget_sharding_decisions`) would train and checkpoint the wrong rows without an error;
    this raises in one line instead."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank()
    checked: set[int] = set()  # the parameters share a few mesh objects: each is checked once
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or id(p.device_mesh) in checked:
            continue
        mesh = p.device_mesh
        checked.add(id(mesh))
        where = (mesh.mesh == rank).nonzero()
        expected = tuple(where[0].tolist()) if len(where) else None
        if mesh.get_coordinate() != expected:
            raise RuntimeError(
                f"rank {rank}: parameter {name} is sharded as mesh coordinate {mesh.get_coordinate()}, "
                f"but this rank's is {expected}: a sharding decision of another process group was reused"
            )


def uses_fsdp_float8(model: nn.Module) -> bool:
    for mod in model.modules():
        c = getattr(mod, "config", None)
        if getattr(c, "enable_fsdp_float8_all_gather", False):
            return True
    return False


def after_optimizer_step(model: nn.Module) -> None:
    """torchao's FSDP float8 recipe: precompute every FP8 weight's scale in one all-reduce."""
    if uses_fsdp_float8(model):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded model state on rank 0's host memory, for the ``from_pretrained`` export
    (a collective: every rank must call it; the others get ``{}``).

    Rollout engines never take this: a weight sync streams one bf16 parameter at
    a time (:func:`stages.engines.weight_transfer.stream_trainer_weights`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _single_process_quiet():
    """DCP warns that it assumes one process when no group is up: that is the intent here."""
    import contextlib
    import warnings

    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    return stack


def save_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, storage_writer=None) -> None:
    """Every rank writes its shards of model + optimizer state to ``path`` (DCP; through
    ``storage_writer`` if given, a ``FileSystemWriter`` for ``path``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path), storage_writer=storage_writer)


def load_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a DCP checkpoint written by any number of ranks into this rank's shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
