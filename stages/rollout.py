"""Rollout stage: draw the step's prompts, generate G samples each, write ``rollouts``.

Prompts come from the persisted sampler position (deterministic in the campaign
seed). Generation is cut into blocks of whole GRPO groups for the job's engines
(:mod:`stages.runtime.rollout_plan`: every rank of a tensor-parallel group submits the
same blocks; vLLM's blocks are balanced by expected tokens): each rank generates its
engine's blocks, every prompt seeded by ``(seed, step, round, prompt)``; rank 0
gathers them, puts the samples back in the step's prompt order and writes the
rows, so the samples do not depend on the number of ranks. The engine's
weights are refreshed from the trainer first (``load_weights``), so samples of
step t come from the policy after step t-1's update (``policy_version = t - 1``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, replace

import pyarrow as pa

from stages.context import RunEnv, TrainState
from stages.data.prompt_format import encode_prompts
from stages.data.prompts import PromptItem, draw_prompts
from stages.engines.base import RolloutBatch, RolloutSample, SamplingRequest
from stages.result import StageResult
from stages.runtime.rollout_plan import (
    EngineLayout,
    GenerationBlock,
    blocks_of_rank,
    calls_per_rank,
    engine_layout,
    generation_blocks,
    padding_calls,
)
from stages.runtime.stage_comm import from_main, together


def sync_engine(env: RunEnv, state: TrainState, *, before_stage: bool = False) -> None:
    """The one place the engine takes the trainer's weights: pushed if it holds an older version.

    Inside a stage (``before_stage=False``), just before generating: a sleeping engine
    (vLLM, colocated) is woken by ``load_weights`` (weights, then KV cache); when no
    update is due it is simply woken up, unless it slept at level 2, which discards
    the weights, so they are pushed again (a DAPO refill round after the step's first
    rollout).

    Before a stage that generates (``before_stage=True``, the step's runner, from the
    stage table's ``syncs_engine``): under FSDP2 every rank's engine takes the sharded
    policy and gathers it one parameter at a time (vLLM: in bf16), a collective every
    rank calls together, so it happens here, at the same point on every rank, and
    never wakes an engine the stage may not need. In one process the push waits for
    the first generation.
    """
    stale = env.engine.policy_version != state.policy_version
    if before_stage:
        if env.world_size > 1 and stale:
            env.engine.sync_policy(state.policy, state.policy_version)
    elif stale or env.engine.weights_discarded:
        env.engine.sync_policy(state.policy, state.policy_version)
    else:
        env.engine.wake_up()


def sleep_engine(env: RunEnv) -> dict[str, float]:
    """Put the engine to sleep after a rollout so the trainer gets the memory back.

    A no-op for the transformers engine; a vLLM engine built with
    ``sleep_between_steps`` calls ``llm.sleep(level)``. Returns the GPU memory in
    use before and after (GiB) where it was measured, for the ``steps`` row.
    """
    env.engine.sleep()
    memory = env.engine.last_sleep_memory_gib
    if memory is None:
        return {}
    before, after = memory
    return {"rollout_gpu_gib_before_sleep": before, "rollout_gpu_gib_after_sleep": after}


@dataclass(frozen=True)
class RolloutPlan:
    """A rollout round's prompts (the step's draw, global order), their token ids and its blocks."""

    items: list[PromptItem]
    prompt_ids: list[list[int]]
    blocks: list[GenerationBlock]


def plan_rollout(env: RunEnv, state: TrainState, step: int, items: list[PromptItem], *, round_: int) -> RolloutPlan:
    """Encode the drawn prompts and cut them into blocks for the job's engines (the same on every rank)."""
    r = env.cfg.rollout
    prompt_ids = encode_prompts(env, [it.prompt for it in items], state)
    blocks = generation_blocks(
        [len(p) for p in prompt_ids],
        group_size=r.samples_per_prompt,
        generation_batch_size=r.generation_batch_size,
        seed=env.cfg.seed,
        step=step,
        round_=round_,
        layout=engine_layout(r, env.world_size),
        max_new_tokens=r.max_new_tokens,
    )
    return RolloutPlan(items, prompt_ids, blocks)


