"""Rollout stage: draw the step's prompts, generate G samples each, write ``rollouts``.

Prompts come from the persisted sampler position (deterministic in the campaign
seed); generation is seeded by ``(seed, step, round)``. The engine's weights are
refreshed from the trainer first (``load_weights``), so samples of step t come
from the policy after step t-1's update (``policy_version = t - 1``).
"""

from __future__ import annotations

import time

import pyarrow as pa

from stages.context import RunContext, step_seed
from stages.prompt_format import encode_prompts
from stages.prompts import PromptItem, draw_prompts


def sync_engine(ctx: RunContext) -> None:
    """Push the trainer's weights to the engine if it holds an older version."""
    if getattr(ctx.engine, "_fp8rl_version", None) != ctx.policy_version:
        ctx.engine.load_weights(ctx.policy)
        ctx.engine._fp8rl_version = ctx.policy_version


def generate_rows(ctx: RunContext, step: int, items: list[PromptItem], *, round_: int, first_sample_id: int) -> pa.Table:
    """Generate ``G`` samples per prompt and return them as ``rollouts`` rows."""
    r = ctx.cfg.rollout
    tok = ctx.tokenizer
    prompt_ids = encode_prompts(ctx, [it.prompt for it in items])
    sync_engine(ctx)
    batch = ctx.engine.generate(
        prompt_ids, n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
        max_new_tokens=r.max_new_tokens, seed=step_seed(ctx.cfg.seed, step, 1 + round_),
    )
    g = r.samples_per_prompt
    responses = tok.batch_decode([s.response_ids for s in batch.samples], skip_special_tokens=True)
    n = len(batch.samples)
    return pa.table({
        "sample_id": pa.array(range(first_sample_id, first_sample_id + n), pa.int32()),
        "prompt_id": [items[s.prompt_index].prompt_id for s in batch.samples],
        "sample_index": pa.array([s.sample_index for s in batch.samples], pa.int16()),
        "generation_round": pa.array([round_] * n, pa.int16()),
        "dataset": [items[s.prompt_index].dataset for s in batch.samples],
        "prompt": [items[k // g].prompt for k in range(n)],
        "response": responses,
        "reference_answer": [items[s.prompt_index].answer for s in batch.samples],
        "prompt_token_ids": pa.array([prompt_ids[s.prompt_index] for s in batch.samples], pa.list_(pa.int32())),
        "response_token_ids": pa.array([s.response_ids for s in batch.samples], pa.list_(pa.int32())),
        "rollout_logp": pa.array([s.response_logprobs for s in batch.samples], pa.list_(pa.float32())),
        "response_length": pa.array([len(s.response_ids) for s in batch.samples], pa.int32()),
        "finish_reason": [s.finish_reason for s in batch.samples],
        "policy_version": pa.array([ctx.policy_version] * n, pa.int64()),
        "precision": [ctx.cfg.precision.rollout] * n,
    }), batch


def run_rollout(ctx: RunContext, step: int, *, round_: int = 0, first_sample_id: int = 0) -> dict:
    """Rollout of ``step`` (refill round ``round_``); writes ``rollouts`` and advances the sampler."""
    t0 = time.perf_counter()
    items, after = draw_prompts(ctx.source, ctx.sampler, ctx.cfg.rollout.prompts_per_step, ctx.cfg.seed)
    rows, batch = generate_rows(ctx, step, items, round_=round_, first_sample_id=first_sample_id)
    stage = "rollout" if round_ == 0 else f"rollout{round_}"
    path = ctx.writer.write("rollouts", step, rows, stage=stage, attempt=ctx.attempt, variant=ctx.variant)
    ctx.sampler = after
    if round_ == 0:
        ctx.sampler_after_rollout[step] = after
    seconds = time.perf_counter() - t0
    if round_ == 0:  # refill rounds are timed (and added) by the score stage that asks for them
        ctx.record_time(step, "rollout", seconds)
    return {
        "outputs": [str(path)],
        "samples": rows.num_rows,
        "tokens_per_second": batch.tokens_per_second,
        "generated_tokens": batch.generated_tokens,
        "seconds": seconds,
        "sampler": after.to_dict(),
    }
