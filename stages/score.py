"""Score stage: grade the step's rollouts, shape rewards, compute advantages, write ``scores``.

Rewards are the verifier's score (1 correct, 0 wrong) plus DAPO overlong shaping
when enabled. Advantages come from the configured estimator over GRPO groups (the
G samples of one prompt in one generation round). With DAPO dynamic sampling,
groups whose accuracies are all 0 or all 1 are dropped and the stage loops back to the
rollout stage for at most ``max_refill_rounds`` extra rounds to refill the batch;
dropped samples stay in ``scores`` with ``kept = false`` so the SQL view shows them.

Under several ranks each rank grades a contiguous share of the step's GRPO
groups (:func:`rank_groups`); the grades are gathered on rank 0, which computes
rewards, advantages and the DAPO keep mask over all rows with the one-process
code, decides whether to refill (every rank follows it into the refill
rollout) and writes ``scores``.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch

from fp8rl_core.objective.advantages import ADVANTAGE_ESTIMATORS, dynamic_sampling_mask, overlong_penalty
from stages.context import RunEnv, TrainState
from stages.result import StageResult
from stages.runtime.io import read_step
from stages.runtime.stage_comm import from_main, together


def grade(env: RunEnv, rows: pa.Table) -> list[float]:
    """Verifier scores in [0, 1] for each rollout row (process pool for math, sandbox for code)."""
    return [1.0 if r.correct else 0.0 for r in grade_results(env, rows)]


def grade_results(env: RunEnv, rows: pa.Table) -> list:
    """The verifier's :class:`stages.grade.pool.GradeResult` of each rollout row."""
    from stages.grade.pool import grade_batch

    ids = [f"{pid}#{i}" for pid, i in zip(rows.column("prompt_id").to_pylist(), rows.column("sample_id").to_pylist())]
    return grade_batch(
        ids,
        rows.column("response").to_pylist(),
        rows.column("reference_answer").to_pylist(),
        verifier=env.source.verifier,
        code_config=getattr(env.cfg, "code", None),
    )


def _score_rows(env: RunEnv, rows: pa.Table, scores: list[float]) -> dict[str, np.ndarray]:
    a = env.cfg.algorithm
    g = env.cfg.rollout.samples_per_prompt
    score = torch.tensor(scores, dtype=torch.float32)
    lengths = torch.tensor(rows.column("response_length").to_numpy(), dtype=torch.float32)
    if a.overlong_shaping:
        penalty = overlong_penalty(
            lengths, max_len=a.overlong_max_len, cache_len=a.overlong_cache_len, factor=a.overlong_factor
        )
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
    correct = score >= 1.0
    # DAPO filters on accuracy, not on the shaped reward (overlong penalties make equal answers unequal)
    keep = (
        dynamic_sampling_mask(correct.float(), group)
        if a.dynamic_sampling
        else torch.ones_like(reward, dtype=torch.bool)
    )
    return {
        "score": score.numpy(),
        "correct": correct.numpy(),
        "overlong_penalty": penalty.numpy(),
        "reward": reward.numpy(),
        "group_reward_mean": mean[inv].numpy(),
        "group_reward_std": std[inv].numpy(),
        "advantage": adv.float().numpy(),
        "kept": keep.numpy(),
    }


