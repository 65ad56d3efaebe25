"""The trainer's side of ``weight_sync: nccl``, against a stand-in for vLLM 0.32's NCCL transfer engine.

NCCL needs GPUs; what runs here is everything the project does around it. The stand-in
keeps the rules of ``vllm/distributed/weight_transfer/nccl_engine.py`` (0.32.0):
``NCCLTrainerInitInfo`` takes ``rank`` by keyword and ``master_address``, ``master_port``,
``world_size``, ``packed`` (unknown fields are a TypeError, as for the real dataclass);
``trainer_init`` refuses a missing ``WeightSource`` and, on the sender, asks the engine to
open its side of the group (workers from rank 1 of a ``1 + TP`` group) before it returns;
``send_weights`` drives ``start_weight_update``, ``update_weights`` and
``finish_weight_update`` over the source's parameters; ``shutdown`` tears the group down.
"""

from __future__ import annotations

import sys
import types
from dataclasses import KW_ONLY, dataclass

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(60)


@dataclass
class _InitInfo:
    _: KW_ONLY
    rank: int
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class _ModuleSource:
    def __init__(self, module: nn.Module) -> None:
        self.module = module


class _TrainerEngine:
    made: list["_TrainerEngine"] = []

    @classmethod
    def trainer_init(cls, init_info: _InitInfo, *, client, source: _ModuleSource | None = None):
        if source is None:
            raise ValueError("NCCL trainer weight transfer requires a WeightSource.")
        engine = cls()
        engine.client, engine.source, engine.info, engine.group_open = client, source, init_info, True
        client.init_weight_transfer_engine(
            {"master_address": init_info.master_address, "master_port": init_info.master_port,
             "rank_offset": 1, "world_size": init_info.world_size}
        )  # fmt: skip
        cls.made.append(engine)
        return engine

    def send_weights(self) -> None:
        if not self.group_open:
            raise RuntimeError("send_weights after shutdown")
        self.client.start_weight_update()
        self.client.update_weights({"names": [n for n, _ in self.source.module.named_parameters()]})
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group_open = False


class _Client:
    """The engine side as the trainer sees it: what it was asked, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def __getattr__(self, name: str):
        return lambda payload=None: self.calls.append((name, payload))


@pytest.fixture
def standin(monkeypatch):
    _TrainerEngine.made = []
    pkg = "vllm.distributed.weight_transfer"
    nccl = types.ModuleType(f"{pkg}.nccl_engine")
    nccl.NCCLTrainerInitInfo, nccl.NCCLTrainerWeightTransferEngine = _InitInfo, _TrainerEngine
    base = types.ModuleType(f"{pkg}.base")
    base.ModuleSource = _ModuleSource
    for name, mod in ((f"{pkg}.nccl_engine", nccl), (f"{pkg}.base", base)):
        monkeypatch.setitem(sys.modules, name, mod)
    return _TrainerEngine


def _options(tp: int):
    from stages.engines.vllm_sync import TransportOptions
    from tests.conftest import micro_config

    rollout = micro_config().rollout.model_copy(update={"tensor_parallel_size": tp})
    return TransportOptions(config=rollout, precision_mode="bf16", nccl_master=("10.0.0.7", 29611))


def test_the_group_is_opened_once_every_sync_sends_every_weight_and_close_tears_it_down(standin):
    from stages.engines.vllm_sync import NcclTransport, SentNames

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    client, names = _Client(), SentNames()
    transport = NcclTransport(_options(tp=2))
    transport.send(client, model, names)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    transport.send(client, model, names)
    (engine,) = standin.made  # one rendezvous for the campaign, not one per sync
    assert engine.info == _InitInfo(rank=0, master_address="10.0.0.7", master_port=29611, world_size=3)
    assert [c for c, _ in client.calls] == ["init_weight_transfer_engine"] + 2 * [
        "start_weight_update", "update_weights", "finish_weight_update"
    ]  # fmt: skip
    assert client.calls[2][1] == {"names": ["0.weight", "0.bias", "1.weight", "1.bias"]}
    transport.close()
    assert not engine.group_open and transport.sender is None
    transport.close()  # twice: nothing left to tear down


def test_a_sync_whose_parameters_changed_is_refused_before_anything_is_sent(standin):
    from stages.engines.vllm_sync import NcclTransport, SentNames

    client, names = _Client(), SentNames()
    transport = NcclTransport(_options(tp=1))
    transport.send(client, nn.Linear(4, 4), names)
    sent = len(client.calls)
    with pytest.raises(RuntimeError, match="parameters changed since the first sync"):
        transport.send(client, nn.Sequential(nn.Linear(4, 4)), names)
    assert len(client.calls) == sent
    assert standin.made[0].info.world_size == 2
