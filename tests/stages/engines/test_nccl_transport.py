"""``weight_sync: nccl`` in the main venv: the config, the refusals, and the trainer's side against a stand-in.

The stand-in keeps the rules of vLLM 0.32.0's ``vllm/distributed/weight_transfer``
(``nccl_engine.py``, ``base.py``): ``NCCLTrainerInitInfo`` takes ``rank`` by keyword
(unknown fields are a TypeError, as for the real dataclass) and rank 0 is the sender;
``trainer_init`` refuses a missing ``WeightSource`` and, on the sender only, asks the
engine to open its side of the group (workers from rank 1 of ``world_size``) before it
returns; ``send_weights`` reads ``source.metadata()`` (no gather), and on the sender
drives ``start_weight_update``, ``update_weights`` (names, dtype names, shapes) and
``finish_weight_update`` around one pass over the source, checked against the metadata;
a non-sender only iterates the source; ``shutdown`` tears the group down. vLLM's real
engines run in tests/stages/engines/test_nccl_sync.py.
"""

from __future__ import annotations

import sys
import types
from dataclasses import KW_ONLY, dataclass

import pytest
import torch
from torch import nn

from fp8rl_core.config.model import ModelConfig
from fp8rl_core.tasks.tiny_model import build_tiny_model

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


@dataclass(frozen=True)
class _ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class _WeightSource:
    pass


