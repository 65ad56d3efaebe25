"""The campaign flow: rollout → score → train → calibrate (shadow steps) → evaluate (every E) → checkpoint (every C).

This module holds the DAG and its Prefect tasks; the stages are plain functions
in ``stages/`` returning a :class:`stages.result.StageResult`, and how ranks agree
on an attempt's outcome is :mod:`stages.runtime.rank_outcome`.

Prefect gives retries, states, logs and artifacts; the ledger in the
run directory is the truth for resume. Each stage is one Prefect task:

=========== ======================= ==========================================
stage       retries                 why
=========== ======================= ==========================================
rollout     2, on transient errors  generation is pure given (weights, seed)
score       2, on transient errors  grading reads persisted rollouts
train       none: resume instead    an update is not idempotent in-process
calibrate   1                       reads persisted token_stats
evaluate    2, on transient errors
checkpoint  2, on OSError
=========== ======================= ==========================================

Every stage has a time limit (``timeouts.<stage>_s``), armed alike on every rank
by :mod:`stages.runtime.deadline` (never by Prefect on rank 0 alone): a stage
past it ends every rank with one line, and ``fp8rl resume`` redoes it. Under
several ranks a stage that fails ends each rank with one line, its traceback in
the run directory.

Transient = :class:`TransientStageError`, ``OSError``, ``TimeoutError``,
``ConnectionError`` (or another rank's transient failure); anything else (a
bug, a bad config) fails at once.

Under several ranks rollout, score and evaluate run on every rank together
(:func:`stages.runtime.rank_outcome.on_ranks`): Prefect's own retries would re-run rank 0
alone and deadlock, so each attempt ends with rank 0 broadcasting its outcome
(ok, retry, fatal) and all ranks follow it; rank 0 runs each attempt as its own
Prefect task run, so the ledger and the UI record every attempt.

Prefect caching is deliberately off (``NO_CACHE``): stage inputs are an
in-process policy and optimizer, and the ledger, not a cache key, decides what
is done. :func:`run_campaign` is the one entry used by ``fp8rl run``,
``fp8rl resume`` and deployments.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from flows.prefect_api import (
    NO_CACHE,
    create_markdown_artifact,
    create_table_artifact,
    flow,
    get_run_logger,
    task,
)
from flows.shutdown import received as received_signal
from flows.ui import publish_bounds, publish_failure, publish_step
from fp8rl_core.config.campaign import CampaignConfig
from stages.checkpoint import eval_scores, restore_latest
from stages.context import RunEnv, TrainState, is_checkpoint_step, is_eval_step
from stages.result import StageResult
from stages.runtime.deadline import end_rank, stage_deadline
from stages.runtime.rank_outcome import RankedStage, after_go, on_all, on_main, on_ranks
from stages.runtime.stage_comm import TRANSIENT, TransientStageError, broadcast, is_transient  # noqa: F401 (re-exported)
from storage import faults, lock

# how long a rank whose step failed waits for the signal that may have ended a peer first (torchrun
# signals the ranks one after another) before it reports the failure as its own
PEER_SIGNAL_S = 1.0


def _is_transient(task_obj, task_run, state) -> bool:
    try:
        state.result()
    except BaseException as err:
        return is_transient(err)
    return False


# --------------------------------------------------------------------------- stage tasks


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        try:
            json.dumps(v)
        except TypeError:
            continue
        out[k] = v
    return out


def _run_stage(
    name: str, fn: Callable[..., tuple[StageResult, Any]], env: RunEnv, state: TrainState, step: int, **kw: Any
) -> tuple[StageResult, TrainState]:
    attempt = env.ledger.next_attempt(step, name, variant=env.variant)
    with env.ledger.stage(step, name, attempt=attempt, variant=env.variant) as rec:
        with faults.stage_scope(name, step):  # FP8RL_FAULT test hook
            result, state = fn(env, state, step, attempt=attempt, **kw)
        rec.outputs.extend(result.outputs)
        rec.info.update(_jsonable(result.ledger_info()))
    return result, state


def _stage_task(name: str, retries: int):
    def deco(fn: Callable[..., tuple[StageResult, Any]]):
        @task(
            name=name,
            retries=retries,
            retry_delay_seconds=1,
            retry_condition_fn=_is_transient if retries else None,
            cache_policy=NO_CACHE,
            persist_result=False,
            task_run_name=f"{name}-step-{{step}}",
        )
        def run(env: RunEnv, state: TrainState, step: int, **kw: Any) -> tuple[StageResult, TrainState]:
            try:
                return _run_stage(name, fn, env, state, step, **kw)
            except BaseException as err:
                publish_failure(env, name, step, err)  # the attempt's reason, in the task run's logs and artifacts
                raise

        run.stage_fn = fn
        return run

    return deco


def _rollout(env, state, step, **kw):
    from stages.rollout import run_rollout

    return run_rollout(env, state, step, **kw)


def _score(env, state, step, **kw):
    from stages.score import run_score

    return run_score(env, state, step, **kw)


def _train(env, state, step, **kw):
    from stages.train import run_train

    return run_train(env, state, step, **kw)


def _calibrate(env, state, step, **kw):
    from stages.calibrate import run_calibrate

    return run_calibrate(env, state, step, **kw)


def _evaluate(env, state, step, **kw):
    from stages.evaluate import run_evaluate

    return run_evaluate(env, state, step, **kw)


def _checkpoint(env, state, step, **kw):
    from stages.checkpoint import run_checkpoint

    return run_checkpoint(env, state, step, **kw)


rollout_task = _stage_task("rollout", retries=2)(after_go(_rollout))
score_task = _stage_task("score", retries=2)(after_go(_score))
train_task = _stage_task("train", retries=0)(_train)
calibrate_task = _stage_task("calibrate", retries=1)(_calibrate)
evaluate_task = _stage_task("evaluate", retries=2)(_evaluate)
checkpoint_task = _stage_task("checkpoint", retries=2)(_checkpoint)


# --------------------------------------------------------------------------- the step loop


class Progress:
    """One console line per step: step k/N, reward, entropy, clip shares, L/H, ETA."""

    def __init__(self, cfg: CampaignConfig, start: int, echo: Callable[[str], None] = print) -> None:
        self.cfg, self.start, self.echo = cfg, start, echo
        self.t0 = time.perf_counter()

    def step(self, step: int, m: dict) -> None:
        done = step - self.start + 1 if self.start > 0 else step
        elapsed = time.perf_counter() - self.t0
        left = self.cfg.steps - step
        eta = elapsed / max(done, 1) * left
        self.echo(
            f"step {step:>4}/{self.cfg.steps} | reward {m.get('reward_mean', float('nan')):.3f}"
            f" | entropy {m.get('entropy_mean', float('nan')):.3f}"
            f" | clip -{100 * m.get('clipfrac_lower', 0):.2f}% +{100 * m.get('clipfrac_upper', 0):.2f}%"
            f" | L {m.get('lower_bound', float('nan')):.3f} H {m.get('upper_bound', float('nan')):.3f}"
            f" | {m.get('step_seconds', 0):.1f}s | ETA {int(eta // 60)}m{int(eta % 60):02d}s"
        )

    def eval(self, step: int, scores: dict) -> None:
        body = ", ".join(f"{k} {100 * v:.1f}%" for k, v in scores.items())
        self.echo(f"eval at step {step}: {body}")


def _ledger_info(env: RunEnv, step: int, stage: str) -> dict:
    rec = env.ledger.current_record(step, stage, variant=env.variant)
    return rec.info if rec is not None else {}


def _logger():
    """The Prefect run logger inside a flow run, else the package logger."""
    try:
        return get_run_logger()
    except Exception:  # no run context (tests driving the step loop directly)
        import logging

        return logging.getLogger("fp8rl")


def _ranked(task_obj) -> RankedStage:
    """The stage task as the ranks run it (``stages.runtime.rank_outcome``)."""
    return RankedStage(task_obj.name, task_obj.retries, task_obj, task_obj.with_options(retries=0), task_obj.stage_fn)


def _on_ranks(task_obj, env: RunEnv, state: TrainState, step: int, **kw: Any) -> tuple[StageResult, TrainState]:
    return on_ranks(_ranked(task_obj), env, state, step, log=_logger(), **kw)


def _on_main(task_obj, env: RunEnv, state: TrainState, step: int, **kw: Any) -> tuple[StageResult, TrainState]:
    return on_main(_ranked(task_obj), env, state, step, **kw)


def _on_all(task_obj, env: RunEnv, state: TrainState, step: int, **kw: Any) -> tuple[StageResult, TrainState]:
    return on_all(_ranked(task_obj), env, state, step, **kw)


def _limited(runner, task_obj, env: RunEnv, state: TrainState, step: int, **kw: Any) -> tuple[StageResult, TrainState]:
    """``runner`` (:func:`_on_ranks`, :func:`_on_main`, :func:`_on_all`) under the stage's limit
    (``timeouts.<stage>_s``), armed alike on every rank: a rank waiting for rank 0's part of the
    stage waits under the same limit (:mod:`stages.runtime.deadline`)."""
    with stage_deadline(task_obj.name, step, env.cfg.timeouts.stage_s(task_obj.name), rank=env.rank):
        return runner(task_obj, env, state, step, **kw)


_after_go = after_go  # the name the rank tests use


def _sync_engine(env: RunEnv, state: TrainState, synced: dict) -> None:
    """Under FSDP2 every rank's engine takes the sharded policy and gathers it one parameter at a
    time (vLLM: in bf16), a collective every rank calls together."""
    if env.world_size == 1 or synced.get("version") == state.policy_version:
        return
    env.engine.sync_policy(state.policy, state.policy_version)
    synced["version"] = state.policy_version


def _rollout_and_score(
    env: RunEnv, state: TrainState, step: int, done: set, info: dict, synced: dict
) -> tuple[dict[str, float], TrainState]:
    """Rollout and score of ``step`` on every rank (a done one gives back its sampler); their times."""
    from stages.data.prompts import SamplerState

    timings: dict[str, float] = {}
    for name, stage_task in (("rollout", rollout_task), ("score", score_task)):
        if name in done:
            state = dataclasses.replace(state, sampler=SamplerState.from_dict(info[name].get("sampler")))
            continue
        _sync_engine(env, state, synced)  # DAPO refills generate too
        out, state = _limited(_on_ranks, stage_task, env, state, step)
        timings[f"{name}_seconds"] = out.seconds
        for k, v in out.timings.items():  # engine memory; refill rounds' generation time adds to rollout's
            timings[k] = timings.get(k, 0.0) + v if k.endswith("_seconds") else v
    return timings, state


def run_step(
    env: RunEnv,
    state: TrainState,
    step: int,
    progress: Progress,
    last_eval: dict | None = None,
    synced: dict | None = None,
) -> tuple[StageResult, TrainState, dict]:
    """All stages of one step; returns ``(train result, new state, latest eval scores)``.

    Stages the ledger marks done are not redone, except train/calibrate/checkpoint,
    which replay after a restore (weights must be rebuilt); a done rollout or score
    gives back the sampler position it recorded. Every rank runs this loop; rank 0
    reads the ledger and tells the others."""
    synced = {} if synced is None else synced
    done, info = None, {}
    if env.is_main:
        done = env.ledger.done_stages(step, variant=env.variant)
        info = {k: _ledger_info(env, step, k) for k in ("rollout", "score", "evaluate") if k in done}
    done, info = broadcast(env, (done, info))
    trained, last_eval = StageResult(), dict(last_eval or {})
    if step > 0:
        timings, state = _rollout_and_score(env, state, step, done, info, synced)
        trained, state = _limited(_on_all, train_task, env, state, step, timings=timings)
        if trained.shadow:  # the schedule's decision (fixed K, drift, a guard remedy), as steps.shadow records it
            cal, state = _limited(_on_main, calibrate_task, env, state, step)
            if env.is_main:
                _bounds_artifact(env, step, cal.info)
                publish_bounds(env, step)
        if env.is_main:
            progress.step(step, trained.metrics)
            publish_step(env, step)
    if is_eval_step(env.cfg, step):
        if "evaluate" in done:
            last_eval = eval_scores(info["evaluate"])
        else:
            _sync_engine(env, state, synced)
            out, state = _limited(_on_ranks, evaluate_task, env, state, step)  # every rank generates its share
            last_eval = dict(out.scores)
            if env.is_main:
                progress.eval(step, last_eval)
                _eval_artifact(env, step, last_eval)
    if is_checkpoint_step(env.cfg, step):
        _, state = _limited(_on_all, checkpoint_task, env, state, step, metrics=dict(last_eval))
    return trained, state, last_eval


def _bounds_artifact(env: RunEnv, step: int, cal: dict) -> None:
    try:
        create_markdown_artifact(
            key=f"bounds-{_artifact_key(env.run_id)}",
            markdown=f"Step {step}: L = {cal['lower']:.4f}, H = {cal['upper']:.4f}, alpha = {cal['alpha']:.4f}",
            description="Calibrated clip bounds in force from the next step",
        )
    except Exception:  # artifacts are a convenience; never fail a stage on them
        get_run_logger().debug("bounds artifact not created", exc_info=True)


def _eval_artifact(env: RunEnv, step: int, scores: dict) -> None:
    try:
        create_table_artifact(
            key=f"eval-{_artifact_key(env.run_id)}",
            table=[{"step": step, "metric": k, "value": round(v, 4)} for k, v in scores.items()],
            description=f"Evaluation at step {step}",
        )
    except Exception:
        get_run_logger().debug("eval artifact not created", exc_info=True)


def _artifact_key(run_id: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in run_id.lower())[:60]


def campaign_loop(run_dir: str, resume: bool = False, stop_after_step: int | None = None) -> dict:
    """The step loop every rank runs (rank 0 inside :func:`campaign_flow`)."""
    from flows.configuration import load_config
    from stages.context import open_run, resolve_device
    from stages.trainer.distributed import init_from_env

    cfg = load_config(Path(run_dir) / "config.yaml")
    lock.acquire(run_dir)  # one writer per run (rank 0 only; re-entrant: the CLI already holds it)
    try:
        rank, world, group = init_from_env(resolve_device(cfg.device), timeout_s=cfg.timeouts.process_group_s)
        env, state = open_run(cfg, run_dir, rank=rank, world_size=world, group=group)
    except BaseException:
        lock.release(run_dir)
        raise
    trackers = (
        _open_trackers(env) if cfg.trackers and env.is_main else None
    )  # no tracker code imported unless configured
    try:
        from flows.cpu_numerics import gemm_choice, record_cpu_numerics
        from flows.guard import CampaignGuard, recover_pending
        from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm

        gemm = gemm_choice(cfg, env.device)  # precision.cpu_bf16_gemm: auto resolved here, recorded in run.json
        if env.is_main:
            record_cpu_numerics(run_dir, gemm)
        with cpu_bf16_gemm(gemm.kind, env.device):  # the whole loop's thread, backward included
            if resume and env.is_main:
                recover_pending(env)  # a rollback a crash interrupted
            start, state, last_eval = restore_latest(env, state) if resume else (0, state, {})
            progress = Progress(cfg, start)
            last = cfg.steps if stop_after_step is None else min(cfg.steps, stop_after_step)
            metrics: dict = {}
            synced: dict = {}
            guard = CampaignGuard(env)
            step = start
            while step <= last:
                try:
                    trained, state, last_eval = run_step(env, state, step, progress, last_eval, synced)
                except Exception as err:
                    # a rank ended by a signal makes its peers' collectives fail: their end is flows.shutdown's
                    if world == 1 or received_signal(within_s=PEER_SIGNAL_S) is not None:
                        raise
                    end_rank(err, rank=rank, run_dir=run_dir, where=f"step {step}")  # never returns
                metrics = trained.metrics or metrics
                # step + 1, or (all ranks together) the step after the checkpoint a guard rollback restored
                step, state, last_eval = guard.after_step(state, step, metrics, last_eval)
        return {
            "run_dir": str(run_dir),
            "last_step": last,
            "final_metrics": _jsonable(metrics),
            "last_eval": last_eval,
            "world_size": world,
        }
    finally:
        env.close()
        if trackers is not None:
            trackers.close()
        lock.release(run_dir)


def _open_trackers(env: RunEnv):
    from flows.trackers import attach

    return attach(env)


@flow(name="fp8rl-campaign", persist_result=False, validate_parameters=False, log_prints=False)
def campaign_flow(run_dir: str, resume: bool = False, stop_after_step: int | None = None) -> dict:
    """Run (or resume) the campaign whose config lives in ``run_dir/config.yaml`` (rank 0's Prefect flow)."""
    return campaign_loop(run_dir, resume, stop_after_step)


def run_campaign(run_dir: str, resume: bool = False, stop_after_step: int | None = None) -> dict:
    """The entry of every rank: rank 0 (or the only process) runs the Prefect flow, the other
    ranks the same loop without Prefect (they never talk to it)."""
    if int(os.environ.get("RANK", "0")) == 0:
        return campaign_flow(run_dir, resume=resume, stop_after_step=stop_after_step)
    return campaign_loop(run_dir, resume, stop_after_step)
