"""vLLM 0.33's weight-transfer payloads, built on the trainer's side (used by the vLLM engines).

Nothing here talks to vLLM; these functions build what crosses to it, so they
are testable without a GPU "up to the handles they produce":

* :func:`stream_trainer_weights` — ``(HF name, bf16 tensor)`` pairs in layer
  order, what vLLM's ``model.load_weights`` expects (it fuses q/k/v and gate/up
  itself), produced one parameter at a time: an FSDP2-sharded parameter is cast
  to bf16 on its shard and all-gathered alone (a collective: every rank iterates
  together), so a sync never holds more than one full bf16 parameter beside the
  shards — never a full fp32 copy of the model. :func:`trainer_weights` is the
  same as a list (for the transports that need every tensor at once).
* :func:`sync_peak_bytes` — the peak extra device memory of one sync, per
  transport (``fp8rl plan`` prints it).
* :func:`ipc_update_info` — the unpacked CUDA-IPC ``update_info`` of
  ``IPCTrainerWeightTransferEngine`` (``vllm/distributed/weight_transfer/
  ipc_engine.py``): names, dtype names, shapes and one ``{gpu_uuid:
  rebuild_cuda_tensor args}`` handle per tensor, pickled and base64-encoded
  (``ipc_handles_pickled``) because raw handles hold Python types that vLLM's
  msgpack refuses (``stages.engines.vllm_wire``).
* :func:`nccl_trainer_init_kwargs` — vLLM's ``NCCLTrainerInitInfo`` for one
  trainer rank beside the engine's inference workers (rank 0 sends).
* :func:`write_bf16_safetensors` — the path fallback's file, written atomically.
* :func:`unreloaded_parameters` — which processed linear-layer parameters a
  sync left at their zeroed checksum (vLLM's ``reset_weights`` +
  ``compute_weight_checksums``, ``model_loader/weight_checksum.py``): a layer
  whose weights did not all arrive is not re-quantized by vLLM's layerwise
  reload, and vLLM does not warn when ``quantization`` is set.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn


def is_tied(model: nn.Module) -> bool:
    """Whether ``model``'s output embedding shares the input embedding's weight (``tie_word_embeddings``)."""
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def full_parameter(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` whole: a DTensor (FSDP2 shard) is cast on its shard first, then all-gathered (a collective)."""
    from torch.distributed.tensor import DTensor

    t = tensor.detach()
    if dtype is not None:
        t = t.to(dtype)
    return t.full_tensor() if isinstance(t, DTensor) else t


def stream_trainer_weights(
    train_model: nn.Module, device: str | torch.device | None = None, dtype: torch.dtype = torch.bfloat16
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full dtype tensor)`` of the trainer's state dict, one parameter at a time, in layer order.

    HF names are what vLLM's ``load_weights`` expects. ``torch.compile``'s
    ``_orig_mod.`` prefix is stripped; a tied ``lm_head.weight`` is skipped
    (vLLM ties it to the embedding). Under FSDP2 every rank must consume the
    whole iterator, in step (each sharded parameter is one all-gather).
    """
    for name, tensor in sent_state(train_model):
        full = full_parameter(tensor, dtype)
        yield name, (full if device is None else full.to(device)).contiguous()


def sent_state(train_model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(HF name, state tensor)`` of every entry a sync sends, in layer order, nothing gathered: the
    ``_orig_mod.`` prefix stripped, a tied ``lm_head.weight`` left out. A sharded ``DTensor`` entry
    knows its global shape and element count."""
    tied = is_tied(train_model)
    named = ((name.replace("_orig_mod.", ""), t) for name, t in train_model.state_dict().items())
    return [(name, t) for name, t in named if not (tied and name == "lm_head.weight")]


def trainer_weights(train_model: nn.Module, device: str | torch.device = "cpu") -> list[tuple[str, torch.Tensor]]:
    """:func:`stream_trainer_weights` as a list: every bf16 tensor on ``device`` at once."""
    return list(stream_trainer_weights(train_model, device))


