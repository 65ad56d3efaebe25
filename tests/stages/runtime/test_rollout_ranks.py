"""Each rank rolls out and scores its own prompts; retries act on all ranks together.

* the generation blocks of a step do not depend on the world size: for W = 1, 2, 3
  the ranks' blocks together are the same blocks with the same seeds, every
  prompt appears once and a GRPO group is never split;
* the tiny model's rows generated rank by rank (W = 2, 3, simulated in one
  process, then merged) equal the one-process rows bit for bit;
* scoring shares: contiguous whole groups, every group graded once;
* rollout + score with DAPO refills on two ranks (threads sharing a run
  directory, an in-memory collective) write the one-process rows and agree on
  every refill round;
* coordinated retries (two ranks as threads over an in-memory collective): a
  transient failure on rank 1 makes both ranks retry once and agree on the
  result; rank 0 failing before the stage body (a start fault) is retried the
  same way; a non-transient failure makes both ranks fail, rank 1 naming rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import micro_config

from flows.campaign.configuration import dump_config
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer
from stages.context import RunEnv, TrainState, open_run
from stages.data.prompts import SamplerState, draw_prompts, make_source
from stages.engines import make_engine
from stages.rollout import generate_rows, generate_share, plan_rollout, rows_from_batches, run_rollout
from stages.runtime.io import read_step
from stages.runtime.rank_outcome import RankedStage, on_ranks
from stages.runtime.rank_outcome import after_go as _after_go
from stages.runtime.rollout_plan import blocks_of_rank, generation_blocks
from stages.runtime.stage_comm import PeerStageError, StageComm, from_main, together
from stages.score import rank_groups, run_score
from storage.faults import InjectedTransientFault
from storage.run.layout import create_run

LENGTHS = [7, 3, 9, 3, 5, 12, 4, 7, 6, 3, 8]  # 11 prompts, ties on purpose (stable order)


# --------------------------------------------------------------------------- the block plan


@pytest.mark.parametrize("batch, group", [(8, 4), (6, 4), (3, 4), (512, 4)])
def test_blocks_are_the_same_for_every_world_size(batch, group):
    blocks = generation_blocks(LENGTHS, group_size=group, generation_batch_size=batch, seed=5, step=3, round_=1)
    per_block = max(1, batch // group)
    order = sorted(range(len(LENGTHS)), key=lambda p: (LENGTHS[p], p))
    assert [p for b in blocks for p in b.prompts] == order  # every prompt once, in length order
    assert all(len(b.prompts) <= per_block for b in blocks)  # whole groups: at most one engine chunk
    assert len({b.seed for b in blocks}) == len(blocks)
    for world in (1, 2, 3):
        shares = [blocks_of_rank(blocks, r, world) for r in range(world)]
        union = sorted((b for share in shares for b in share), key=lambda b: b.index)
        assert union == blocks  # same blocks, same seeds, each on exactly one rank
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_block_seeds_depend_on_step_round_and_prompt_not_on_the_world():
    plan = lambda **kw: generation_blocks(
        LENGTHS, **{"group_size": 4, "generation_batch_size": 8, "seed": 5, "step": 3, "round_": 0, **kw}
    )
    seeds = [b.prompt_seeds for b in plan()]
    assert seeds == [b.prompt_seeds for b in plan()]
    assert all(b.seed == b.prompt_seeds[0] for b in plan())
    for other in (plan(step=4), plan(round_=1), plan(seed=6)):
        assert not {s for b in other for s in b.prompt_seeds} & {s for t in seeds for s in t}


def test_score_shares_are_contiguous_whole_groups_graded_once():
    for n, world in ((8, 1), (8, 2), (8, 3), (2, 3), (0, 2)):
        spans = [rank_groups(n, r, world) for r in range(world)]
        assert [g for s in spans for g in s] == list(range(n))
        assert max(map(len, spans)) - min(map(len, spans)) <= 1


# --------------------------------------------------------------------------- rows, rank by rank


@pytest.fixture(scope="module")
def tiny_env():
    cfg = micro_config("rollout.generation_batch_size=8", "precision.rollout=bf16")  # 2 prompts (8 rows) a block
    tok = build_tokenizer()
    policy = build_tiny_model(
        ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128, seed=1)
    )
    engine = make_engine("transformers", model=policy, tokenizer=tok, precision=cfg.precision, config=cfg.rollout)
    env = SimpleNamespace(cfg=cfg, tokenizer=tok, engine=engine, source=make_source(cfg.task), rank=0, world_size=1)
    state = TrainState(policy=policy, optimizer=None, scheduler=None, calibrator=None)
    return env, state


@pytest.mark.timeout(300)
def test_rows_generated_rank_by_rank_equal_one_process_bit_for_bit(tiny_env):
    env, state = tiny_env
    items, _ = draw_prompts(env.source, SamplerState(), env.cfg.rollout.prompts_per_step, env.cfg.seed)
    one = generate_rows(env, state, 2, items, round_=0, first_sample_id=0)
    plan = plan_rollout(env, state, 2, items, round_=0)
    assert len(plan.blocks) == 4
    for world in (2, 3):
        merged = {}
        for rank in reversed(range(world)):  # any order: a block's samples depend on the block alone
            merged.update(generate_share(env, state, plan, rank=rank, lanes=world))
        assert rows_from_batches(env, state, plan, merged, round_=0, first_sample_id=0).equals(one)
    g = env.cfg.rollout.samples_per_prompt
    assert one.column("prompt_id").to_pylist() == [items[k // g].prompt_id for k in range(one.num_rows)]
    refill = generate_rows(env, state, 2, items, round_=1, first_sample_id=one.num_rows)
    assert refill.column("response_token_ids").to_pylist() != one.column("response_token_ids").to_pylist()


def _thread_ranks(envs: list, body) -> list:
    """Run ``body(env)`` on one thread per rank; each rank's value (a rank's exception is re-raised)."""
    out: list = [None] * len(envs)

    def main(r: int) -> None:
        try:
            out[r] = body(envs[r])
        except BaseException as err:  # noqa: BLE001 - reported below
            out[r] = err

    threads = [threading.Thread(target=main, args=(r,)) for r in range(len(envs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for value in out:
        if isinstance(value, BaseException):
            raise value
    return out


@dataclasses.dataclass(frozen=True)
class ThreadRankEnv(RunEnv):
    """A rank of a thread "world": the run's environment with an in-memory collective."""

    comm: Any = None

    @property
    def stage_comm(self):
        return self.comm


