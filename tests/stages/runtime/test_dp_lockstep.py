"""Data-parallel lockstep: every rank calls its engine equally often, and evaluation runs on every rank.

Under torchrun, vLLM's data-parallel replicas (``external_launcher``,
``data_parallel_size = W``) synchronize at every engine step, so a rank that
calls ``generate`` while another does not waits for ever. The CPU build of vLLM
is not used here: these tests run two gloo ranks over the stand-in
(tests/vllm_standin.py), whose ``generate`` models the DP synchronization per
call and, unlike vLLM, times out (``LOCKSTEP_TIMEOUT_S``) — so the defect shows
as a failure within seconds instead of a hang.

* a rollout of 3 blocks on 2 ranks: rank 1 has one block, rank 0 two; rank 1
  makes a padding call, both make two calls, and the samples equal the
  one-process samples;
* evaluation: both ranks generate their blocks (padded alike) and the gathered
  batch equals the one-process batch;
* the model itself: rank 0 calling ``generate`` alone (what evaluating on
  rank 0 only did) fails within seconds.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as tmp

from fp8rl_core.config.method import AlgorithmConfig, PrecisionConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.config.pipeline import BenchmarkEval, RolloutConfig
from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer
from tests.scaleout_common import leave_rank

PROMPTS = [[1, 40, 41], [1, 50], [1, 60, 61, 62], [1, 70], [1, 80, 81], [1, 90, 91, 92]]
ROLLOUT = dict(  # the replicas of the trainer's processes (external launcher); no sync runs here
    engine="vllm",
    vllm_process="trainer",
    weight_sync="tensors",
    verify_sync="never",
    sleep_between_steps=False,
    samples_per_prompt=2,
    generation_batch_size=4,
    max_new_tokens=4,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(model_dir: str):
    from stages.engines.vllm_engine import VLLMEngine
    from stages.engines.vllm_options import VLLMHooks
    from tests.vllm_standin import make_standin_module

    policy = build_tiny_model(ModelConfig())
    return VLLMEngine(
        model=policy,
        tokenizer=build_tokenizer(),
        precision=PrecisionConfig(rollout="bf16"),
        config=RolloutConfig(**ROLLOUT),
        model_path=model_dir,
        hooks=VLLMHooks(vllm_module=make_standin_module()),
    )


def _work(engine, rank: int, world: int) -> dict:
    from stages.evaluate import generate_eval_share
    from stages.rollout import RolloutPlan, generate_share
    from stages.runtime.rollout_plan import generation_blocks

    cfg = SimpleNamespace(rollout=RolloutConfig(**ROLLOUT), algorithm=AlgorithmConfig())
    env = SimpleNamespace(cfg=cfg, engine=engine, rank=rank, world_size=world)
    state = SimpleNamespace(policy_version=0)
    engine.policy_version = 0  # weights current: no sync
    blocks = generation_blocks(
        [len(p) for p in PROMPTS], group_size=2, generation_batch_size=4, seed=1, step=1, round_=0
    )
    plan = RolloutPlan(items=[None] * len(PROMPTS), prompt_ids=PROMPTS, blocks=blocks)
    share = generate_share(env, state, plan, rank=rank, lanes=world)
    bench = BenchmarkEval(name="synthetic", k=2, max_new_tokens=4)
    eval_share = generate_eval_share(env, state, PROMPTS, blocks, bench)
    as_rows = lambda sh: {k: [s.response_ids for s in b.samples] for k, b in sh.items()}  # noqa: E731
    calls = sum(1 for c in engine.llm.calls if c[0] == "generate")
    return {"blocks": len(blocks), "rollout": as_rows(share), "eval": as_rows(eval_share), "calls": calls}


def _rank_main(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from stages.engines import SamplingRequest

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    engine = _engine(model_dir)
    try:
        out = _work(engine, rank, world)
        if rank == 0:  # then rank 0 calls generate alone (what evaluating on rank 0 only did)
            request = SamplingRequest(n=1, temperature=1.0, top_p=1.0, max_new_tokens=2, seed=0)
            start = time.perf_counter()
            try:
                engine.generate(PROMPTS[:1], request)
                out["alone"] = "returned"
            except RuntimeError as err:
                out["alone"] = str(err)
            out["alone_seconds"] = time.perf_counter() - start
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.barrier()
    finally:
        engine.close()
        dist.destroy_process_group()
    leave_rank()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("lockstep-policy")
    build_tiny_model(ModelConfig()).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory) -> list[dict]:
    """One 2-rank run (gloo, a stand-in engine per rank) for the whole module."""
    out_dir = tmp_path_factory.mktemp("lockstep-ranks")
    saved = os.environ.pop("WORLD_SIZE", None)
    try:
        tmp.spawn(_rank_main, args=(2, _free_port(), model_dir, str(out_dir)), nprocs=2, join=True)
    finally:
        if saved is not None:
            os.environ["WORLD_SIZE"] = saved
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(300)
def test_every_rank_calls_generate_equally_and_samples_match_one_process(model_dir, ranks):
    assert ranks[0]["blocks"] == 3
    assert ranks[0]["calls"] == ranks[1]["calls"] == 4  # 2 rollout + 2 eval calls each; rank 1 padded once per stage
    assert sorted(ranks[0]["rollout"]) == ["0", "2"] and sorted(ranks[1]["rollout"]) == ["1"]
    engine = _engine(model_dir)
    try:
        alone = json.loads(json.dumps(_work(engine, 0, 1)))  # string keys, as the ranks wrote them
    finally:
        engine.close()
    for part in ("rollout", "eval"):
        merged = {**ranks[0][part], **ranks[1][part]}
        assert merged == alone[part], f"{part}: the 2-rank samples differ from the one-process samples"


@pytest.mark.timeout(300)
def test_a_rank_calling_generate_alone_fails_within_seconds(ranks):
    """The stand-in's DP model: what evaluating on rank 0 alone does to a real DP engine (there: a hang)."""
    assert "DP lockstep" in ranks[0]["alone"], ranks[0]["alone"]
    assert ranks[0]["alone_seconds"] < 30