def parameter_numels(train_model: nn.Module) -> dict[str, int]:
    """Full (unsharded) element count of every parameter the sync sends."""
    return {name: t.numel() for name, t in sent_state(train_model)}


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Parameters vLLM loads into one fused layer (``qkv_proj``, ``gate_up_proj``)."""


def largest_fused_layer(numels: dict[str, int]) -> int:
    """Elements of the largest layer vLLM materializes whole during a reload (a fused one or a single one)."""
    best = max(numels.values(), default=0)
    for group in FUSED:
        sums: dict[str, int] = {}
        for name, n in numels.items():
            for part in group:
                if f".{part}." in name:
                    key = name.replace(f".{part}.", ".#.")
                    sums[key] = sums.get(key, 0) + n
        best = max([best, *sums.values()])
    return best


PACKED_BUFFER_BYTES = 1 << 30
PACKED_BUFFERS = 2
"""vLLM's packed NCCL transfer (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``, ``DEFAULT_PACKED_NUM_BUFFERS``), which the
NCCL sync uses."""


def sync_peak_bytes(
    *, largest_param: int, largest_layer: int, total: int, world_size: int, weight_sync: str, quantized: bool
) -> int:
    """Peak extra device memory of one sync, bytes (element counts in, bf16 = 2 bytes).

    * ``tensors`` (in-process, streamed): one full bf16 parameter and its bf16
      shard; with an FP8 rollout vLLM also materializes one (fused) layer in bf16
      before re-quantizing it.
    * ``nccl``: vLLM's trainer engine packs the bf16 parameters into chunks of
      :data:`PACKED_BUFFER_BYTES` (plus the tensor that crosses it) and broadcasts
      each while packing the next (``packed_nccl_broadcast_producer``, its default
      two buffers): the chunk in flight, the tensors of the next and their packed
      copy; one chunk fewer when the whole model fits in one. (The engine's own
      re-quantization happens on its GPUs, not here.)
    * ``path``: gathered one parameter at a time, kept on the host (the device
      holds one parameter); the engine reads the file layer by layer.
    * ``ipc``: every bf16 copy stays on the device until the engine has copied it.
    * ``full_fp32``: a whole fp32 model gathered on every rank (the old sync; for comparison).
    """
    shard = -(-largest_param // max(world_size, 1))
    one = 2 * (largest_param + shard)
    layer = 2 * largest_layer if quantized else 0
    chunk = min(2 * total, PACKED_BUFFER_BYTES + 2 * largest_param)
    in_flight = min(-(-2 * total // PACKED_BUFFER_BYTES), PACKED_BUFFERS) - 1
    per_sync = {
        "tensors": one + layer,
        "nccl": 2 * shard + (in_flight + 2) * chunk,
        "path": one + layer,
        "ipc": 2 * total + 2 * shard + layer,
        "full_fp32": 4 * total + layer,
    }
    if weight_sync not in per_sync:
        raise ValueError(f"weight_sync must be one of {sorted(per_sync)}, got {weight_sync!r}")
    return per_sync[weight_sync]


def model_sync_peak_bytes(train_model: nn.Module, *, world_size: int, weight_sync: str, quantized: bool) -> int:
    """:func:`sync_peak_bytes` for a model (its full parameter sizes)."""
    numels = parameter_numels(train_model)
    return sync_peak_bytes(
        largest_param=max(numels.values(), default=0),
        largest_layer=largest_fused_layer(numels),
        total=sum(numels.values()),
        world_size=world_size,
        weight_sync=weight_sync,
        quantized=quantized,
    )


BF16_UNIT_ROUNDOFF = 2.0**-8
"""bf16 keeps 8 significant bits: one rounding moves a value by at most 2^-8 of itself (relative)."""


def bf16_logprob_tolerance(max_abs_logit: float, depth: int) -> float:
    """A worst-case bound on the |engine - trainer| log-prob gap between two BF16 forwards of the same weights.

    Both sides hold bf16 weights and run bf16 matmuls but accumulate in different
    orders (vLLM's kernels, torch's autocast): each of the ``depth`` rounded
    stages (two per decoder block, plus the head) moves a logit by up to one
    unit roundoff of its magnitude, and a log-softmax moves by at most twice the
    largest logit error: ``2 * u * max(max|z|, 1) * (depth + 1)``. Worst case:
    at 28 layers it is 0.445 nats per unit of the largest logit, so loose that a
    sync leaving one layer stale passes it; a sync check judges with
    :func:`bf16_sync_tolerance` instead.
    """
    return 2.0 * BF16_UNIT_ROUNDOFF * max(max_abs_logit, 1.0) * (depth + 1)


BF16_SYNC_FACTOR = 2.0
"""Engine and trainer each sit within the trainer's own BF16 rounding footprint of the exact forward."""


