"""SPMD training on PyTorch's own engine: torch.distributed, FSDP2, distributed checkpoint.

* :func:`init_from_env` joins the process group ``torchrun`` describes
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``):
  NCCL on CUDA, gloo on CPU (how the tests run it).
* :func:`shard_policy` shards the policy with FSDP2: ``fully_shard`` on every
  decoder block, then on the root (embeddings, final norm, lm_head, tied
  weights). Master weights stay float32 DTensors; compute dtype comes from the
  autocast of :func:`stages.train_core.policy_logprobs`. On CUDA with torchao's
  FP8 linears (tensorwise), torchao's float8 FSDP recipe applies: the policy is
  converted with ``enable_fsdp_float8_all_gather=True`` (see
  :func:`fsdp_float8_config`), so the all-gather moves FP8 weights, and
  :func:`after_optimizer_step` calls ``precompute_float8_dynamic_scale_for_fsdp``
  after each optimizer step (one all-reduce for every layer's amax instead of one
  per layer per forward). This CUDA path is written against torchao 0.18 and has
  not run on a GPU here.
* :func:`save_sharded` / :func:`load_sharded` use ``torch.distributed.checkpoint``
  with ``get_state_dict`` / ``set_state_dict``: every rank writes its shards;
  loading reshards, so a checkpoint restores on the same or a different world
  size. :func:`full_model_state` gathers the full (unsharded) state on rank 0 for
  the ``from_pretrained`` export (rollout engines stream theirs per parameter).

Under one process all of this is skipped: the same code runs unsharded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn


def init_from_env(device: torch.device | None = None) -> tuple[int, int, Any]:
    """(rank, world size, group) of this process; a single process when not under torchrun."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    if not dist.is_initialized():
        backend = "nccl" if (device is not None and device.type == "cuda") else "gloo"
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), dist.group.WORLD


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a transformers causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder blocks (model.model.layers) on {type(model).__name__}")
    return list(layers)


def fsdp_float8_config(granularity: str):
    """torchao's float8 config for FSDP2 on CUDA: FP8 all-gather for tensorwise scaling.

    torchao supports FP8 all-gather only for tensorwise dynamic scaling; rowwise
    and blockwise all-gather the float32 master weights as usual.
    """
    from fp8rl_core.precision import quiet_import_torchao_float8

    float8 = quiet_import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(granularity)
    if granularity == "tensorwise":
        import dataclasses

        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True, force_recompute_fp8_weight_in_bwd=True)
    return config


def shard_policy(model: nn.Module, cfg: Any = None, *, device: torch.device | None = None, mesh: Any = None) -> nn.Module:
    """FSDP2-shard ``model`` in place: each decoder block, then the root. Returns the model."""
    from torch.distributed.fsdp import fully_shard

    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


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


def save_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 storage_writer=None) -> None:
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
