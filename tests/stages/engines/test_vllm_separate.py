"""``rollout.vllm_process: separate`` under several ranks: each rank's engine is a whole vLLM in its own
processes, started outside the torchrun job, and a ``path`` sync is written once per node.

The real-vLLM campaign of this is in ``tests/flows/campaign/test_vllm_campaign.py``; these are the parts that need no
vLLM: the environment the engine starts in, the engine layout, the refusal, and the path transport on
two gloo ranks with an engine that records what it is asked to read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fp8rl_core.config.model import ModelConfig
from fp8rl_core.config.pipeline import RolloutConfig
from fp8rl_core.tasks.tiny_model import build_tiny_model
from stages.engines import vllm_options as vo
from stages.engines import vllm_sync as vs
from tests.scaleout_common import leave_rank, rendezvous

pytestmark = pytest.mark.timeout(120)

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


def test_the_engine_starts_without_torchruns_variables_and_gets_them_back(monkeypatch):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    with vo.own_engine_environment(world_size=2, local_rank=1, tensor_parallel_size=2, cuda=False):
        seen = {name: os.environ.get(name) for name in TORCHRUN}
    assert seen == dict.fromkeys(TORCHRUN), "the engine's processes would believe they are a torchrun rank"
    assert {name: os.environ[name] for name in TORCHRUN} == TORCHRUN


def test_on_a_gpu_the_engine_sees_its_ranks_device_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with vo.own_engine_environment(world_size=4, local_rank=2, tensor_parallel_size=1, cuda=True):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with vo.own_engine_environment(world_size=4, local_rank=1, tensor_parallel_size=1, cuda=True):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with pytest.raises(ValueError, match="tensor_parallel_size=2 would put 2 workers on it") as err:
        with vo.own_engine_environment(world_size=4, local_rank=1, tensor_parallel_size=2, cuda=True):
            pass
    assert "\n" not in str(err.value)


def test_one_rank_changes_nothing(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with vo.own_engine_environment(world_size=1, local_rank=0, tensor_parallel_size=2, cuda=True):
        assert os.environ["RANK"] == "0"


def test_separate_engines_are_not_part_of_the_torchrun_job():
    from stages.runtime.rollout_plan import engine_layout

    separate = RolloutConfig(engine="vllm", vllm_process="separate", weight_sync="path", tensor_parallel_size=2)
    assert vo.spmd_llm_options(separate, rank=1, world_size=4, in_process=False) == {}
    assert engine_layout(separate, 4).engines == 4 and engine_layout(separate, 4).ranks_per_engine == 1
    inside = RolloutConfig(engine="vllm", tensor_parallel_size=2)
    assert vo.spmd_llm_options(inside, rank=1, world_size=4)["distributed_executor_backend"] == "external_launcher"
    assert engine_layout(inside, 4).engines == 2


def test_shared_tp_with_a_separate_engine_is_refused_in_one_line():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="every rank owns a whole engine: use per_rank") as err:
        RolloutConfig(engine="vllm", vllm_process="separate", weight_sync="path", data_parallel="shared_tp")
    assert str(err.value).count("use per_rank") == 1


class ReadingEngine:
    """The two ``collective_rpc`` calls a path sync makes, recorded."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_weights"
        folder = Path(kwargs["weights_path"])
        files = sorted(p.name for p in folder.iterdir())
        assert files == ["model.safetensors"], f"the engine found {files} in {folder}"
        self.read.append(str(folder))


def _path_rank(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", GROUP_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    try:
        writes: list[int] = []
        real = vs.wt.write_bf16_safetensors
        vs.wt.write_bf16_safetensors = lambda weights, folder: writes.append(len(weights)) or real(weights, folder)
        transport = vs.make_transport("path", vs.TransportOptions(config=RolloutConfig(), precision_mode="bf16"))
        engine, names = ReadingEngine(), vs.SentNames()
        policy = build_tiny_model(ModelConfig())
        for _ in range(2):
            transport.send(engine, policy, names)
        out = {"writes": writes, "read": engine.read, "names": len(names.first or [])}
        dist.barrier()  # both ranks have read before the writer removes the folder
        transport.close()
        out["left"] = Path(engine.read[0]).exists()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_rank()


def test_a_path_sync_is_written_once_per_node_and_read_by_every_ranks_engine(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    import torch.multiprocessing as tmp

    tmp.spawn(_path_rank, args=(rendezvous(), str(tmp_path)), nprocs=2, join=True)  # fresh interpreters
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    params = len([n for n in build_tiny_model(ModelConfig()).state_dict() if n != "lm_head.weight"])
    assert ranks[0]["writes"] == [params, params], "local rank 0 writes the whole model at every sync"
    assert ranks[1]["writes"] == [], "a second rank of the node wrote the weights again"
    assert ranks[0]["read"] == ranks[1]["read"] and len(set(ranks[0]["read"])) == 1
    assert ranks[0]["names"] == ranks[1]["names"] == params, "every rank checks the names it joined the gathers of"
    assert not ranks[0]["left"], "the writer removes the node's folder when the engine closes"


def test_the_rollout_side_overlaps_training_when_the_engine_generates_apart():
    """vLLM in its own engine process (or behind a server) generates apart from the trainer: with
    ``max_staleness`` ≥ 1 its rollout side runs beside training, in one process only, and ``train_logp`` is
    NULL there (the rows may be sampled while the trainer updates, so no trainer weights of their version
    are at hand)."""
    from types import SimpleNamespace

    from stages.rollout import sampling_train_logp
    from stages.rollout_side import overlaps

    def env(k=1, overlap=True, world=1, apart=True, copy=False):
        rollout = SimpleNamespace(max_staleness=k, overlap=overlap)
        engine = SimpleNamespace(holds_trainer_copy=copy, computes_apart=apart)
        return SimpleNamespace(cfg=SimpleNamespace(rollout=rollout), engine=engine, world_size=world)

    assert overlaps(env())
    assert not overlaps(env(k=0)) and not overlaps(env(overlap=False)) and not overlaps(env(world=2))
    assert not overlaps(env(apart=False)), "an engine in the trainer's process cannot generate beside training"
    assert overlaps(env(apart=False, copy=True))  # the transformers engine moved to a worker
    assert sampling_train_logp(env(), state=None, rows=None) is None