def generate_blocks(
    env: RunEnv,
    state: TrainState,
    prompt_ids: list[list[int]],
    blocks: list[GenerationBlock],
    *,
    rank: int,
    lanes: int | EngineLayout,
    request: SamplingRequest,
) -> dict[int, RolloutBatch]:
    """Generate the blocks of ``rank``, one ``engine.generate`` call each: ``{block index: batch}``. The
    rollout's and the evaluation's generation path. Every call asks for ``request`` with the block's
    seeds in place of its ``seed`` and ``seeds``.

    The engine takes the trainer's weights first (:func:`sync_engine`). Every rank of a
    tensor-parallel group submits the same blocks; a rank with fewer blocks than the busiest
    lane pads with discarded calls (:func:`stages.runtime.rollout_plan.padding_calls`), so every
    rank calls the engine equally often."""
    sync_engine(env, state)
    out = {}
    mine = blocks_of_rank(blocks, rank, lanes)
    for block in mine:
        seeded = replace(request, seed=block.seed, seeds=list(block.prompt_seeds))
        out[block.index] = env.engine.generate([prompt_ids[p] for p in block.prompts], seeded)
    if blocks:
        padding_calls(env.engine, prompt_ids[blocks[0].prompts[0]], calls_per_rank(blocks, lanes) - len(mine))
    return out


def generate_share(
    env: RunEnv, state: TrainState, plan: RolloutPlan, *, rank: int, lanes: int | EngineLayout
) -> dict[int, RolloutBatch]:
    """Generate the rollout blocks of ``rank`` (:func:`generate_blocks`): ``{block index: batch}``."""
    r = env.cfg.rollout
    request = SamplingRequest(
        n=r.samples_per_prompt,
        temperature=r.temperature,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        seed=0,  # each block's own
        top_k=env.cfg.algorithm.score_centering_k or 0,  # score centering: the engine's top-k log-probs of every token
    )
    return generate_blocks(env, state, plan.prompt_ids, plan.blocks, rank=rank, lanes=lanes, request=request)


def _global_groups(plan: RolloutPlan, batches: dict[int, RolloutBatch]) -> list[list[RolloutSample]]:
    """The ``G`` samples of every prompt, in the step's prompt order (``[P][G]``)."""
    groups: list[list[RolloutSample]] = [[] for _ in plan.items]
    for block in plan.blocks:
        for j, p in enumerate(block.prompts):
            groups[p] = batches[block.index].group(j)
    return groups


def rows_from_batches(
    env: RunEnv,
    state: TrainState,
    plan: RolloutPlan,
    batches: dict[int, RolloutBatch],
    *,
    round_: int,
    first_sample_id: int,
) -> pa.Table:
    """``rollouts`` rows in group layout: sample ``i`` of prompt ``p`` is ``first_sample_id + p * G + i``."""
    groups = _global_groups(plan, batches)
    prompt_of = [p for p, group in enumerate(groups) for _ in group]  # [P * G] global prompt index of each row
    samples = [s for group in groups for s in group]
    items = [plan.items[p] for p in prompt_of]
    n = len(samples)
    nested = pa.list_(pa.list_(pa.int32())), pa.list_(pa.list_(pa.float32()))
    return pa.table(
        {
            "sample_id": pa.array(range(first_sample_id, first_sample_id + n), pa.int32()),
            "prompt_id": [it.prompt_id for it in items],
            "sample_index": pa.array([s.sample_index for s in samples], pa.int16()),
            "generation_round": pa.array([round_] * n, pa.int16()),
            "dataset": [it.dataset for it in items],
            "prompt": [it.prompt for it in items],
            "response": env.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True),
            "reference_answer": [it.answer for it in items],
            "prompt_token_ids": pa.array([plan.prompt_ids[p] for p in prompt_of], pa.list_(pa.int32())),
            "response_token_ids": pa.array([s.response_ids for s in samples], pa.list_(pa.int32())),
            "rollout_logp": pa.array([s.response_logprobs for s in samples], pa.list_(pa.float32())),
            "response_length": pa.array([len(s.response_ids) for s in samples], pa.int32()),
            "finish_reason": [s.finish_reason for s in samples],
            "policy_version": pa.array([state.policy_version] * n, pa.int64()),
            "precision": [env.cfg.precision.rollout] * n,
            "top_token_ids": pa.array([s.top_ids for s in samples], nested[0]),
            "top_logprobs": pa.array([s.top_logprobs for s in samples], nested[1]),
        }
    )


def generate_rows(
    env: RunEnv, state: TrainState, step: int, items: list[PromptItem], *, round_: int, first_sample_id: int
) -> pa.Table:
    """All the step's ``rollouts`` rows generated in this process (every block: one rank's view of the plan)."""
    plan = plan_rollout(env, state, step, items, round_=round_)
    return rows_from_batches(
        env,
        state,
        plan,
        generate_share(env, state, plan, rank=0, lanes=1),
        round_=round_,
        first_sample_id=first_sample_id,
    )


