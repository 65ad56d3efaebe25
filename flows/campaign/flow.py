"""The campaign flow: one step runs the stage table in order, each stage through one runner.

The stages are rows of :data:`fp8rl_core.config.stage_kinds.STAGES` (rank policy,
retries, when, replay, engine sync, tables, time limit), bound to their functions in
``stages/dag.py``; this module turns each row into a Prefect task (:func:`stage_task`)
and runs a step as a loop over the table (:func:`run_step`). How ranks agree on an
attempt's outcome is :mod:`stages.runtime.rank_outcome`.

Prefect gives retries, states, logs and artifacts; the ledger in the run directory is
the truth for resume. Each stage is one Prefect task with the table's retries, retried
on transient errors only: :class:`TransientStageError`, ``OSError``, ``TimeoutError``,
``ConnectionError`` (or another rank's transient failure); anything else (a bug, a bad
config) fails at once.

Every stage has a time limit (``timeouts.<stage>_s``, else the table's), armed alike on
every rank by :mod:`stages.runtime.deadline` (never by Prefect on rank 0 alone): a
stage past it ends every rank with one line, and ``fp8rl resume`` redoes it. Under
several ranks a stage that fails ends each rank with one line, its traceback in the run
directory.

Under several ranks a stage the table runs ``together`` (rollout, score, evaluate) runs
on every rank (:func:`stages.runtime.rank_outcome.on_ranks`): Prefect's own retries
would re-run rank 0 alone and deadlock, so each attempt ends with rank 0 broadcasting
its outcome (ok, retry, fatal) and all ranks follow it; rank 0 runs each attempt as its
own Prefect task run, so the ledger and the UI record every attempt.

Prefect caching is deliberately off (``NO_CACHE``): stage inputs are an in-process
policy and optimizer, and the ledger, not a cache key, decides what is done.
:func:`run_campaign` is the one entry used by ``fp8rl run``, ``fp8rl resume`` and
deployments.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

from flows.orchestration.api import (
    NO_CACHE,
    create_markdown_artifact,
    create_table_artifact,
    flow,
    get_run_logger,
    task,
)
from flows.orchestration.ui import publish_bounds, publish_failure, publish_step
from flows.process.shutdown import received as received_signal
from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.stage_kinds import STAGES, Ranks, StageSpec
from stages.checkpoint import restore_latest
from stages.context import RunEnv, TrainState
from stages.dag import StepContext, binding, stage_runs
from stages.result import StageResult
from stages.rollout import sync_engine
from stages.rollout_side import RolloutSide, overlaps, rollout_worker
from stages.runtime.deadline import end_rank, stage_deadline
from stages.runtime.rank_outcome import GO, EarlyOutcome, RankedStage, after_go, on_all, on_main, on_ranks
from stages.runtime.stage_comm import TRANSIENT, TransientStageError, broadcast, is_transient  # noqa: F401 (re-exported)
from storage import faults
from storage.run import lock

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


def stage_task(spec: StageSpec):
    """The Prefect task of one stage: one recorded attempt (ledger record, fault scope, rank 0's go),
    with the table's retries on transient errors. Its function calls the stage function itself."""
    if spec not in _TASKS:
        _TASKS[spec] = _make_task(spec, binding(spec).fn())
    return _TASKS[spec]


_TASKS: dict[StageSpec, Any] = {}


def _make_task(spec: StageSpec, fn: Callable[..., tuple[StageResult, Any]]):
    def attempt_stage(env: RunEnv, state: TrainState, step: int, **kw: Any) -> tuple[StageResult, TrainState]:
        try:
            attempt = env.ledger.next_attempt(step, spec.name, variant=env.variant)
            with env.ledger.stage(step, spec.name, attempt=attempt, variant=env.variant) as rec:
                with faults.stage_scope(spec.name, step):  # FP8RL_FAULT test hook
                    if spec.waits_for_go:
                        _go(env)
                    result, state = fn(env, state, step, attempt=attempt, **kw)
                rec.outputs.extend(result.outputs)
                rec.info.update(_jsonable(result.ledger_info()))
            return result, state
        except BaseException as err:
            publish_failure(env, spec.name, step, err)  # the attempt's reason, in the task run's logs and artifacts
            raise

    run = task(
        name=spec.name,
        retries=spec.retries,
        retry_delay_seconds=1,
        retry_condition_fn=_is_transient if spec.retries else None,
        cache_policy=NO_CACHE,
        persist_result=False,
        task_run_name=f"{spec.name}-step-{{step}}",
    )(attempt_stage)
    run.peer_body = after_go(fn) if spec.waits_for_go else fn  # what the other ranks run of an attempt
    return run


def _go(env: RunEnv) -> None:
    """Rank 0, inside its attempt, tells the other ranks to enter the body (as ``rank_outcome.after_go``
    does for them); a failure before this point reaches them as the attempt's outcome instead."""
    msg = broadcast(env, GO)
    if msg != GO:
        raise EarlyOutcome(msg)


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


def _ranked(spec: StageSpec) -> RankedStage:
    """The stage's task as the ranks run it (``stages.runtime.rank_outcome``)."""
    run = stage_task(spec)
    return RankedStage(spec.name, spec.retries, run, run.with_options(retries=0), run.peer_body)


_RANK_POLICY = {Ranks.TOGETHER: on_ranks, Ranks.MAIN: on_main, Ranks.ALL: on_all}


def _done_stages(env: RunEnv, step: int) -> tuple[set, dict]:
    """The stages the ledger marks done at ``step``, and the records of those that do not replay
    (rank 0 reads, every rank receives)."""
    done, info = None, {}
    if env.is_main:
        done = env.ledger.done_stages(step, variant=env.variant)
        info = {s.name: _ledger_info(env, step, s.name) for s in STAGES if s.name in done and not s.replays}
    return broadcast(env, (done, info))


def run_step(
    env: RunEnv,
    state: TrainState,
    step: int,
    progress: Progress,
    last_eval: dict | None = None,
    *,
    runs: list[tuple[StageSpec, int]] | None = None,
) -> tuple[StageResult, TrainState, dict]:
    """All stages of one step, the stage table in order; returns ``(train result, new state, latest eval)``.

    A stage the ledger marks done is not redone unless it replays after a restore (train,
    calibrate, checkpoint: the weights must be rebuilt); one that does not gives back what
    its record holds (rollout, score: the sampler position; evaluate: the scores). Every rank
    runs this loop; rank 0 reads the ledger and tells the others.

    With ``rollout.max_staleness`` k ≥ 1 the rollout side's stages run for later steps too
    (:func:`stages.dag.stage_runs`); where the rollout side overlaps (:mod:`stages.rollout_side`) those
    for a later step than this one are handed to a :class:`RolloutSide`, which runs them through this
    function (``runs``: the stage runs to make instead of the table's) in a thread beside training."""
    ctx = StepContext(last_eval=dict(last_eval or {}))
    ledger: dict[int, tuple[set, dict]] = {}  # what the ledger holds at each step a stage runs for
    side = RolloutSide(env) if runs is None and overlaps(env) else None  # a later step's rollout, beside training

    def beside(state: TrainState, queued: list[tuple[StageSpec, int]]) -> TrainState:
        return run_step(env, state, step, progress, runs=queued)[1]  # its timings are its ledger records'

    for spec, at in stage_runs(env.cfg, step, ctx) if runs is None else runs:  # at: step, or a later one
        if side is not None and spec.ahead and at > step:
            side.queue(spec, at)
            continue
        if side is not None and spec.beside_rollout:
            side.start(state, beside)
        elif side is not None:
            state = side.join(state, beside)
        if at not in ledger:
            ledger[at] = _done_stages(env, at)
        done, info = ledger[at]
        bound = binding(spec)
        if spec.name in done and not spec.replays:
            state = bound.recorded(ctx, state, info[spec.name]) if bound.recorded else state
            continue
        if spec.syncs_engine:
            sync_engine(env, state, before_stage=True)
        kw = {"log": _logger()} if spec.ranks is Ranks.TOGETHER else {}
        with stage_deadline(spec.name, at, env.cfg.timeouts.stage_s(spec.name), rank=env.rank):
            out, state = _RANK_POLICY[spec.ranks](_ranked(spec), env, state, at, **kw, **bound.inputs(ctx))
        bound.took(ctx, out)
        if env.is_main and spec.name in _REPORTS:
            _REPORTS[spec.name](env, at, out, progress)
    if side is not None:
        state = side.join(state, beside)
    return ctx.trained, state, ctx.last_eval


def _report_train(env: RunEnv, step: int, out: StageResult, progress: Progress) -> None:
    progress.step(step, out.metrics)
    publish_step(env, step)


def _report_calibrate(env: RunEnv, step: int, out: StageResult, progress: Progress) -> None:
    _bounds_artifact(env, step, out.info)
    publish_bounds(env, step)


def _report_evaluate(env: RunEnv, step: int, out: StageResult, progress: Progress) -> None:
    progress.eval(step, dict(out.scores))
    _eval_artifact(env, step, dict(out.scores))


# what rank 0 shows of a stage's result: the console line and the Prefect artifacts
_REPORTS = {"train": _report_train, "calibrate": _report_calibrate, "evaluate": _report_evaluate}


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
    from flows.campaign.configuration import load_config
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
        from flows.campaign.cpu_numerics import gemm_choice, record_cpu_numerics
        from flows.campaign.guard import CampaignGuard, recover_pending
        from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm

        gemm = gemm_choice(cfg, env.device)  # precision.cpu_bf16_gemm: auto resolved here, recorded in run.json
        if env.is_main:
            record_cpu_numerics(run_dir, gemm)
        env = rollout_worker(env, state, gemm.kind)  # rollout.max_staleness >= 1 on a CPU: the engine in a worker
        with cpu_bf16_gemm(gemm.kind, env.device):  # the whole loop's thread, backward included
            if resume and env.is_main:
                recover_pending(env)  # a rollback a crash interrupted
            start, state, last_eval = restore_latest(env, state) if resume else (0, state, {})
            progress = Progress(cfg, start)
            last = cfg.steps if stop_after_step is None else min(cfg.steps, stop_after_step)
            metrics: dict = {}
            guard = CampaignGuard(env)
            step = start
            while step <= last:
                try:
                    trained, state, last_eval = run_step(env, state, step, progress, last_eval)
                except Exception as err:
                    # a rank ended by a signal makes its peers' collectives fail: their end is flows.process.shutdown's
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
    from flows.report.trackers import attach

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