def rank_groups(n_groups: int, rank: int, world_size: int) -> range:
    """The GRPO groups rank ``rank`` grades: a contiguous share, sizes differing by at most one."""
    return range(n_groups * rank // world_size, n_groups * (rank + 1) // world_size)


def grade_shared(env: RunEnv, rows: pa.Table) -> list | None:
    """Grade ``rows`` (whole groups, ``[N]``) spread over the ranks: every row's
    :class:`stages.grade.pool.GradeResult` in row order on rank 0, ``None`` on the others."""
    g = env.cfg.rollout.samples_per_prompt
    mine = rank_groups(rows.num_rows // g, env.rank, env.world_size)
    share = together(
        env.stage_comm, lambda: grade_results(env, rows.slice(mine.start * g, len(mine) * g)) if mine else []
    )
    parts = env.stage_comm.gather(share)
    return None if parts is None else [r for part in parts for r in part]


def _correct(graded: list) -> list[float]:
    return [1.0 if r.correct else 0.0 for r in graded]


def _read_rollouts(env: RunEnv, step: int) -> pa.Table:
    return together(env.stage_comm, lambda: read_step(env, "rollouts", step))


def _score_table(env: RunEnv, rows: pa.Table, graded: list) -> tuple[pa.Table, dict[str, np.ndarray]]:
    """The ``scores`` rows of the step, capped at one batch of kept groups (DAPO)."""
    cfg = env.cfg
    cols = _score_rows(env, rows, _correct(graded))
    if cfg.algorithm.dynamic_sampling:  # keep at most one batch worth of groups, in sample order
        per_round = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
        kept_idx = np.flatnonzero(cols["kept"])
        if len(kept_idx) > per_round:
            cols["kept"][kept_idx[per_round:]] = False
    table = pa.table(
        {
            "sample_id": rows.column("sample_id"),
            "prompt_id": rows.column("prompt_id"),
            "score": pa.array(cols["score"], pa.float32()),
            "correct": pa.array(cols["correct"]),
            "overlong_penalty": pa.array(cols["overlong_penalty"], pa.float32()),
            "reward": pa.array(cols["reward"], pa.float32()),
            "group_reward_mean": pa.array(cols["group_reward_mean"], pa.float32()),
            "group_reward_std": pa.array(cols["group_reward_std"], pa.float32()),
            "advantage": pa.array(cols["advantage"], pa.float32()),
            "kept": pa.array(cols["kept"]),
            "tests_passed_fraction": pa.array([r.fraction for r in graded], pa.float32()),
        }
    )
    return table, cols


def run_score(env: RunEnv, state: TrainState, step: int, *, attempt: int = 0) -> tuple[StageResult, TrainState]:
    """Grade the rollouts of ``step`` (with DAPO refill rounds) and write ``scores``; every rank together.

    ``state`` is the state after the step's rollout; refill rounds advance its
    sampler, and the advanced state is returned (a retry starts again from the
    state it was given). Rank 0 decides each refill round and writes the table;
    the summary is the same on every rank."""
    from stages.rollout import run_rollout

    t0 = time.perf_counter()
    cfg, comm = env.cfg, env.stage_comm
    per_round = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    if cfg.algorithm.dynamic_sampling:
        # A retried score stage starts its refills afresh: set aside earlier refill
        # rounds of this step (the sampler it was given is the one after round 0).
        refills = [f"rollout{r}" for r in range(1, cfg.algorithm.max_refill_rounds + 1)]
        from_main(comm, lambda: env.writer.supersede("rollouts", [step], stages=refills, variant=env.variant))
    rows = _read_rollouts(env, step)
    graded = grade_shared(env, rows)  # every row's grade on rank 0 (None elsewhere)

    def short_of_a_batch() -> bool:  # rank 0's view, shared: every rank runs the refill round or none does
        return int(_score_rows(env, rows, _correct(graded))["kept"].sum()) < per_round

    rounds, refill_seconds = 0, 0.0
    while (
        cfg.algorithm.dynamic_sampling
        and rounds < cfg.algorithm.max_refill_rounds
        and from_main(comm, short_of_a_batch)
    ):
        rounds += 1
        t_r = time.perf_counter()
        _, state = run_rollout(env, state, step, attempt=attempt, round_=rounds, first_sample_id=rounds * per_round)
        refill_seconds += time.perf_counter() - t_r
        graded_rows = rows.num_rows
        rows = _read_rollouts(env, step)
        more = grade_shared(env, rows.slice(graded_rows))
        graded = None if more is None else graded + more

    def write() -> StageResult:
        table, cols = _score_table(env, rows, graded)
        path = env.writer.write("scores", step, table, stage="score", attempt=attempt, variant=env.variant)
        return StageResult(
            outputs=[str(path)],
            seconds=time.perf_counter() - t0 - refill_seconds,
            sampler=state.sampler.to_dict(),
            timings={"rollout_seconds": refill_seconds} if refill_seconds else {},  # refills generate: rollout time
            info={
                "reward_mean": float(cols["reward"].mean()),
                "accuracy": float(cols["correct"].mean()),
                "kept": int(cols["kept"].sum()),
                "refill_rounds": rounds,
                "refill_seconds": refill_seconds,
            },
        )

    return from_main(comm, write), state
