"""Rollout stage: draw the step's prompts, generate G samples each, write ``rollouts``.

Prompts come from the persisted sampler position (deterministic in the campaign
seed); generation is seeded by ``(seed, step, round)``. The engine's weights are
refreshed from the trainer first (``load_weights``), so samples of step t come
from the policy after step t-1's update (``policy_version = t - 1``).
"""

from __future__ import annotations

import time

import pyarrow as pa

from stages.context import RunEnv, TrainState, step_seed
from stages.prompts import PromptItem, draw_prompts


def sync_engine(env: RunEnv, state: TrainState) -> None:
    """Push the trainer's weights to the engine if it holds an older version."""
    if getattr(env.engine, "_fp8rl_version", None) != state.policy_version:
        env.engine.load_weights(state.policy)
        env.engine._fp8rl_version = state.policy_version


def generate_rows(env: RunEnv, state: TrainState, step: int, items: list[PromptItem], *, round_: int,
                  first_sample_id: int) -> pa.Table:
    """Generate ``G`` samples per prompt and return them as ``rollouts`` rows."""
    r = env.cfg.rollout
    tok = env.tokenizer
    prompt_ids = [tok(it.prompt, add_special_tokens=True)["input_ids"] for it in items]
    sync_engine(env, state)
    batch = env.engine.generate(
        prompt_ids, n=r.samples_per_prompt, temperature=r.temperature, top_p=r.top_p,
        max_new_tokens=r.max_new_tokens, seed=step_seed(env.cfg.seed, step, 1 + round_),
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
        "policy_version": pa.array([state.policy_version] * n, pa.int64()),
        "precision": [env.cfg.precision.rollout] * n,
    }), batch


def run_rollout(env: RunEnv, state: TrainState, step: int, *, attempt: int = 0, round_: int = 0,
                first_sample_id: int = 0) -> tuple[dict, TrainState]:
    """Rollout of ``step`` (refill round ``round_``); writes ``rollouts``; returns the advanced sampler in the state."""
    t0 = time.perf_counter()
    items, after = draw_prompts(env.source, state.sampler, env.cfg.rollout.prompts_per_step, env.cfg.seed)
    rows, batch = generate_rows(env, state, step, items, round_=round_, first_sample_id=first_sample_id)
    stage = "rollout" if round_ == 0 else f"rollout{round_}"
    path = env.writer.write("rollouts", step, rows, stage=stage, attempt=attempt, variant=env.variant)
    seconds = time.perf_counter() - t0
    return {
        "outputs": [str(path)],
        "samples": rows.num_rows,
        "tokens_per_second": batch.tokens_per_second,
        "generated_tokens": batch.generated_tokens,
        "seconds": seconds,
        "sampler": after.to_dict(),
    }, state.replace(sampler=after)
