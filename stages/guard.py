"""Stage-side hooks of the guard (the monitor and rollback are ``flows.guard``).

- ``guard_forces_shadow``: after a rollback with remedy ``recalibrate_now`` /
  ``recalibrate_every_step``, the steps right after the restored checkpoint run
  the shadow passes and calibrate. Read from the ledger's ``guard`` records, so
  a resumed run keeps the remedy.
- ``injected_lr``: the test hook of an injected, finite surge:
  ``FP8RL_INJECT_LR="A:B=LR"`` trains steps A..B at learning rate LR on their
  first train attempt only (a replay after the rollback runs clean). Unset in
  normal runs.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from stages.context import RunEnv, TrainState


def guard_records(env: RunEnv) -> list:
    """Live ``guard`` ledger records that finished (each one rollback)."""
    return [r for r in env.ledger.records(variant=env.variant) if r.stage == "guard" and r.status == "done"]


def guard_forces_shadow(env: RunEnv, step: int) -> bool:
    for r in guard_records(env):
        c, remedy = r.info.get("rollback_to"), r.info.get("remedy")
        if c is None:
            continue
        n = {"recalibrate_now": 1, "recalibrate_every_step": int(r.info.get("remedy_steps", 1))}.get(remedy, 0)
        if int(c) < step <= int(c) + n:
            return True
    return False


def _injection(step: int) -> float | None:
    spec = os.environ.get("FP8RL_INJECT_LR")
    if not spec:
        return None
    span, _, lr = spec.partition("=")
    a, _, b = span.partition(":")
    return float(lr) if int(a) <= step <= int(b or a) else None


@contextmanager
def injected_lr(state: TrainState, step: int, attempt: int) -> Iterator[None]:
    lr = _injection(step) if attempt == 0 else None
    if lr is None:
        yield
        return
    sched, groups = state.scheduler, state.optimizer.param_groups
    saved_base, saved_lr = list(sched.base_lrs), [g["lr"] for g in groups]
    sched.base_lrs = [lr for _ in saved_base]
    for g in groups:
        g["lr"] = lr
    try:
        yield
    finally:
        sched.base_lrs = saved_base
        for g, v in zip(groups, saved_lr):
            g["lr"] = v
