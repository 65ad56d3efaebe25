"""The trainer's weights into vLLM: one transport per ``rollout.weight_sync``, and the checks around them.

**Weights never travel through ``collective_rpc``'s arguments to another process.**
``LLM`` runs its engine core in another process unless it is in-process, and
utility-call arguments cross as msgpack decoded *without a type*
(:mod:`stages.engines.vllm_wire` copies the rules): tensors arrive as bare lists.
In-process there is no boundary: the data plane is the trainer's own tensors;
across processes it is one of vLLM's RL weight-transfer mechanisms
(``vllm/distributed/weight_transfer``, ``vllm/entrypoints/rl/offline.py``, the same
in 0.32 and 0.33). The transports, registered by name in :data:`TRANSPORTS`:

- ``"tensors"`` (default; in-process only): ``collective_rpc("reload_weights",
  kwargs={"weights_iterator": ...})`` with a generator that casts each parameter
  to bf16 on its FSDP shard and all-gathers it alone
  (:func:`stages.engines.weight_transfer.stream_trainer_weights`): the engine
  copies it into its layer and the next one is gathered; no full copy of the
  model exists at any time (peak: :func:`~stages.engines.weight_transfer.sync_peak_bytes`).
- ``"ipc"`` (vLLM's engine process on the trainer's GPU): ``LLM(...,
  weight_transfer_config={"backend": "ipc"})``, then per sync
  ``start_weight_update()``, ``update_weights({"update_info": {names,
  dtype_names, shapes, ipc_handles_pickled}})``, ``finish_weight_update()`` —
  the unpacked format of ``IPCTrainerWeightTransferEngine``: one CUDA IPC
  handle (``torch.multiprocessing.reductions.reduce_tensor``) per bf16 tensor,
  keyed by the GPU's UUID, pickled and base64-encoded as vLLM's HTTP client
  does, because raw handles hold Python types msgpack refuses. vLLM only
  unpickles them with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which the engine
  sets for the engine process it starts. The bf16 copies stay alive until
  ``finish_weight_update`` returns.
- ``"nccl"`` (vLLM on other GPUs): vLLM's own
  ``NCCLTrainerWeightTransferEngine`` over a bf16 source of the policy, one
  parameter gathered at a time (:mod:`stages.engines.nccl_sync`), driven through
  the ``LLM`` (:class:`~stages.engines.nccl_sync.LLMWeightSyncClient`); the
  trainer's rank 0 is NCCL rank 0 of a ``1 + workers`` group rendezvoused at
  ``rollout.weight_sync_rendezvous``. It runs on a CPU in the tests with vLLM's
  real engines and a gloo stand-in for NCCL; it has not run on a GPU.
- ``"path"`` (fallback, any layout): the policy's weights as **bf16**
  safetensors in a temporary folder of our own (``fp8rl-weights-*``, never named
  after the model), then ``collective_rpc("reload_weights", kwargs={"weights_path":
  folder})``, which reads every ``*.safetensors`` there. Under several ranks it is
  written once per node (by local rank 0) and read by every rank's engine.

With ``rollout.weight_format: native_fp8`` the payload is the FP8 values and
scales on the engine's grid (:mod:`stages.engines.native_fp8`; ``tensors`` or
``path`` only) instead of bf16.

Each transport ends in vLLM's layerwise reload
(``model_executor/model_loader/reload/layerwise.py``): a fused layer
(``qkv_proj``, ``gate_up_proj``) is re-quantized (new FP8 weight and scale) once
*all* its elements arrived; a layer that got nothing silently keeps its old
weights, and with ``quantization`` set vLLM does not even warn about missing
names. So this side checks instead of assuming: every sync must send the same
complete set of names as the first (:class:`SentNames`), and a verified sync
(:func:`verified_reload`) zeroes the engine's weights
(``collective_rpc("reset_weights")``) before it and reads them back with
``collective_rpc("compute_weight_checksums")`` after: a processed parameter (FP8
weight or scale) whose digest is still the zeroed one was not reloaded, and the
sync fails naming it.
"""

from __future__ import annotations