def bf16_sync_tolerance(trainer_bf16: list[list[float]], trainer_fp32: list[list[float]]) -> float:
    """Largest |engine - trainer| log-prob gap a correct BF16 weight sync may show, from the trainer's own rounding.

    ``trainer_bf16`` / ``trainer_fp32``: the trainer's log-probs of the same tokens (one list per
    sequence) in its BF16 forward and in float32 (the exact forward, to 2^-24). Their largest gap
    ``d`` is what BF16 rounding does to this model at these weights and tokens. A synced engine
    computes a BF16 forward of the same weights with other kernels: its own rounding error is of
    the same kind and size (measured on vLLM's CPU build at 28 layers: 0.33 d), so
    ``|engine - trainer| <= |engine - exact| + |trainer - exact| <= 2 d``: the tolerance
    :data:`BF16_SYNC_FACTOR` x ``d``. A sync that leaves even one layer at its old weights moves
    the log-probs by that layer's share of the update, well above it (docs/gpu-and-scale.md has
    the figures); the worst-case :func:`bf16_logprob_tolerance` lets such a sync pass.
    """
    d = max((abs(a - b) for ra, rb in zip(trainer_bf16, trainer_fp32) for a, b in zip(ra, rb)), default=0.0)
    return BF16_SYNC_FACTOR * d


def cuda_ipc_handle(tensor: torch.Tensor) -> tuple:
    """The ``rebuild_cuda_tensor`` arguments of a CUDA tensor (what vLLM's IPC engine ships)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if tensor.device.type != "cuda":
        raise ValueError(
            "CUDA IPC needs CUDA tensors; weight_sync='ipc' is for a trainer on the vLLM GPU (use 'path' otherwise)"
        )
    _, args = reduce_tensor(tensor)
    return args


def current_gpu_uuid() -> str:
    """The physical UUID vLLM's IPC worker looks its handle up by."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def ipc_update_info(
    weights: list[tuple[str, torch.Tensor]], *, gpu_uuid: str, handle_fn: Callable[[torch.Tensor], Any]
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """vLLM 0.33's unpacked IPC ``update_info`` for ``weights`` (order kept), and the tensors to keep alive.

    ``{"names", "dtype_names", "shapes", "ipc_handles_pickled"}`` where the
    handles are ``[{gpu_uuid: handle_fn(tensor)}, ...]`` pickled + base64
    (``IPCWeightTransferUpdateInfo``; vLLM unpickles it with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). The caller must keep the returned
    tensors alive until ``finish_weight_update`` returns: an IPC handle does not
    own its storage.
    """
    names, dtypes, shapes, handles, keep = [], [], [], [], []
    for name, tensor in weights:
        t = tensor.detach().contiguous()
        keep.append(t)
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        handles.append({gpu_uuid: handle_fn(t)})
    info = {
        "names": names,
        "dtype_names": dtypes,
        "shapes": shapes,
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii"),
    }
    return info, keep


def nccl_trainer_init_kwargs(*, rank: int, master_address: str, master_port: int, workers: int) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``NCCLTrainerInitInfo`` for trainer rank ``rank``: the group is the
    trainer's sender (rank 0) and ``workers`` inference workers; a rank other than 0 does not join it."""
    return {
        "rank": int(rank),
        "master_address": master_address,
        "master_port": int(master_port),
        "world_size": 1 + int(workers),
    }


def write_bf16_safetensors(weights: list[tuple[str, torch.Tensor]], folder: str | Path) -> Path:
    """``weights`` as one bf16 ``model.safetensors`` in ``folder`` (written to a temporary name, then renamed)."""
    return write_safetensors([(name, t.to(torch.bfloat16)) for name, t in weights], folder)


def write_safetensors(weights: list[tuple[str, torch.Tensor]], folder: str | Path) -> Path:
    """``weights`` in their own dtypes as one ``model.safetensors`` in ``folder`` (temporary name, then renamed)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder / "model.safetensors.tmp"
    save_file({name: t.contiguous() for name, t in weights}, str(tmp), metadata={"format": "pt"})
    final = folder / "model.safetensors"
    os.replace(tmp, final)
    return final


LINEAR_PARAM = re.compile(r"_proj\.(weight|weight_scale|weight_scale_inv|bias)$")
"""The processed parameters of the decoder's linear layers (``qkv_proj.weight``, ``gate_up_proj.weight_scale``, ...).

Only these are checked after a sync: they are what the reload must re-quantize,
and every one of them comes from the checkpoint (attention's KV-cache scale
placeholders, for instance, do not)."""


EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()
"""vLLM's checksum of a parameter that holds no bytes: on the CPU backend a linear layer's weight is
repacked for oneDNN at load and its ``weight`` parameter left empty, so its checksum cannot tell a
reloaded layer from a zeroed one (such parameters are not judged)."""


def unreloaded_parameters(zeroed: dict[str, str], after: dict[str, str]) -> list[str]:
    """Linear-layer parameters whose checksum after a sync still equals the zeroed one (or vanished)."""
    return sorted(
        name
        for name, digest in zeroed.items()
        if LINEAR_PARAM.search(name) and digest != EMPTY_DIGEST and after.get(name, digest) == digest
    )


def merge_checksums(per_worker: list[dict[str, str]]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for part in per_worker:
        merged.update(part)
    return merged