@pytest.mark.timeout(900)
def test_two_ranks_roll_out_and_score_with_dapo_refills_exactly_like_one_process(tmp_path):
    """rollout + score (DAPO refills) with W = 2 ranks as threads sharing one run directory:
    the same ``rollouts`` and ``scores`` rows as one process, and the same refill rounds."""
    cfg = micro_config(
        "rollout.prompts_per_step=4",
        "rollout.generation_batch_size=8",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_refill_rounds=1",
    )

    def step_one(env):
        state = env_states[env.rank if env.world_size > 1 else "one"]
        _, state = run_rollout(env, state, 1)
        score, _ = run_score(env, state, 1)
        return score["refill_rounds"], score["kept"]

    env_states: dict = {}
    create_run(tmp_path, "one", config=dump_config(cfg))
    one, env_states["one"] = open_run(cfg, tmp_path / "one")
    create_run(tmp_path, "two", config=dump_config(cfg))
    hub, ranks = ThreadHub(2, timeout=600), []
    for r in range(2):
        env, env_states[r] = open_run(cfg, tmp_path / "two")
        fields = {f.name: getattr(env, f.name) for f in dataclasses.fields(RunEnv) if f.init}
        ranks.append(ThreadRankEnv(**{**fields, "rank": r, "world_size": 2}, comm=ThreadComm(hub, r)))
    try:
        expected = step_one(one)
        assert expected[0] >= 1, "no refill round ran: the test would not see the shared refill decision"
        assert _thread_ranks(ranks, step_one) == [expected, expected]
    finally:
        for env in (one, *ranks):
            env.close()
    for table in ("rollouts", "scores"):
        a, b = (read_step(e, table, 1).sort_by("sample_id") for e in (one, ranks[0]))
        assert a.drop_columns([c for c in ("run_id",) if c in a.column_names]).equals(
            b.drop_columns([c for c in ("run_id",) if c in b.column_names])
        ), table


# --------------------------------------------------------------------------- coordinated retries