import abc
import contextlib
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fp8rl_core.config.campaign import RolloutConfig
from fp8rl_core.registry import Registry
from stages.engines import native_fp8
from stages.engines import weight_transfer as wt
from stages.engines.nccl_sync import LLMWeightSyncClient, NcclRendezvous, NcclSender

NameCheck = Callable[[list[str]], None]


@dataclass(frozen=True)
class TransportOptions:
    """What a transport needs besides the engine and the policy.

    ``ipc_handle_fn`` / ``gpu_uuid``: how IPC handles are made and keyed (default: CUDA's
    ``reduce_tensor`` and the current GPU's UUID; the CPU tests inject their own).
    ``nccl_master``: the NCCL rendezvous and this trainer rank (``nccl`` only).
    """

    config: RolloutConfig
    precision_mode: str
    native_fp8: bool = False
    ipc_handle_fn: Callable[[torch.Tensor], Any] = wt.cuda_ipc_handle
    gpu_uuid: str | None = None
    nccl_master: NcclRendezvous | None = None


class Transport(abc.ABC):
    """Sends the trainer's weights to one ``vllm.LLM``; a new instance per engine."""

    name: str = "abstract"

    def __init__(self, options: TransportOptions) -> None:
        self.options = options

    @abc.abstractmethod
    def send(self, llm: Any, train_model: nn.Module, check_names: NameCheck) -> None:
        """Load ``train_model``'s weights into ``llm``; ``check_names`` sees every name sent, in order."""

    def close(self) -> None:
        """Release what the transport holds (a folder, a process group)."""


TRANSPORTS: Registry[type[Transport]] = Registry("weight-sync transport")
"""Transport classes by ``rollout.weight_sync``: ``tensors``, ``path``, ``ipc``, ``nccl``."""


def register_transport(name: str):
    """Class decorator: ``@register_transport("ipc")``; sets ``cls.name``."""
    return TRANSPORTS.register_class(name)


def make_transport(weight_sync: str, options: TransportOptions) -> Transport:
    return TRANSPORTS.get(weight_sync)(options)


def _payload(options: TransportOptions, train_model: nn.Module, device: str | torch.device | None) -> Iterable:
    """``(HF name, tensor)`` pairs, one parameter gathered at a time: bf16 parameters, or FP8 values and
    scales (``native_fp8``); on ``device`` (``None``: where the trainer holds them)."""
    if options.native_fp8:
        return native_fp8.stream_native_fp8_weights(train_model, options.precision_mode, device=device)
    return wt.stream_trainer_weights(train_model, device=device)


@register_transport("tensors")
class TensorsTransport(Transport):
    """In-process: the engine reads a generator of parameters, gathered one at a time."""

    def send(self, llm: Any, train_model: nn.Module, check_names: NameCheck) -> None:
        names: list[str] = []

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in _payload(self.options, train_model, None):  # on the trainer's device
                names.append(name)
                yield name, tensor

        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        check_names(names)


def _ranks() -> tuple[int, int]:
    """``(rank, world size)`` of the trainer's job (``(0, 1)`` outside torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def node_key() -> str:
    """Which machine this rank runs on: the host name and torchrun's node rank (several agents may share a host)."""
    return f"{socket.gethostname()}/{os.environ.get('GROUP_RANK', '0')}"


@register_transport("path")
class PathTransport(Transport):
    """Safetensors in a folder of our own, read back by the engine's ``reload_weights``.

    Under several ranks each node writes the weights once: its local rank 0 writes them while
    the others only join the gathers (each parameter's all-gather is a collective), then every
    rank's engine reads the same folder after a barrier. The folder is made by the writer at the
    first sync and its name shared with the node's ranks (one object all-gather); the writer
    removes it at ``close``."""

    def __init__(self, options: TransportOptions) -> None:
        super().__init__(options)
        self.folder: str | None = None
        self.writer = True

    def _share_folder(self) -> None:
        rank, world = _ranks()
        self.writer = int(os.environ.get("LOCAL_RANK", rank)) == 0
        mine = tempfile.mkdtemp(prefix="fp8rl-weights-") if self.writer else None
        if world == 1:
            self.folder = mine
            return
        entries: list[Any] = [None] * world
        dist.all_gather_object(entries, (node_key(), mine))
        folders = [folder for key, folder in entries if key == node_key() and folder is not None]
        if len(folders) != 1:
            raise RuntimeError(f"weight sync (path): {len(folders)} ranks of node {node_key()} claim local rank 0")
        self.folder = folders[0]

    def send(self, llm: Any, train_model: nn.Module, check_names: NameCheck) -> None:
        if self.folder is None:
            self._share_folder()
        if self.writer:
            weights = list(_payload(self.options, train_model, "cpu"))
            check_names([name for name, _ in weights])
            write = wt.write_safetensors if self.options.native_fp8 else wt.write_bf16_safetensors
            write(weights, self.folder)
        else:  # the gathers are collectives: join them, keep nothing
            check_names([name for name, _ in _payload(self.options, train_model, None)])
        if _ranks()[1] > 1:
            dist.barrier()  # the node's file is complete before any engine reads it
        llm.collective_rpc("reload_weights", kwargs={"weights_path": self.folder})

    def close(self) -> None:
        if self.folder is not None and self.writer:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None


