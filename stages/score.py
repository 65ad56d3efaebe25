"""Score stage: grade the step's rollouts, shape rewards, compute advantages, write ``scores``.

Rewards are the verifier's score (1 correct, 0 wrong) plus DAPO overlong shaping
when enabled. Advantages come from the configured estimator over GRPO groups (the
G samples of one prompt in one generation round). With DAPO dynamic sampling,
groups whose rewards are all equal are dropped and the stage loops back to the
rollout stage for at most ``max_refill_rounds`` extra rounds to refill the batch;
dropped samples stay in ``scores`` with ``kept = false`` so the SQL view shows them.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch

from fp8rl_core.advantages import ADVANTAGE_ESTIMATORS, dynamic_sampling_mask, overlong_penalty
from stages.context import RunEnv, TrainState
from stages.io import read_step


def grade(env: RunEnv, rows: pa.Table) -> list[float]:
    """Verifier scores in [0, 1] for each rollout row (process pool for math)."""
    from stages.grading import grade_batch

    ids = [f"{pid}#{i}" for pid, i in zip(rows.column("prompt_id").to_pylist(), rows.column("sample_id").to_pylist())]
    results = grade_batch(ids, rows.column("response").to_pylist(), rows.column("reference_answer").to_pylist(),
                          verifier=env.source.verifier)
    return [1.0 if r.correct else 0.0 for r in results]


def _score_rows(env: RunEnv, rows: pa.Table, scores: list[float]) -> dict[str, np.ndarray]:
    a = env.cfg.algorithm
    g = env.cfg.rollout.samples_per_prompt
    score = torch.tensor(scores, dtype=torch.float32)
    lengths = torch.tensor(rows.column("response_length").to_numpy(), dtype=torch.float32)
    if a.overlong_shaping:
        penalty = overlong_penalty(lengths, max_len=a.overlong_max_len, cache_len=a.overlong_cache_len, factor=a.overlong_factor)
    else:
        penalty = torch.zeros_like(score)
    reward = score + penalty
    sample_id = torch.tensor(rows.column("sample_id").to_numpy().astype(np.int64))
    group = sample_id // g  # samples of a group are contiguous, rounds start at multiples of P*G
    adv = ADVANTAGE_ESTIMATORS.get(a.advantage)(reward, group)
    # group statistics for the table (same definitions as the estimator)
    uniq, inv = torch.unique(group, return_inverse=True)
    cnt = torch.zeros(len(uniq)).index_add_(0, inv, torch.ones_like(reward))
    mean = torch.zeros(len(uniq)).index_add_(0, inv, reward) / cnt
    var = torch.zeros(len(uniq)).index_add_(0, inv, (reward - mean[inv]) ** 2) / (cnt - 1).clamp_min(1)
    std = torch.where(cnt > 1, var.sqrt(), torch.ones_like(var))
    keep = dynamic_sampling_mask(reward, group) if a.dynamic_sampling else torch.ones_like(reward, dtype=torch.bool)
    return {
        "score": score.numpy(), "correct": (score >= 1.0).numpy(), "overlong_penalty": penalty.numpy(),
        "reward": reward.numpy(), "group_reward_mean": mean[inv].numpy(), "group_reward_std": std[inv].numpy(),
        "advantage": adv.float().numpy(), "kept": keep.numpy(),
    }


def run_score(env: RunEnv, state: TrainState, step: int, *, attempt: int = 0) -> tuple[dict, TrainState]:
    """Grade the rollouts of ``step`` (with DAPO refill rounds) and write ``scores``.

    ``state`` is the state after the step's rollout; refill rounds advance its
    sampler, and the advanced state is returned (a retry starts again from the
    state it was given)."""
    from stages.rollout import run_rollout

    t0 = time.perf_counter()
    cfg = env.cfg
    per_round = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    if cfg.algorithm.dynamic_sampling:
        # A retried score stage starts its refills afresh: set aside earlier refill
        # rounds of this step (the sampler it was given is the one after round 0).
        refills = [f"rollout{r}" for r in range(1, cfg.algorithm.max_refill_rounds + 1)]
        env.writer.supersede("rollouts", [step], stages=refills, variant=env.variant)
    rows = read_step(env, "rollouts", step)
    scores = grade(env, rows)
    cols = _score_rows(env, rows, scores)
    rounds = 0
    refill_seconds = 0.0
    if cfg.algorithm.dynamic_sampling:
        while int(cols["kept"].sum()) < per_round and rounds < cfg.algorithm.max_refill_rounds:
            rounds += 1
            t_r = time.perf_counter()
            _, state = run_rollout(env, state, step, attempt=attempt, round_=rounds, first_sample_id=rounds * per_round)
            refill_seconds += time.perf_counter() - t_r
            rows = read_step(env, "rollouts", step)
            scores = scores + grade(env, rows.slice(len(scores)))
            cols = _score_rows(env, rows, scores)
        # keep at most one batch worth of groups, in sample order
        kept_idx = np.flatnonzero(cols["kept"])
        if len(kept_idx) > per_round:
            cols["kept"][kept_idx[per_round:]] = False
    table = pa.table({
        "sample_id": rows.column("sample_id"), "prompt_id": rows.column("prompt_id"),
        "score": pa.array(cols["score"], pa.float32()), "correct": pa.array(cols["correct"]),
        "overlong_penalty": pa.array(cols["overlong_penalty"], pa.float32()), "reward": pa.array(cols["reward"], pa.float32()),
        "group_reward_mean": pa.array(cols["group_reward_mean"], pa.float32()),
        "group_reward_std": pa.array(cols["group_reward_std"], pa.float32()),
        "advantage": pa.array(cols["advantage"], pa.float32()), "kept": pa.array(cols["kept"]),
    })
    path = env.writer.write("scores", step, table, stage="score", attempt=attempt, variant=env.variant)
    seconds = time.perf_counter() - t0 - refill_seconds
    return {
        "outputs": [str(path)], "reward_mean": float(cols["reward"].mean()), "accuracy": float(cols["correct"].mean()),
        "kept": int(cols["kept"].sum()), "refill_rounds": rounds, "seconds": seconds,
        "refill_seconds": refill_seconds, "sampler": state.sampler.to_dict(),
    }, state
