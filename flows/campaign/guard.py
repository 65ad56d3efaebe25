"""The campaign guard: watch the step rows, roll back on a trip, continue with a remedy.

After every step the flow hands the step's metrics to :class:`CampaignGuard`.
It runs the detectors of :mod:`fp8rl_core.signals.guard` over the live step rows
(entropy surge, garbled surge, reward collapse, non-finite updates). On a trip:

1. the rollback target c = the newest complete checkpoint of a step <= first
   bad step - 2 (``fp8rl_core.signals.guard.last_good_step``);
2. a ``guard`` stage record at step c is started in the ledger; inside it every
   output of steps > c is set aside (``storage.parts.writer.set_aside_from``, as
   ``fp8rl resume --from`` does: tables to ``superseded/``, later checkpoints,
   ledger records hidden) and the record finishes with why (kind, detection
   step, first bad step, detail) and the remedy; its ``info`` is queryable
   (``ledger.info``, the ``guard-events`` named query) and drawn by
   ``fp8rl report``;
3. checkpoint c is restored (weights, optimizer, RNG, sampler, calibrator) and
   the campaign continues at c + 1 with the remedy: ``recalibrate_now`` /
   ``recalibrate_every_step`` force the shadow passes on the next 1 /
   ``remedy_steps`` steps (``stages.schedule.shadow``), ``tighten`` narrows the bounds in
   force by ``tighten_factor``; ``stop`` (or a trip beyond ``max_trips``, or no
   checkpoint to go back to) records the trip and stops the campaign with
   :class:`GuardStop`.

One process drives the flow; under several ranks the launcher (rank 0) runs
the guard and the restore acts on all ranks through the same restore path as
resume. The decision is written into the ``guard`` record's start event
before anything moves, so a SIGKILL inside the rollback leaves a running
record that says what to do: :func:`recover_pending` (called when a campaign
resumes) redoes the set-aside and finishes the record before the newest
checkpoint is restored, so the rollback is resumable like any other stage and
its remedy still applies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fp8rl_core.signals.guard import Trip, check, last_good_step
from stages.context import RunEnv, TrainState
from storage import faults


class GuardStop(RuntimeError):
    """The guard stopped the campaign (remedy ``stop``, too many trips, or nothing to roll back to)."""


def _live_rows(env: RunEnv) -> list[dict]:
    """The run's live ``steps`` rows (this variant), in step order."""
    from storage.queries.catalog import connect, query

    try:
        con = connect(env.run_dir)
        t = query(con, f"SELECT * FROM steps WHERE variant = '{env.variant}' ORDER BY step")
    except Exception:  # no steps yet
        return []
    return [{k: v for k, v in r.items() if v is not None} for r in t.to_pylist()]


def _checkpoint_steps(env: RunEnv) -> list[int]:
    from storage.checkpoints.verify import list_checkpoints, verify_checkpoint

    return [s for s, p in list_checkpoints(env.run_dir) if not verify_checkpoint(p, hashes=False)]  # [] = complete


def _set_aside_after(env: RunEnv, c: int) -> int:
    from storage.parts.writer import set_aside_from

    moved = set_aside_from(env.run_dir, step=c, stages_at_step=[], variant=env.variant)
    return len(moved.files)


def recover_pending(env: RunEnv) -> None:
    """Finish a rollback a crash interrupted (rank 0, before the newest checkpoint is restored).

    A running ``guard`` record whose start event holds a rollback decision is
    completed: the set-aside of every output after its step is redone (it is
    idempotent: what was moved before the crash is no longer live) and the
    record finishes with the decision, so the trip counts and its remedy
    applies to the replayed steps exactly as without the crash. A running
    record with no rollback decision (a ``stop``) is marked failed; the
    monitor sees the live rows again on resume.
    """
    for r in env.ledger.records(variant=env.variant):
        if r.stage != "guard" or r.status != "running":
            continue
        if r.info.get("action") == "rollback" and r.info.get("rollback_to") is not None:
            n = _set_aside_after(env, int(r.info["rollback_to"]))
            env.ledger.finish(
                r.step,
                "guard",
                attempt=r.attempt,
                variant=env.variant,
                info={**r.info, "set_aside_files": n, "recovered": True},
            )
        else:
            env.ledger.fail(
                r.step,
                "guard",
                attempt=r.attempt,
                variant=env.variant,
                error=RuntimeError("guard interrupted before a rollback decision was carried out"),
            )


