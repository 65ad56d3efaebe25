"""``weight_sync: nccl``: the trainer's side of vLLM's NCCL weight transfer, for every trainer rank.

vLLM 0.32 ships both ends (``vllm/distributed/weight_transfer/nccl_engine.py``): its
``NCCLTrainerWeightTransferEngine`` on the trainer and ``NCCLWeightTransferEngine`` in
each inference worker, meeting on a TCP rendezvous (``StatelessProcessGroup``) in an
NCCL group of ``1 + workers`` ranks whose rank 0 broadcasts. What this module adds:

* :class:`NcclRendezvous` — where the group meets (``rollout.weight_sync_rendezvous``:
  host, port, the engine's worker count) and which trainer rank this process is;
  :func:`resolve_rendezvous` fills a null port with one trainer rank 0 picks free and
  tells the other ranks.
* The weight source (:func:`trainer_source`, a subclass of vLLM's ``WeightSource``):
  ``metadata()`` lists every parameter the sync sends, HF name, global shape and
  **bf16**, without gathering anything (an FSDP2 ``DTensor`` knows its global shape);
  iteration is :func:`stages.engines.weight_transfer.stream_trainer_weights`, one bf16
  parameter gathered at a time. vLLM's own ``ModuleSource`` would send the module's
  dtype (fp32 masters: twice the bytes the memory plan counts) and the tied
  ``lm_head``; this source sends what the other transports send.
* :class:`NcclSender` — **one sender**: every trainer rank calls vLLM's ``trainer_init``
  with its own rank and ``send_weights``; vLLM makes rank 0 the sender (it opens the
  endpoint and drives the engine), the other ranks only iterate the source (their part
  of each all-gather). The names are checked from ``metadata()`` at every sync
  (:class:`~stages.engines.vllm_sync.SentNames`; no gather), and vLLM checks the
  iteration against the metadata as it broadcasts (``_checked_iter``).
* :class:`LLMWeightSyncClient` — vLLM's four-method client protocol over an ``LLM``
  (``vllm/entrypoints/rl/offline.py``), whose methods take request dicts
  (``{"init_info": ...}``, ``{"update_info": ...}``) where the trainer engine passes
  the bare payloads.

vLLM is imported when a sync starts, never at import (it is optional). On a CPU the
tests run all of it with vLLM's real engines and a gloo stand-in for the NCCL
communicator (``tests/vllm_site/fp8rl_nccl_standin.py``); what only a GPU runs is
vLLM's ``PyNcclCommunicator`` and its CUDA streams.
"""

from __future__ import annotations

import functools
import importlib
import socket
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from fp8rl_core.config.pipeline import RolloutConfig
from stages.engines import weight_transfer as wt


@dataclass(frozen=True)
class NcclRendezvous:
    """The transfer group's meeting point and this trainer rank's place in it.

    ``host``/``port``: the TCP rendezvous trainer rank 0 listens on; ``workers``: the engine's
    workers in the group (ranks 1..workers); ``rank``/``world_size``/``group``: this trainer
    rank, the trainer's ranks and their process group (``None``: the default one)."""

    host: str
    port: int
    workers: int
    rank: int = 0
    world_size: int = 1
    group: Any = None

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port free on this machine now (the rendezvous binds it at the first sync)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def resolve_rendezvous(
    config: RolloutConfig, *, rank: int = 0, world_size: int = 1, group: Any = None
) -> NcclRendezvous:
    """``rollout.weight_sync_rendezvous`` for this trainer rank; a null port is picked by rank 0 and broadcast
    to the other ranks (a collective: every rank calls this)."""
    from fp8rl_core.config.pipeline import WeightSyncRendezvous

    section = config.weight_sync_rendezvous or WeightSyncRendezvous()
    port = section.port
    if port is None:
        port = free_port() if rank == 0 else 0
        if world_size > 1:
            import torch.distributed as dist

            box = [port]
            dist.broadcast_object_list(box, src=0, group=group)
            port = int(box[0])
    workers = section.group if section.group is not None else config.tensor_parallel_size
    return NcclRendezvous(section.host, port, workers, rank=rank, world_size=world_size, group=group)


def as_rendezvous(master: NcclRendezvous | tuple[str, int] | None, config: RolloutConfig) -> NcclRendezvous | None:
    """An ``(address, port)`` pair as a rendezvous of one trainer rank beside ``tensor_parallel_size`` workers."""
    if master is None or isinstance(master, NcclRendezvous):
        return master
    host, port = master
    return NcclRendezvous(str(host), int(port), config.tensor_parallel_size)


def weight_metadata(train_model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(HF name, global shape)`` of what :func:`~stages.engines.weight_transfer.stream_trainer_weights` yields,
    in its order, without gathering: a sharded ``DTensor`` reports its global shape."""
    return [(name, tuple(tensor.shape)) for name, tensor in wt.sent_state(train_model)]


@functools.cache
def _source_class() -> type:
    base = importlib.import_module("vllm.distributed.weight_transfer.base")

    class TrainerWeights(base.WeightSource):
        """The trainer's parameters in bf16, as vLLM's trainer engines read a source."""

        def __init__(self, model: nn.Module, device: str | torch.device | None) -> None:
            self.model, self.device = model, device

        def metadata(self) -> list:
            return [base.ParamMeta(name, torch.bfloat16, shape) for name, shape in weight_metadata(self.model)]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return wt.stream_trainer_weights(self.model, device=self.device)

    return TrainerWeights


def trainer_source(train_model: nn.Module, device: str | torch.device | None = None) -> Any:
    """vLLM's ``WeightSource`` over the trainer's model (bf16, one parameter gathered at a time, on ``device``;
    ``None``: where the trainer holds it)."""
    return _source_class()(train_model, device)


class LLMWeightSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an ``LLM``: its RL methods take request dicts."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None:
            self.llm.finish_weight_update()
        else:
            self.llm.finish_weight_update(weight_version)


class NcclSender:
    """This trainer rank's side of the transfer group, opened at the first sync and kept for the campaign."""

    def __init__(self, rendezvous: NcclRendezvous, client: Any, *, packed: bool = True) -> None:
        self.rendezvous, self.client, self.packed = rendezvous, client, packed
        self.engine: Any | None = None

    @property
    def is_sender(self) -> bool:
        return self.rendezvous.is_sender

    def send(self, train_model: nn.Module, check_names: Callable[[list[str]], None]) -> None:
        """One sync: every trainer rank calls it (under FSDP2 each parameter is an all-gather of all ranks)."""
        source = trainer_source(train_model)
        check_names([m.name for m in source.metadata()])  # from the metadata: nothing gathered
        if self.engine is None:
            nccl = importlib.import_module("vllm.distributed.weight_transfer.nccl_engine")
            rv = self.rendezvous
            info = nccl.NCCLTrainerInitInfo(
                **wt.nccl_trainer_init_kwargs(rank=rv.rank, master_address=rv.host, master_port=rv.port,
                                              workers=rv.workers),
                packed=self.packed,
            )
            self.engine = nccl.NCCLTrainerWeightTransferEngine.trainer_init(info, client=self.client, source=source)
        else:
            self.engine.source = source
        self.engine.send_weights()

    def barrier(self) -> None:
        """Hold every trainer rank until the sender is done: vLLM's ``send_weights`` returns on a non-sender
        as soon as it has iterated the source, while rank 0 still drives ``finish_weight_update`` (and a
        server's resume); a rank that generated then would sample from the old weights, or from a paused
        server."""
        if self.rendezvous.world_size > 1:
            import torch.distributed as dist

            dist.barrier(group=self.rendezvous.group)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