class _TrainerEngine:
    made: list["_TrainerEngine"] = []

    @classmethod
    def trainer_init(cls, init_info: _InitInfo, *, client, source=None):
        if source is None:
            raise ValueError("NCCL trainer weight transfer requires a WeightSource.")
        engine = cls()
        engine.client, engine.source, engine.info, engine.group_open = client, source, init_info, init_info.is_sender
        cls.made.append(engine)
        if init_info.is_sender:
            client.init_weight_transfer_engine(
                {"master_address": init_info.master_address, "master_port": init_info.master_port,
                 "rank_offset": 1, "world_size": init_info.world_size, "packed": init_info.packed}
            )  # fmt: skip
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.info.is_sender:
            for _ in self.source:
                pass
            return
        if not self.group_open:
            raise RuntimeError("send_weights after shutdown")
        self.client.start_weight_update()
        self.client.update_weights({"names": [m.name for m in meta],
                                    "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                                    "shapes": [list(m.shape) for m in meta]})  # fmt: skip
        sent = list(self.source)
        assert [(n, t.dtype, tuple(t.shape)) for n, t in sent] == [(m.name, m.dtype, m.shape) for m in meta]
        self.sent = sent
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
    import stages.engines.nccl_sync as nccl_sync

    _TrainerEngine.made = []
    pkg = "vllm.distributed.weight_transfer"
    nccl = types.ModuleType(f"{pkg}.nccl_engine")
    nccl.NCCLTrainerInitInfo, nccl.NCCLTrainerWeightTransferEngine = _InitInfo, _TrainerEngine
    base = types.ModuleType(f"{pkg}.base")
    base.WeightSource, base.ParamMeta = _WeightSource, _ParamMeta
    for name, mod in ((f"{pkg}.nccl_engine", nccl), (f"{pkg}.base", base)):
        monkeypatch.setitem(sys.modules, name, mod)
    nccl_sync._source_class.cache_clear()
    yield _TrainerEngine
    nccl_sync._source_class.cache_clear()


def _options(tp: int, rank: int = 0, world_size: int = 1):
    from stages.engines.nccl_sync import NcclRendezvous
    from stages.engines.vllm_sync import TransportOptions
    from tests.conftest import micro_config

    rollout = micro_config().rollout.model_copy(update={"tensor_parallel_size": tp})
    return TransportOptions(config=rollout, precision_mode="bf16",
                            nccl_master=NcclRendezvous("10.0.0.7", 29611, tp, rank=rank, world_size=world_size))


class _LLM:
    """``vllm.LLM``'s RL methods as ``entrypoints/rl/offline.py`` defines them: request dicts in."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def init_weight_transfer_engine(self, request):
        self.calls.append(("init", request["init_info"]))

    def start_weight_update(self):
        self.calls.append(("start", None))

    def update_weights(self, request):
        self.calls.append(("update", request["update_info"]))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


def test_one_rendezvous_every_sync_sends_bf16_from_one_pass_without_the_tied_head(standin, monkeypatch):
    from stages.engines import weight_transfer as wt
    from stages.engines.vllm_sync import NcclTransport, SentNames

    model = build_tiny_model(ModelConfig())  # tied: lm_head is the embedding, never sent
    llm, names = _LLM(), SentNames()
    passes = []
    real = wt.stream_trainer_weights
    monkeypatch.setattr(wt, "stream_trainer_weights", lambda *a, **k: passes.append(1) or real(*a, **k))
    transport = NcclTransport(_options(tp=2))
    transport.send(llm, model, names)
    assert len(passes) == 1  # the names come from the metadata: no gather to check them
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(1.0)
    transport.send(llm, model, names)
    assert len(passes) == 2  # one pass per sync
    (engine,) = standin.made  # one rendezvous for the campaign, not one per sync
    assert engine.info == _InitInfo(rank=0, master_address="10.0.0.7", master_port=29611, world_size=3)
    # the LLM's methods take request dicts: the adapter wraps vLLM's bare payloads
    assert [c for c, _ in llm.calls] == ["init"] + 2 * ["start", "update", "finish"]
    assert llm.calls[0][1]["world_size"] == 3 and llm.calls[0][1]["rank_offset"] == 1
    update = llm.calls[2][1]
    state = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}
    assert update["names"] == list(state) and set(update["dtype_names"]) == {"bfloat16"}
    assert [n for n, _ in engine.sent] == list(state)
    assert all(torch.equal(t, state[n].to(torch.bfloat16)) for n, t in engine.sent)  # the second sync's weights
    transport.close()
    assert not engine.group_open and transport.sender is None
    transport.close()  # twice: nothing left to tear down


def test_a_rank_other_than_0_joins_no_group_and_only_iterates(standin):
    from stages.engines.vllm_sync import NcclTransport, SentNames

    model, llm = nn.Linear(4, 4), _LLM()
    transport = NcclTransport(_options(tp=1, rank=1, world_size=1))
    transport.send(llm, model, SentNames())
    (engine,) = standin.made
    assert engine.info.rank == 1 and not engine.info.is_sender and llm.calls == []


def test_a_sync_whose_parameters_changed_is_refused_before_anything_is_sent(standin):
    from stages.engines.vllm_sync import NcclTransport, SentNames

    llm, names = _LLM(), SentNames()
    transport = NcclTransport(_options(tp=1))
    transport.send(llm, nn.Linear(4, 4), names)
    sent = len(llm.calls)
    with pytest.raises(RuntimeError, match="parameters changed since the first sync"):
        transport.send(llm, nn.Sequential(nn.Linear(4, 4)), names)
    assert len(llm.calls) == sent
    assert standin.made[0].info.world_size == 2


def test_the_metadata_is_the_global_shapes_in_stream_order_without_compile_prefixes():
    from stages.engines import weight_transfer as wt
    from stages.engines.nccl_sync import weight_metadata

    model = build_tiny_model(ModelConfig())
    wrapped = nn.Module()
    wrapped._orig_mod = model  # what torch.compile's wrapper adds to every name
    wrapped.config = model.config
    meta = weight_metadata(wrapped)
    assert meta == [(n, tuple(t.shape)) for n, t in wt.stream_trainer_weights(model)]
    assert "lm_head.weight" not in dict(meta)


# ------------------------------------------------------------------------------------- the config
NCCL_SEPARATE = ["rollout.engine=vllm", "rollout.vllm_process=separate", "rollout.weight_sync=nccl"]


def test_the_rendezvous_section_is_read_and_handed_to_the_engine(monkeypatch, tmp_path):
    import stages.engines as engines
    from flows.campaign.configuration import load_config
    from stages.context import _make_rollout_engine
    from stages.engines.nccl_sync import NcclRendezvous

    cfg = load_config("tiny-cpu", NCCL_SEPARATE + ["rollout.weight_sync_rendezvous={host: 10.1.2.3, port: 29400}"])
    seen = {}
    monkeypatch.setattr(engines, "make_engine", lambda name, **kw: seen.update(kw, name=name) or "engine")
    _make_rollout_engine(cfg, None, None, tmp_path)
    assert seen["nccl_master"] == NcclRendezvous("10.1.2.3", 29400, 1) and seen["model_path"] == str(tmp_path)
    http = load_config("tiny-cpu", ["rollout.engine=vllm_http", "rollout.server_url=http://h:8000",
                                    "rollout.weight_sync_rendezvous={group: 4}"])  # fmt: skip
    _make_rollout_engine(http, None, None, tmp_path)  # port null: one picked free, group: the server's workers
    rv = seen["nccl_master"]
    assert (seen["name"], rv.host, rv.workers, rv.is_sender) == ("vllm_http", "127.0.0.1", 4, True)
    assert 0 < rv.port < 65536


@pytest.mark.parametrize(
    "sets, says",
    [
        (["rollout.weight_sync=nccl"], "the transformers engine copies the policy in the trainer's process"),
        (["rollout.engine=vllm", "rollout.weight_sync=nccl"], "NCCL cannot group a process with itself"),
        (["rollout.engine=vllm_http", "rollout.weight_sync=path"], "by nccl only"),
        (["rollout.engine=vllm", "rollout.weight_sync_rendezvous={port: 29400}"], "the rendezvous is for"),
        (NCCL_SEPARATE + ["rollout.weight_sync_rendezvous={group: 2}"], "tensor_parallel_size=1"),
        (NCCL_SEPARATE + ["rollout.weight_sync_rendezvous={port: 70000}"], "rollout.weight_sync_rendezvous.port"),
        (NCCL_SEPARATE + ["rollout.weight_sync_rendezvous={hots: x}"], "weight_sync_rendezvous.hots: unknown key"),
    ],
)
def test_a_sync_the_engine_cannot_take_is_refused_in_one_line_at_load(sets, says, tmp_path):
    from integrity_helpers import cli, one_line_exit_2

    from flows.campaign.configuration import ConfigError, load_config

    with pytest.raises(ConfigError, match="rollout") as err:
        load_config("tiny-cpu", sets)
    assert says in str(err.value) and "\n" not in str(err.value)
    args = [a for s in sets for a in ("--set", s)]
    one_line_exit_2(cli("run", "tiny-cpu", *args, "--run-dir", tmp_path / "run"), says)
    assert list(tmp_path.iterdir()) == []


def test_several_trainer_ranks_each_with_a_vllm_engine_synced_by_nccl_are_refused(tmp_path, monkeypatch):
    from integrity_helpers import cli, one_line_exit_2

    import flows.commands.run as cc

    monkeypatch.setattr(cc, "_run_flow", lambda *a, **k: pytest.fail("the campaign started"))
    args = [a for s in NCCL_SEPARATE + ["algorithm.micro_batch_size=128"] for a in ("--set", s)]
    r = cli("run", "tiny-cpu", *args, "--nproc-per-node", "2", "--run-dir", tmp_path / "run")
    one_line_exit_2(r, "on 2 trainer ranks", "use rollout.engine: vllm_http")
    assert list(tmp_path.iterdir()) == []
    from stages.engines.nccl_sync import NcclRendezvous
    from stages.engines.vllm_options import check_engine_options

    with pytest.raises(ValueError, match="one sender"):  # and the engine, made some other way
        check_engine_options("processed", 1, "nccl", "first", False, NcclRendezvous("h", 1, 1, rank=1, world_size=2))
    with pytest.raises(ValueError, match="NCCL cannot group a process with itself"):  # in the trainer's process
        check_engine_options("processed", 1, "nccl", "first", True, NcclRendezvous("h", 1, 1))


def test_the_http_engine_pauses_sends_and_resumes_on_rank_0_only(standin, monkeypatch):
    import torch.distributed as dist

    from fp8rl_core.config.method import PrecisionConfig
    from fp8rl_core.config.pipeline import RolloutConfig
    from stages.engines.http_engine import VLLMHTTPEngine
    from stages.engines.nccl_sync import NcclRendezvous

    barriers = []
    monkeypatch.setattr(dist, "barrier", lambda group=None: barriers.append(group))
    cfg = RolloutConfig(engine="vllm_http", server_url="http://127.0.0.1:9")
    calls = {}
    for rank in (0, 1):
        engine = VLLMHTTPEngine(model=nn.Linear(2, 2), tokenizer=None, precision=PrecisionConfig(), config=cfg,
                                nccl_master=NcclRendezvous("h", 1, 1, rank=rank, world_size=2, group="trainers"))
        engine.weights = client = _Client()  # the server's routes
        engine.load_weights(nn.Linear(2, 2))
        engine.load_weights(nn.Linear(2, 2))
        calls[rank] = [c for c, _ in client.calls]
        engine.close()
    sync = ["start_weight_update", "update_weights", "finish_weight_update"]
    assert calls[0] == ["pause", "init_weight_transfer_engine", *sync, "resume", "pause", *sync, "resume"]
    assert calls[1] == [] and barriers == ["trainers"] * 4  # every rank waits for rank 0 after every sync
    assert [e.group_open for e in standin.made] == [False, False]  # close tore the group down
    with pytest.raises(ValueError, match="needs nccl_master"):
        VLLMHTTPEngine(model=nn.Linear(2, 2), tokenizer=None, precision=PrecisionConfig(), config=cfg).load_weights(
            nn.Linear(2, 2)
        )


@pytest.mark.parametrize("extension", [True, False])
def test_a_tied_policy_has_the_server_reprocess_its_head_before_it_resumes(standin, extension, caplog):
    """vLLM's CPU build keeps a private copy of a tied head that an update leaves stale: after each sync of
    a tied policy rank 0 asks the server for our worker extension's method, before the server resumes. A
    server without the extension (``False``) is named once in the log and not asked again."""
    import logging
    from types import SimpleNamespace

    from fp8rl_core.config.method import PrecisionConfig
    from fp8rl_core.config.pipeline import RolloutConfig
    from stages.engines.http_engine import VLLMHTTPEngine
    from stages.engines.nccl_sync import NcclRendezvous

    class Server(_Client):
        def repack_tied_head(self) -> bool:
            self.calls.append(("repack_tied_head", None))
            return extension

    tied = nn.Linear(2, 2)
    tied.config = SimpleNamespace(tie_word_embeddings=True)
    cfg = RolloutConfig(engine="vllm_http", server_url="http://127.0.0.1:9")
    engine = VLLMHTTPEngine(model=tied, tokenizer=None, precision=PrecisionConfig(), config=cfg,
                            nccl_master=NcclRendezvous("h", 1, 1))
    engine.weights = server = Server()
    with caplog.at_level(logging.WARNING, logger="stages.engines.http_engine"):
        engine.load_weights(tied)
        engine.load_weights(tied)
    engine.close()
    calls = [c for c, _ in server.calls]
    assert calls.count("repack_tied_head") == (2 if extension else 1)
    assert calls.index("repack_tied_head") == calls.index("finish_weight_update") + 1 == calls.index("resume") - 1
    warned = [r.getMessage() for r in caplog.records if "worker extension" in r.getMessage()]
    assert len(warned) == (0 if extension else 1) and all("--worker-extension-cls" in w for w in warned)


def test_a_null_port_is_picked_by_rank_0_and_told_to_the_others(monkeypatch):
    import torch.distributed as dist

    from fp8rl_core.config.pipeline import RolloutConfig
    from stages.engines.nccl_sync import LLMWeightSyncClient, as_rendezvous, resolve_rendezvous

    told = []

    def broadcast(box, src, group):
        told.append((list(box), src, group))
        box[0] = 29777

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    cfg = RolloutConfig(tensor_parallel_size=2)
    rv = resolve_rendezvous(cfg, rank=1, world_size=2, group="g")
    assert (rv.port, rv.workers, rv.rank, rv.is_sender) == (29777, 2, 1, False) and told == [([0], 0, "g")]
    assert resolve_rendezvous(cfg).port > 0 and as_rendezvous(("h", 5), cfg).workers == 2
    llm = _LLM()
    LLMWeightSyncClient(llm).finish_weight_update("v3")
    assert llm.calls == [("finish", "v3")]


def test_the_memory_plan_counts_vllms_packed_buffers_for_the_nccl_sync():
    from flows.plan.memory import ARCHITECTURES, total_params
    from stages.engines import weight_transfer as wt

    a = ARCHITECTURES["Qwen/Qwen3-8B"]
    sizes = dict(largest_param=a.vocab * a.hidden, largest_layer=2 * a.hidden * a.intermediate, total=total_params(a))
    nccl = wt.sync_peak_bytes(**sizes, world_size=8, weight_sync="nccl", quantized=True)
    chunk = wt.PACKED_BUFFER_BYTES + 2 * a.vocab * a.hidden  # a buffer's worth, then the tensor that crosses it
    assert nccl == 2 * -(-a.vocab * a.hidden // 8) + 3 * chunk  # one in flight, the next's tensors, their copy
    tiny = wt.sync_peak_bytes(largest_param=10, largest_layer=10, total=100, world_size=1, weight_sync="nccl",
                              quantized=False)  # fmt: skip
    assert tiny == 2 * 10 + 2 * 2 * 100  # one chunk: the model's bf16 tensors and their packed copy