@register_transport("ipc")
class IpcTransport(Transport):
    """CUDA IPC handles of bf16 copies on the trainer's GPU (the CPU tests inject file handles)."""

    def send(self, llm: Any, train_model: nn.Module, check_names: NameCheck) -> None:
        cuda_ipc = self.options.ipc_handle_fn is wt.cuda_ipc_handle
        device = torch.device("cuda", torch.cuda.current_device()) if cuda_ipc else "cpu"
        weights = wt.trainer_weights(train_model, device=device)  # the bf16 copies stay where the handles point
        check_names([name for name, _ in weights])
        if cuda_ipc:
            torch.cuda.synchronize()  # the copies must be complete before another process reads them
        uuid = self.options.gpu_uuid or wt.current_gpu_uuid()
        info, keep = wt.ipc_update_info(weights, gpu_uuid=uuid, handle_fn=self.options.ipc_handle_fn)
        llm.start_weight_update()
        llm.update_weights({"update_info": info})
        llm.finish_weight_update()
        del keep  # the worker has copied every tensor by now
        if cuda_ipc:
            torch.cuda.ipc_collect()


@register_transport("nccl")
class NcclTransport(Transport):
    """vLLM's NCCL weight-transfer engine, driven through the ``LLM`` (:mod:`stages.engines.nccl_sync`)."""

    def __init__(self, options: TransportOptions) -> None:
        super().__init__(options)
        self.sender: Any | None = None

    def send(self, llm: Any, train_model: nn.Module, check_names: NameCheck) -> None:
        if self.sender is None:
            self.sender = NcclSender(self.options.nccl_master, LLMWeightSyncClient(llm))
        self.sender.send(train_model, check_names)
        self.sender.barrier()

    def close(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()


class SentNames:
    """Every sync must send the same complete, duplicate-free list of names as the first."""

    def __init__(self) -> None:
        self.first: list[str] | None = None

    def __call__(self, names: list[str]) -> None:
        if len(set(names)) != len(names):
            raise RuntimeError("weight sync: duplicate parameter names in the trainer's state dict")
        if self.first is None:
            self.first = names
        elif names != self.first:
            lost = sorted(set(self.first) - set(names))
            new = sorted(set(names) - set(self.first))
            raise RuntimeError(f"weight sync: the trainer's parameters changed since the first sync (lost "
                               f"{lost[:5]}, new {new[:5]})")


@contextlib.contextmanager
def verified_reload(llm: Any, *, verify: bool, transport: str):
    """With ``verify``: zero the engine's weights before the block and fail after it naming any
    processed parameter whose checksum is still the zeroed one (a layer not re-quantized)."""
    if not verify:
        yield
        return
    llm.collective_rpc("reset_weights")
    zeroed = wt.merge_checksums(llm.collective_rpc("compute_weight_checksums"))
    yield
    after = wt.merge_checksums(llm.collective_rpc("compute_weight_checksums"))
    stale = wt.unreloaded_parameters(zeroed, after)
    if stale:
        raise RuntimeError(
            f"weight sync ({transport}) left {len(stale)} vLLM parameters un-reloaded (still zero after "
            f"reset_weights): {stale[:6]}; a layer whose weights did not all arrive is not re-quantized"
        )
