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
from stages.context import RunEnv, TrainState
from stages.prompts import SamplerState
from storage.checkpoints import apply_retention, load_checkpoint, save_checkpoint


def run_checkpoint(env: RunEnv, state: TrainState, step: int, *, attempt: int = 0,
                   metrics: dict | None = None) -> tuple[dict, TrainState]:
    """Save ``state`` (and the process RNG) as ``checkpoints/step_<step>``; apply retention."""
    t0 = time.perf_counter()
    cfg = env.cfg
    path = save_checkpoint(
        env.run_dir, step, model=state.policy, tokenizer=env.tokenizer, optimizer=state.optimizer,
        sampler_state=state.sampler.to_dict(), calibrator_state=state.calibrator.to_dict(),
        config=cfg.model_dump(mode="json"), metrics=metrics or {},
        extra={"scheduler": state.scheduler.state_dict(), "policy_version": state.policy_version},
    )
    removed = apply_retention(env.run_dir, keep_last=cfg.checkpoint.keep_last, best_metric=cfg.checkpoint.keep_best_metric)
    seconds = time.perf_counter() - t0
    return {"outputs": [str(path)], "removed": [str(p) for p in removed], "seconds": seconds}, state


def restore(env: RunEnv, state: TrainState, path: str | Path) -> tuple[int, TrainState]:
    """Load a checkpoint into ``state``'s policy and optimizer (in place) and return
    ``(step, state)`` with the checkpoint's schedule, sampler, calibrator and policy version."""
    ck = load_checkpoint(path, model=state.policy, optimizer=state.optimizer, restore_rng=True)
    sched = ck.extra.get("scheduler")
    if sched:
        state.scheduler.load_state_dict(sched)
    calibrator = CalibratorState.from_dict(ck.calibrator_state) if ck.calibrator_state else state.calibrator
    return ck.step, state.replace(
        sampler=SamplerState.from_dict(ck.sampler_state), calibrator=calibrator,
        policy_version=int(ck.extra.get("policy_version", ck.step)),
    )