class CampaignGuard:
    """Per-campaign monitor, on every rank; rank 0 decides, all ranks act."""

    def __init__(self, env: RunEnv) -> None:
        self.env = env
        self.cfg = env.cfg.guard
        self.rows: list[dict] = _live_rows(env) if self.cfg.enabled and env.is_main else []

    def after_step(
        self, state: TrainState, step: int, metrics: dict[str, Any], last_eval: dict
    ) -> tuple[int, TrainState, dict]:
        """``(next step, state, last eval)``: ``step + 1`` unchanged, or after a rollback."""
        from stages.runtime.stage_comm import broadcast

        if not self.cfg.enabled or step < 1:
            return step + 1, state, last_eval
        decision = None
        if self.env.is_main:
            self.rows = [r for r in self.rows if int(r["step"]) < step] + [{"step": step, **metrics}]
            trip = check(self.rows, self.cfg, at_last=True)
            decision = None if trip is None else self._record(trip)
        decision = broadcast(self.env, decision)
        if decision is None:
            return step + 1, state, last_eval
        if decision["action"] == "stop":
            raise GuardStop(decision["message"])
        return self._restore(state, int(decision["rollback_to"]))

    def _trips_so_far(self) -> int:
        recs = self.env.ledger.records(variant=self.env.variant, include_set_aside=True)
        return sum(1 for r in recs if r.stage == "guard" and r.status == "done" and r.info.get("action") == "rollback")

    def _record(self, trip: Trip) -> dict:
        """Rank 0: decide, set the later outputs aside, write the ``guard`` ledger record."""
        env, cfg = self.env, self.cfg
        c = last_good_step(trip.first_bad_step, _checkpoint_steps(env))
        stop = cfg.remedy == "stop" or self._trips_so_far() >= cfg.max_trips or c is None
        info = {
            "kind": trip.kind,
            "detected_step": trip.detected_step,
            "first_bad_step": trip.first_bad_step,
            "detail": trip.detail,
            "remedy": cfg.remedy,
            "remedy_steps": cfg.remedy_steps,
            "action": "stop" if stop else "rollback",
            "rollback_to": c,
        }
        at = trip.detected_step if stop else c
        attempt = env.ledger.next_attempt(at, "guard", variant=env.variant)
        decided = {k: v for k, v in info.items() if not (isinstance(v, float) and not math.isfinite(v))}
        # the decision goes into the start event, so a crash inside the set-aside can be finished on resume
        with env.ledger.stage(at, "guard", attempt=attempt, variant=env.variant, info=decided) as rec:
            if not stop:
                info["set_aside_files"] = rec.info["set_aside_files"] = _set_aside_after(env, c)
                faults.at("guard", at, "set_aside")  # FP8RL_FAULT test hook (a SIGKILL inside the rollback)
        if stop:
            why = (
                "no checkpoint before the surge"
                if c is None
                else ("remedy is stop" if cfg.remedy == "stop" else f"{cfg.max_trips} rollbacks already")
            )
            info["message"] = f"guard: {trip.kind} at step {trip.detected_step} ({trip.detail}); stopped: {why}"
        else:
            self.rows = [r for r in self.rows if int(r["step"]) <= c]
        return info

    def _restore(self, state: TrainState, c: int) -> tuple[int, TrainState, dict]:
        """All ranks: restore checkpoint c, apply the remedy to the state."""
        from stages.checkpoint import restore_latest

        nxt, state, last_eval = restore_latest(self.env, state, before_step=c + 1)
        if self.cfg.remedy == "tighten":
            f, cal = self.cfg.tighten_factor, state.calibrator
            state = dataclasses.replace(state,
                calibrator=dataclasses.replace(cal, lower=1 - f * (1 - cal.lower), upper=1 + f * (cal.upper - 1))
            )
        return nxt, state, last_eval
