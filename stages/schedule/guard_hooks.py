"""Stage-side hooks of the guard (the monitor and rollback are ``flows.guard``).

- ``guard_forces_shadow``: after a rollback with remedy ``recalibrate_now`` /
  ``recalibrate_every_step``, the steps right after the restored checkpoint run
  the shadow passes and calibrate. Read from the ledger's ``guard`` records, so
  a resumed run keeps the remedy.
- ``GuardHooks.injected_lr``: the test hook of an injected, finite surge
  (``storage.faults.injected_lr``, inert unless the test suite arms the hooks):
  steps A..B train at learning rate LR on their first train attempt only (a
  replay after the rollback runs clean). Both are read by :func:`train_hooks`,
  once per train attempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.context import RunEnv
from storage import faults


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


@dataclass(frozen=True)
class GuardHooks:
    """What the guard asks of one train attempt, read in one call before the update."""

    forces_shadow: bool  # a rollback's remedy makes this step run the shadow passes (and calibrate)
    injected_lr: float | None  # the test hook's learning rate for this attempt, else None


def train_hooks(env: RunEnv, step: int, attempt: int) -> GuardHooks:
    """The guard's hooks for ``step``'s train attempt ``attempt`` (the LR injection acts on attempt 0 only)."""
    return GuardHooks(step >= 1 and guard_forces_shadow(env, step), faults.injected_lr(step) if attempt == 0 else None)
