"""Checkpoint stage: save everything needed to continue bit-for-bit, apply retention.

Saved through :mod:`storage.checkpoints`: HF weights (loadable by
``from_pretrained``), optimizer and LR-schedule state, RNG states, sampler
position, calibrator state, config, policy version, and the latest eval metrics
(for keep-best retention). :func:`restore` is the inverse used by resume.
"""

from __future__ import annotations

import time
from pathlib import Path

from fp8rl_core.calibration import CalibratorState
from fp8rl_core.fp4_linear import fp4_rng_state, load_fp4_rng_state
from stages.context import RunContext
from stages.prompts import SamplerState
from storage.checkpoints import apply_retention, load_checkpoint, save_checkpoint


def run_checkpoint(ctx: RunContext, step: int, *, metrics: dict | None = None) -> dict:
    t0 = time.perf_counter()
    cfg = ctx.cfg
    path = save_checkpoint(
        ctx.run_dir, step, model=ctx.policy, tokenizer=ctx.tokenizer, optimizer=ctx.optimizer,
        sampler_state=ctx.sampler.to_dict(), calibrator_state=ctx.calibrator.to_dict(),
        config=cfg.model_dump(mode="json"), metrics=metrics or {},
        extra={"scheduler": ctx.scheduler.state_dict(), "policy_version": ctx.policy_version,
               "fp4_rng": fp4_rng_state(ctx.policy)},
    )
    removed = apply_retention(ctx.run_dir, keep_last=cfg.checkpoint.keep_last, best_metric=cfg.checkpoint.keep_best_metric)
    seconds = time.perf_counter() - t0
    ctx.record_time(step, "checkpoint", seconds)
    return {"outputs": [str(path)], "removed": [str(p) for p in removed], "seconds": seconds}


def restore(ctx: RunContext, path: str | Path) -> int:
    """Load a checkpoint into the context (weights, optimizer, schedule, RNG, sampler, calibrator)."""
    ck = load_checkpoint(path, model=ctx.policy, optimizer=ctx.optimizer, restore_rng=True)
    sched = ck.extra.get("scheduler")
    if sched:
        ctx.scheduler.load_state_dict(sched)
    ctx.sampler = SamplerState.from_dict(ck.sampler_state)
    if ck.calibrator_state:
        ctx.calibrator = CalibratorState.from_dict(ck.calibrator_state)
    ctx.policy_version = int(ck.extra.get("policy_version", ck.step))
    load_fp4_rng_state(ctx.policy, ck.extra.get("fp4_rng"))  # FP4 stochastic rounding resumes its stream
    return ck.step
