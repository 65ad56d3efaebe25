"""Weight sync to a colocated engine: in-process, streamed per parameter in bf16, bounded memory.

* the trainer's weights go out one bf16 parameter at a time (a generator), the
  tied ``lm_head`` left out; under FSDP2 (two gloo ranks) each parameter is cast
  on its shard and all-gathered alone, and the stream equals the full model;
* the campaign hands the engine the sharded policy itself — no full fp32 state
  gathered on every rank before a sync;
* the peak extra memory of a sync is a function (``fp8rl plan`` prints it):
  one parameter, not the model;
* ``weight_sync: ipc`` with the engine in the trainer's process is refused in one line;
* the engine is built before the trainer's weights reach the device, and under
  torchrun the policy is sharded from the host (never moved whole).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as tmp

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.config.pipeline import RolloutConfig
from fp8rl_core.tasks.tiny_model import build_tiny_model
from stages.engines import weight_transfer as wt
from tests.scaleout_common import leave_rank, rendezvous


def test_stream_is_lazy_bf16_per_parameter_without_the_tied_head():
    model = build_tiny_model(ModelConfig())
    stream = wt.stream_trainer_weights(model)
    assert iter(stream) is stream  # a generator: nothing is copied before the engine asks
    sent = dict(stream)
    assert "lm_head.weight" not in sent and "model.embed_tokens.weight" in sent
    state = model.state_dict()
    for name, t in sent.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, state[name].to(torch.bfloat16))


def _rank_main(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from stages.engines.hf_engine import full_view
    from stages.trainer.distributed import shard_policy

    os.environ.update(RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    try:
        full = build_tiny_model(ModelConfig()).state_dict()
        policy = shard_policy(build_tiny_model(ModelConfig()))
        gathers = []
        real = DTensor.full_tensor
        DTensor.full_tensor = lambda self, **kw: gathers.append(1) or real(self, **kw)
        stream = wt.stream_trainer_weights(policy)
        first_name, first = next(stream)
        after_first = len(gathers)
        rest = dict(stream)
        DTensor.full_tensor = real
        sent = {first_name: first, **rest}
        hf_state = full_view(policy).state_dict()
        out = {
            "after_first": after_first,
            "stream_equal": all(torch.equal(t, full[n].to(torch.bfloat16)) for n, t in sent.items()),
            "all_bf16": all(t.dtype == torch.bfloat16 for t in sent.values()),
            "names": sorted(sent),
            "hf_view_equal": all(torch.equal(hf_state[n], full[n]) for n in full if n != "lm_head.weight"),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()  # no rank tears down while its peer is still inside a collective
    finally:
        dist.destroy_process_group()
    leave_rank()


@pytest.mark.timeout(240)
def test_sharded_stream_gathers_one_parameter_at_a_time(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tmp.spawn(_rank_main, args=(rendezvous(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert out["after_first"] == 1, "more than one parameter gathered before the engine took the first"
        assert out["stream_equal"] and out["all_bf16"] and "lm_head.weight" not in out["names"]
        assert out["hf_view_equal"]


def test_campaign_sync_hands_the_engine_the_sharded_policy_not_a_full_state(monkeypatch):
    from stages.engines.base import RolloutEngine
    from stages.rollout import sync_engine

    received = []

    class Recording(RolloutEngine):
        def generate(self, prompt_ids, request):
            raise AssertionError("no generation in a sync")

        def load_weights(self, train_model):
            received.append(train_model)

    engine = Recording()
    policy = build_tiny_model(ModelConfig())
    env = SimpleNamespace(world_size=2, engine=engine)
    state = SimpleNamespace(policy=policy, policy_version=3)
    sync_engine(env, state, before_stage=True)
    sync_engine(env, state, before_stage=True)  # the same version again: no second push
    assert received == [policy] and engine.policy_version == 3


def test_sync_peak_is_one_parameter_not_the_model():
    from flows.plan.memory import ARCHITECTURES, total_params

    a = ARCHITECTURES["Qwen/Qwen3-8B"]
    sizes = dict(largest_param=a.vocab * a.hidden, largest_layer=2 * a.hidden * a.intermediate, total=total_params(a))
    streamed = wt.sync_peak_bytes(**sizes, world_size=8, weight_sync="tensors", quantized=True)
    old = wt.sync_peak_bytes(**sizes, world_size=8, weight_sync="full_fp32", quantized=True)
    assert streamed < 2.5 * 2**30 and old > 30 * 2**30  # the old sync: the whole fp32 model on every GPU
    model = build_tiny_model(ModelConfig())
    tiny = wt.model_sync_peak_bytes(model, world_size=1, weight_sync="tensors", quantized=False)
    largest = max(p.numel() for p in model.parameters())
    assert tiny == 2 * 2 * largest  # the largest parameter in bf16, gathered, and its (here: whole) shard
    with pytest.raises(ValueError, match="weight_sync"):
        wt.sync_peak_bytes(**sizes, world_size=8, weight_sync="iterator", quantized=False)


def test_plan_prints_the_sync_peak():
    from conftest import micro_config

    from flows.plan.memory import format_plan, memory_plan

    cfg = micro_config("rollout.engine=vllm", "rollout.vllm_process=trainer", "rollout.weight_sync=tensors")
    text = format_plan(cfg, memory_plan(cfg, gpus=2, gpu_memory_gib=80.0), gpus=2, gpu_memory_gib=80.0)
    assert "weight sync peak" in text


def test_ipc_with_the_engine_in_the_trainers_process_is_refused_in_one_line():
    from flows.campaign.configuration import load_config
    from stages.engines.vllm_engine import VLLMEngine
    from stages.engines.vllm_options import VLLMHooks, VLLMSettings

    with pytest.raises(ValueError, match="weight_sync: ipc") as err:
        load_config("tiny-cpu", ["rollout.engine=vllm", "rollout.weight_sync=ipc"])
    assert "use weight_sync: tensors" in str(err.value)
    assert RolloutConfig(engine="vllm", vllm_process="separate", weight_sync="ipc").weight_sync == "ipc"
    never = SimpleNamespace(LLM=lambda **kw: pytest.fail("the engine was built before the refusal"))
    with pytest.raises(ValueError, match="trainer's process"):
        VLLMEngine(
            model=build_tiny_model(ModelConfig()),
            tokenizer=None,
            precision=PrecisionConfig(),
            config=RolloutConfig(),
            model_path="/nowhere",
            settings=VLLMSettings(weight_sync="ipc"),
            hooks=VLLMHooks(vllm_module=never),
        )


@pytest.mark.parametrize("world_size", [1, 2])
def test_engine_is_built_before_the_policy_reaches_the_device(world_size, tmp_path, monkeypatch):
    """vLLM's start-up check needs the device free: build it first; under torchrun shard from the host."""
    from conftest import micro_config

    import stages.context as context
    import stages.engines as engines
    import stages.trainer.distributed as distributed
    from flows.campaign.configuration import dump_config
    from fp8rl_core.tasks.tiny_model import build_tokenizer
    from storage.run.layout import create_run

    base = tmp_path / "base"
    build_tiny_model(ModelConfig()).save_pretrained(base)
    build_tokenizer().save_pretrained(base)
    cfg = micro_config(f"model.path={base}", "rollout.engine=vllm")
    create_run(tmp_path, "r", config=dump_config(cfg))
    events = []
    import fp8rl_core.tasks.tiny_model as tiny

    real_load = tiny.load_policy

    def load_and_watch(path):
        policy, tok = real_load(path)
        real_to = policy.to
        policy.to = lambda *a, **k: events.append("policy.to") or real_to(*a, **k)
        return policy, tok

    monkeypatch.setattr(tiny, "load_policy", load_and_watch)
    fake_engine = SimpleNamespace(close=lambda: None)
    monkeypatch.setattr(engines, "make_engine", lambda *a, **k: events.append("engine") or fake_engine)
    monkeypatch.setattr(distributed, "shard_policy", lambda policy, *a, **k: events.append("shard") or policy)
    monkeypatch.setattr(context, "_base_model_rank0_first", lambda *a: base)
    env, _ = context.open_run(cfg, tmp_path / "r", world_size=world_size)
    assert events == (["engine", "policy.to"] if world_size == 1 else ["engine", "shard"]), events
