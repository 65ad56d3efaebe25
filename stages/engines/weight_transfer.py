"""vLLM 0.33's weight-transfer payloads, built on the trainer's side (used by the vLLM engines).

Nothing here talks to vLLM; these functions build what crosses to it, so they
are testable without a GPU "up to the handles they produce":

* :func:`trainer_weights` — ``(HF name, bf16 tensor)`` pairs in layer order,
  what vLLM's ``model.load_weights`` expects (it fuses q/k/v and gate/up itself).
* :func:`ipc_update_info` — the unpacked CUDA-IPC ``update_info`` of
  ``IPCTrainerWeightTransferEngine`` (``vllm/distributed/weight_transfer/
  ipc_engine.py``): names, dtype names, shapes and one ``{gpu_uuid:
  rebuild_cuda_tensor args}`` handle per tensor, pickled and base64-encoded
  (``ipc_handles_pickled``) because raw handles hold Python types that vLLM's
  msgpack refuses (``stages.engines.vllm_wire``).
* :func:`nccl_trainer_init_kwargs` — vLLM's ``NCCLTrainerInitInfo`` for a
  trainer that is rank 0 beside ``TP`` inference workers.
* :func:`write_bf16_safetensors` — the path fallback's file, written atomically.
* :func:`unreloaded_parameters` — which processed linear-layer parameters a
  sync left at their zeroed checksum (vLLM's ``reset_weights`` +
  ``compute_weight_checksums``, ``model_loader/weight_checksum.py``): a layer
  whose weights did not all arrive is not re-quantized by vLLM's layerwise
  reload, and vLLM does not warn when ``quantization`` is set.
"""

from __future__ import annotations

import base64
import os
import pickle
import re
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from fp8rl_core.config import RolloutConfig


def trainer_weights(train_model: nn.Module, device: str | torch.device = "cpu") -> list[tuple[str, torch.Tensor]]:
    """``(name, bf16 tensor on device)`` pairs of the trainer's state dict, in layer order.

    HF names are what vLLM's ``load_weights`` expects (it fuses q/k/v and
    gate/up itself). ``torch.compile``'s ``_orig_mod.`` prefix is stripped; a
    tied ``lm_head.weight`` is skipped (vLLM ties it to the embedding).
    """
    tied = bool(getattr(getattr(train_model, "config", None), "tie_word_embeddings", False))
    out = []
    for name, tensor in train_model.state_dict().items():
        name = name.replace("_orig_mod.", "")
        if tied and name == "lm_head.weight":
            continue
        out.append((name, tensor.detach().to(device=device, dtype=torch.bfloat16).contiguous()))
    return out


def cuda_ipc_handle(tensor: torch.Tensor) -> tuple:
    """The ``rebuild_cuda_tensor`` arguments of a CUDA tensor (what vLLM's IPC engine ships)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if tensor.device.type != "cuda":
        raise ValueError("CUDA IPC needs CUDA tensors; weight_sync='ipc' is for a trainer on the vLLM GPU (use 'path' otherwise)")
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


def nccl_trainer_init_kwargs(config: RolloutConfig, *, master_address: str, master_port: int) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``NCCLTrainerInitInfo``: the trainer is rank 0 of ``1 + TP`` ranks."""
    return {"rank": 0, "master_address": master_address, "master_port": int(master_port), "world_size": 1 + config.tensor_parallel_size}


def write_bf16_safetensors(weights: list[tuple[str, torch.Tensor]], folder: str | Path) -> Path:
    """``weights`` as one bf16 ``model.safetensors`` in ``folder`` (written to a temporary name, then renamed)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    tmp = folder / "model.safetensors.tmp"
    save_file({name: t.to(torch.bfloat16).contiguous() for name, t in weights}, str(tmp), metadata={"format": "pt"})
    final = folder / "model.safetensors"
    os.replace(tmp, final)
    return final


LINEAR_PARAM = re.compile(r"_proj\.(weight|weight_scale|weight_scale_inv|bias)$")
"""The processed parameters of the decoder's linear layers (``qkv_proj.weight``, ``gate_up_proj.weight_scale``, ...).

Only these are checked after a sync: they are what the reload must re-quantize,
and every one of them comes from the checkpoint (attention's KV-cache scale
placeholders, for instance, do not)."""


def unreloaded_parameters(zeroed: dict[str, str], after: dict[str, str]) -> list[str]:
    """Linear-layer parameters whose checksum after a sync still equals the zeroed one (or vanished)."""
    return sorted(
        name for name, digest in zeroed.items() if LINEAR_PARAM.search(name) and after.get(name, digest) == digest
    )


def merge_checksums(per_worker: list[dict[str, str]]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for part in per_worker:
        merged.update(part)
    return merged