def _merge_shares(shares: list[dict[int, RolloutBatch]]) -> dict[int, RolloutBatch]:
    """Every rank's blocks in one map; a block generated by several ranks (one lane) is rank 0's."""
    merged: dict[int, RolloutBatch] = {}
    for share in shares:
        for k, batch in share.items():
            merged.setdefault(k, batch)
    return merged


def _throughput(shares: list[dict[int, RolloutBatch]]) -> tuple[int, float]:
    """Generated tokens of the step, and per second of the slowest rank's generation."""
    merged = _merge_shares(shares)
    tokens = sum(b.generated_tokens for b in merged.values())
    wall = max((sum(b.wall_seconds for b in share.values()) for share in shares), default=0.0)
    return tokens, tokens / wall if wall > 0 else float("inf")


def sampling_train_logp(env: RunEnv, state: TrainState, rows: pa.Table) -> pa.Array | None:
    """``rollouts.train_logp`` of ``rows``: the trainer's log-prob of every response token in the training
    precision, with the weights that sampled them (``rollout.max_staleness`` ≥ 1, one process; None
    otherwise, and for an engine that generates apart, vLLM's own process or a server, which holds no
    trainer weights). An engine that holds a copy of the trainer's policy (the rollout side's worker) computes it
    there, beside training; else the trainer's own policy, which still holds the sampling version."""
    if not env.cfg.rollout.max_staleness or env.world_size > 1:
        return None
    if getattr(env.engine, "computes_apart", False) and not env.engine.holds_trainer_copy:
        return None  # its rows may be sampled while the trainer updates: no trainer weights of their version here
    from stages.trainer.forward import response_logprobs

    prompts, responses = rows.column("prompt_token_ids").to_pylist(), rows.column("response_token_ids").to_pylist()
    pad = env.tokenizer.pad_token_id
    kw = {"mode": env.cfg.precision.train, "micro_batch_size": env.cfg.algorithm.micro_batch_size, "pad_id": pad}
    if env.engine.holds_trainer_copy:
        lps = env.engine.train_logprobs(prompts, responses, **kw)
    else:
        lps = response_logprobs(state.policy, prompts, responses, **kw)
    return pa.array(lps, pa.list_(pa.float32()))


def run_rollout(
    env: RunEnv, state: TrainState, step: int, *, attempt: int = 0, round_: int = 0, first_sample_id: int = 0
) -> tuple[StageResult, TrainState]:
    """Rollout of ``step`` (refill round ``round_``) on every rank together; rank 0 writes ``rollouts``.

    Every rank generates its blocks; the shares are gathered on rank 0, which
    writes the rows (a failure on any rank makes every rank raise, see
    :mod:`stages.runtime.stage_comm`). Returns the summary (the same on every rank) and
    the state with the advanced sampler."""
    t0 = time.perf_counter()
    comm = env.stage_comm

    def local():
        items, after = draw_prompts(env.source, state.sampler, env.cfg.rollout.prompts_per_step, env.cfg.seed)
        plan = plan_rollout(env, state, step, items, round_=round_)
        lanes = engine_layout(env.cfg.rollout, env.world_size)
        share = generate_share(env, state, plan, rank=env.rank, lanes=lanes)
        return plan, after, share, sleep_engine(env)

    plan, after, share, engine_memory = together(comm, local)
    shares = comm.gather(share)  # [W] on rank 0, None elsewhere

    def write() -> StageResult:
        rows = rows_from_batches(
            env, state, plan, _merge_shares(shares), round_=round_, first_sample_id=first_sample_id
        )
        train_logp = sampling_train_logp(env, state, rows)
        if train_logp is not None:
            rows = rows.append_column("train_logp", train_logp)
        stage = "rollout" if round_ == 0 else f"rollout{round_}"
        path = env.writer.write("rollouts", step, rows, stage=stage, attempt=attempt, variant=env.variant)
        tokens, per_second = _throughput(shares)
        return StageResult(
            outputs=[str(path)],
            seconds=time.perf_counter() - t0,
            sampler=after.to_dict(),
            timings=dict(engine_memory or {}),
            info={"samples": rows.num_rows, "tokens_per_second": per_second, "generated_tokens": tokens},
        )

    return from_main(comm, write), dataclasses.replace(state, sampler=after)