class ThreadHub:
    """Two "ranks" as threads: every collective is a slot exchange between two barriers."""

    def __init__(self, world: int = 2, timeout: float = 20) -> None:
        self.slots: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)

    def exchange(self, rank: int, obj):
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadComm(StageComm):
    def __init__(self, hub: ThreadHub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, len(hub.slots)

    def all_gather(self, obj):
        return self.hub.exchange(self.rank, obj)

    def gather(self, obj):
        out = self.hub.exchange(self.rank, obj)
        return out if self.rank == 0 else None

    def broadcast(self, obj):
        return self.hub.exchange(self.rank, obj)[0]


class FakeTask:
    """What ``_on_ranks`` uses of a Prefect stage task: rank 0 calls ``with_options(retries=0)(...)``
    once per attempt (a task run, here a counter that may fail at its start like a start fault)."""

    name, retries = "rollout", 2

    def __init__(self, fn, start_fault_on_attempt: int | None = None) -> None:
        self.stage_fn = _after_go(fn)
        self.task_runs = 0
        self.start_fault_on_attempt = start_fault_on_attempt

    def with_options(self, retries: int):
        assert retries == 0

        def run(env, state, step, **kw):
            attempt, self.task_runs = self.task_runs, self.task_runs + 1
            if attempt == self.start_fault_on_attempt:
                raise InjectedTransientFault("injected at start")
            return self.stage_fn(env, state, step, attempt=attempt, **kw)

        return run


def _on_ranks(task, env, state, step: int):
    """The runner's call for a stage the ranks run together (``flows/campaign/flow.py:run_step``)."""
    ranked = RankedStage(task.name, task.retries, task, task.with_options(retries=0), task.stage_fn)
    return on_ranks(ranked, env, state, step, log=logging.getLogger("fp8rl.test"))


def _stage(fail: dict, bodies: list):
    """A collective stage: each rank computes rank * 10 + attempt; rank 0 shares the gathered values."""

    def run(env, state, step, *, attempt):
        bodies.append((env.rank, attempt))

        def local():
            if (env.rank, attempt) in fail:
                raise fail[(env.rank, attempt)]
            return env.rank * 10 + attempt

        share = together(env.stage_comm, local)
        everyone = env.stage_comm.gather(share)
        summary = from_main(env.stage_comm, lambda: {"shares": everyone, "attempt": attempt})
        return summary, dataclasses.replace(state, sampler=SamplerState(0, 8 + attempt))

    return run


def _two_ranks(task: FakeTask) -> list:
    """Run ``_on_ranks`` on two thread-ranks; each rank's (summary, sampler) or the exception it raised."""
    hub, out = ThreadHub(), [None, None]
    state = TrainState(policy=None, optimizer=None, scheduler=None, calibrator=None)

    def rank_main(rank: int) -> None:
        env = SimpleNamespace(rank=rank, world_size=2, is_main=rank == 0, stage_comm=ThreadComm(hub, rank))
        try:
            summary, new = _on_ranks(task, env, state, 1)
            out[rank] = (summary, new.sampler)
        except Exception as err:
            out[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return out


def test_a_transient_failure_on_rank_1_retries_on_both_ranks_which_agree():
    bodies: list = []
    task = FakeTask(_stage({(1, 0): OSError("disk hiccup")}, bodies))
    r0, r1 = _two_ranks(task)
    assert r0 == r1 == ({"shares": [1, 11], "attempt": 1}, SamplerState(0, 9))
    assert task.task_runs == 2 and sorted(bodies) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_rank_0_failing_before_the_stage_body_retries_both_ranks():
    bodies: list = []
    task = FakeTask(_stage({}, bodies), start_fault_on_attempt=0)
    r0, r1 = _two_ranks(task)
    assert r0 == r1 == ({"shares": [1, 11], "attempt": 1}, SamplerState(0, 9))
    assert sorted(bodies) == [(0, 1), (1, 1)]  # attempt 0 never began its body on any rank


def test_a_non_transient_failure_fails_both_ranks_without_retrying():
    bodies: list = []
    task = FakeTask(_stage({(1, 0): ValueError("a bug")}, bodies))
    r0, r1 = _two_ranks(task)
    assert isinstance(r0, PeerStageError) and r0.rank == 1 and "ValueError: a bug" in str(r0)
    assert isinstance(r1, RuntimeError) and "failed on rank 0, so rank 1 stops" in str(r1) and "a bug" in str(r1)
    assert task.task_runs == 1 and sorted(bodies) == [(0, 0), (1, 0)]


def test_transient_failures_on_every_attempt_end_fatal_on_both_ranks():
    bodies: list = []
    task = FakeTask(_stage({(1, a): TimeoutError("slow") for a in range(3)}, bodies))
    r0, r1 = _two_ranks(task)
    assert isinstance(r0, PeerStageError) and r0.transient and isinstance(r1, RuntimeError)
    assert task.task_runs == 3


def test_one_process_collectives_are_the_identity_and_errors_pass_unchanged():
    comm = StageComm()
    assert together(comm, lambda: 3) == 3 and from_main(comm, lambda: 4) == 4
    with pytest.raises(KeyError):
        together(comm, lambda: {}["x"])
