"""The campaign flow: rollout → score → train → calibrate (every K) → evaluate (every E) → checkpoint (every C).

Prefect gives retries, timeouts, states, logs and artifacts; the ledger in the
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

Transient = :class:`TransientStageError`, ``OSError``, ``TimeoutError``,
``ConnectionError``; anything else (a bug, a bad config) fails at once.

Prefect caching is deliberately off (``NO_CACHE``): stage inputs are an
in-process policy and optimizer, and the ledger, not a cache key, decides what
is done. :func:`run_campaign` is the one entry used by ``fp8rl run``,
``fp8rl resume`` and deployments.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

from fp8rl_core.config import CampaignConfig
from flows.prefect_env import configure_prefect_env, quiet_third_party

configure_prefect_env()
quiet_third_party()

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.artifacts import create_markdown_artifact, create_table_artifact  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

from stages.context import RunContext, is_calibration_step, is_checkpoint_step, is_eval_step  # noqa: E402
from storage import faults, lock  # noqa: E402
from storage.faults import InjectedTransientFault  # noqa: E402


class TransientStageError(RuntimeError):
    """A failure worth retrying (I/O hiccup, engine restart, injected fault)."""


TRANSIENT = (TransientStageError, InjectedTransientFault, OSError, TimeoutError, ConnectionError)


def _is_transient(task_obj, task_run, state) -> bool:
    try:
        state.result()
    except TRANSIENT:
        return True
    except BaseException:
        return False
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


def _run_stage(name: str, fn: Callable[..., dict], ctx: RunContext, step: int, **kw: Any) -> dict:
    ctx.attempt = ctx.ledger.next_attempt(step, name, variant=ctx.variant)
    with ctx.ledger.stage(step, name, attempt=ctx.attempt, variant=ctx.variant) as rec:
        with faults.stage_scope(name, step):  # FP8RL_FAULT test hook
            summary = fn(ctx, step, **kw)
        rec.outputs.extend(summary.get("outputs", []))
        rec.info.update(_jsonable({k: v for k, v in summary.items() if k not in ("outputs", "metrics")}))
    return summary


def _stage_task(name: str, retries: int, timeout_s: float | None = None):
    def deco(fn: Callable[..., dict]):
        @task(
            name=name, retries=retries, retry_delay_seconds=1, retry_condition_fn=_is_transient if retries else None,
            cache_policy=NO_CACHE, persist_result=False, timeout_seconds=timeout_s,
            task_run_name=f"{name}-step-{{step}}",
        )
        def run(ctx: RunContext, step: int, **kw: Any) -> dict:
            return _run_stage(name, fn, ctx, step, **kw)

        run.stage_fn = fn
        return run

    return deco


def _rollout(ctx, step):
    from stages.rollout import run_rollout

    return run_rollout(ctx, step)


def _score(ctx, step):
    from stages.score import run_score

    return run_score(ctx, step)


def _train(ctx, step):
    from stages.train import run_train

    return run_train(ctx, step)


def _calibrate(ctx, step):
    from stages.calibrate import run_calibrate

    return run_calibrate(ctx, step)


def _evaluate(ctx, step):
    from stages.evaluate import run_evaluate

    return run_evaluate(ctx, step)


def _checkpoint(ctx, step, metrics=None):
    from stages.checkpoint import run_checkpoint

    return run_checkpoint(ctx, step, metrics=metrics)


rollout_task = _stage_task("rollout", retries=2, timeout_s=3600)(_rollout)
score_task = _stage_task("score", retries=2, timeout_s=3600)(_score)
train_task = _stage_task("train", retries=0)(_train)
calibrate_task = _stage_task("calibrate", retries=1)(_calibrate)
evaluate_task = _stage_task("evaluate", retries=2, timeout_s=3600)(_evaluate)
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


def _ledger_info(ctx: RunContext, step: int, stage: str) -> dict:
    rec = ctx.ledger.current(variant=ctx.variant).get((step, stage))
    return rec.info if rec is not None else {}


def _eval_scores_from(summary: dict) -> dict:
    return {k: float(v) for k, v in (summary.get("scores") or {}).items() if isinstance(v, (int, float))}


def run_step(ctx: RunContext, step: int, progress: Progress) -> dict:
    """All stages of one step; stages the ledger marks done are not redone, except
    train/calibrate/checkpoint, which replay after a restore (weights must be rebuilt)."""
    from stages.prompts import SamplerState

    cfg = ctx.cfg
    done = ctx.ledger.done_stages(step, variant=ctx.variant)
    summary: dict[str, Any] = {}
    if step > 0:
        if "rollout" in done:
            ctx.sampler = SamplerState.from_dict(_ledger_info(ctx, step, "rollout").get("sampler"))
            ctx.sampler_after_rollout[step] = ctx.sampler
        else:
            rollout_task(ctx, step)
        if "score" in done:
            ctx.sampler = SamplerState.from_dict(_ledger_info(ctx, step, "score").get("sampler"))
        else:
            score_task(ctx, step)
        summary = train_task(ctx, step)
        if is_calibration_step(cfg, step):
            cal = calibrate_task(ctx, step)
            _bounds_artifact(ctx, step, cal)
        progress.step(step, summary.get("metrics", {}))
    if is_eval_step(cfg, step):
        if "evaluate" in done:
            scores = _eval_scores_from(_ledger_info(ctx, step, "evaluate"))
        else:
            scores = _eval_scores_from(evaluate_task(ctx, step))
            progress.eval(step, scores)
            _eval_artifact(ctx, step, scores)
        ctx.last_eval = scores
    if is_checkpoint_step(cfg, step):
        checkpoint_task(ctx, step, metrics=dict(ctx.last_eval))
    ctx.timings.pop(step - 1, None)
    return summary


def _bounds_artifact(ctx: RunContext, step: int, cal: dict) -> None:
    try:
        create_markdown_artifact(
            key=f"bounds-{_artifact_key(ctx.run_id)}",
            markdown=f"Step {step}: L = {cal['lower']:.4f}, H = {cal['upper']:.4f}, alpha = {cal['alpha']:.4f}",
            description="Calibrated clip bounds in force from the next step",
        )
    except Exception:  # artifacts are a convenience; never fail a stage on them
        get_run_logger().debug("bounds artifact not created", exc_info=True)


def _eval_artifact(ctx: RunContext, step: int, scores: dict) -> None:
    try:
        create_table_artifact(
            key=f"eval-{_artifact_key(ctx.run_id)}",
            table=[{"step": step, "metric": k, "value": round(v, 4)} for k, v in scores.items()],
            description=f"Evaluation at step {step}",
        )
    except Exception:
        get_run_logger().debug("eval artifact not created", exc_info=True)


def _artifact_key(run_id: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in run_id.lower())[:60]


def restore_latest(ctx: RunContext, *, before_step: int | None = None) -> int:
    """Restore the newest complete checkpoint (of a step < ``before_step``); return the first step to run."""
    from stages.checkpoint import restore
    from storage.checkpoints import latest_complete

    at_most = None if before_step is None else before_step - 1
    path = latest_complete(ctx.run_dir, at_most=at_most)
    if path is None:
        return 0
    step = restore(ctx, path)
    ev = _ledger_info(ctx, step, "evaluate")
    ctx.last_eval = _eval_scores_from(ev)
    return step + 1


@flow(name="fp8rl-campaign", persist_result=False, validate_parameters=False, log_prints=False)
def campaign_flow(run_dir: str, resume: bool = False, stop_after_step: int | None = None) -> dict:
    """Run (or resume) the campaign whose config lives in ``run_dir/config.yaml``."""
    from flows.configuration import load_config
    from stages.context import open_context

    cfg = load_config(Path(run_dir) / "config.yaml")
    lock.acquire(run_dir)  # one writer per run (re-entrant: the CLI already holds it)
    ctx = None
    try:
        ctx = open_context(cfg, run_dir)
        start = restore_latest(ctx) if resume else 0
        progress = Progress(cfg, start)
        last = cfg.steps if stop_after_step is None else min(cfg.steps, stop_after_step)
        metrics: dict = {}
        for step in range(start, last + 1):
            metrics = run_step(ctx, step, progress).get("metrics", metrics)
        return {"run_dir": str(run_dir), "last_step": last, "final_metrics": _jsonable(metrics), "last_eval": ctx.last_eval}
    finally:
        if ctx is not None:
            ctx.close()
        lock.release(run_dir)
