"""How the ranks of a campaign agree on a stage's outcome: ok, retry, or fatal.

Stages every rank runs together (rollout, score) are retried on every rank
together: a retry on rank 0 alone would deadlock the others' collectives. Each
attempt ends with rank 0 broadcasting its outcome and every rank follows it:

* rank 0 enters its attempt (for the flow: one recorded task run, its ledger
  record opened and its start faults checked), then broadcasts the *go*
  (:func:`after_go`); the other ranks wait for it, so nobody starts a body rank 0
  never reached (a rank-0 failure before its body arrives as the outcome instead,
  :class:`EarlyOutcome`);
* after the body, rank 0 broadcasts ``("ok", (result, sampler, calibrator))``,
  ``("retry", reason)`` on a transient error with attempts left, or
  ``("fatal", reason)`` (:func:`main_attempt`); the others adopt it
  (:func:`peer_attempt`).

Stages rank 0 alone runs (calibrate, evaluate) broadcast what they moved
(:func:`on_main`); collective stages without retries (train, checkpoint) run on
every rank at once (:func:`on_all`). In one process all of this is the identity.
The protocol knows nothing of Prefect: the flow hands it a :class:`RankedStage`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable

from stages.context import RunEnv, TrainState
from stages.runtime.stage_comm import broadcast, is_transient

GO = "go"

StageFn = Callable[..., tuple[Any, TrainState]]


@dataclass(frozen=True)
class RankedStage:
    """A stage as the ranks run it.

    ``run``: rank 0's stage with its own retries (one process), ``run_once``: one
    recorded attempt without retries (rank 0 under several ranks), ``bare``: the
    stage body alone (the other ranks; takes ``attempt=``).
    """

    name: str
    retries: int
    run: StageFn
    run_once: StageFn
    bare: StageFn


class EarlyOutcome(Exception):
    """Rank 0 failed an attempt before its stage body began: its outcome arrived instead of the go."""

    def __init__(self, outcome: tuple) -> None:
        super().__init__(outcome[1])
        self.outcome = outcome


def after_go(fn: StageFn) -> StageFn:
    """A stage body all ranks enter together: rank 0 once inside its attempt broadcasts the go;
    the others wait for it (identity in one process)."""

    def run(env: RunEnv, state: TrainState, step: int, **kw: Any) -> tuple[Any, TrainState]:
        msg = broadcast(env, GO)
        if msg != GO:
            raise EarlyOutcome(msg)
        return fn(env, state, step, **kw)

    return run


def _adopt(state: TrainState, body: tuple) -> tuple[Any, TrainState]:
    result, sampler, calibrator = body
    return result, dataclasses.replace(state, sampler=sampler, calibrator=calibrator)


def main_attempt(
    stage: RankedStage, env: RunEnv, state: TrainState, step: int, *, last: bool, log: logging.Logger, **kw: Any
) -> tuple[Any, TrainState] | None:
    """Rank 0's attempt; broadcasts ok / retry / fatal; ``None`` means retry."""
    try:
        result, new = stage.run_once(env, state, step, **kw)
    except Exception as err:
        verdict = "retry" if is_transient(err) and not last else "fatal"
        broadcast(env, (verdict, f"{type(err).__name__}: {err}".splitlines()[0]))
        if verdict == "fatal":
            raise
        log.warning("%s of step %d failed (%s); all ranks retry", stage.name, step, err)
        return None
    broadcast(env, ("ok", (result, new.sampler, new.calibrator)))
    return result, new


def peer_attempt(
    stage: RankedStage, env: RunEnv, state: TrainState, step: int, *, attempt: int, **kw: Any
) -> tuple[Any, TrainState] | None:
    """A non-main rank's attempt: the bare stage, then rank 0's outcome; ``None`` means retry."""
    local = None
    try:
        stage.bare(env, state, step, attempt=attempt, **kw)
        outcome = broadcast(env, None)
    except EarlyOutcome as early:  # rank 0 failed before the body: nothing ran here
        outcome = early.outcome
    except Exception as err:  # every rank raised together (stages.runtime.stage_comm); rank 0 decides
        local, outcome = err, broadcast(env, None)
    verdict, body = outcome
    if verdict == "ok":
        return _adopt(state, body)
    if verdict == "retry":
        return None
    raise RuntimeError(f"{stage.name} of step {step} failed on rank 0, so rank {env.rank} stops: {body}") from local


def on_ranks(
    stage: RankedStage, env: RunEnv, state: TrainState, step: int, *, log: logging.Logger, **kw: Any
) -> tuple[Any, TrainState]:
    """A stage every rank runs together (rollout, score), retried on all ranks together.

    One process: ``stage.run`` with its own retries. Several ranks: up to
    ``retries + 1`` attempts, each ending with rank 0's outcome, which every rank follows."""
    if env.world_size == 1:
        return stage.run(env, state, step, **kw)
    attempts = stage.retries + 1
    for attempt in range(attempts):
        if env.is_main:
            out = main_attempt(stage, env, state, step, last=attempt == attempts - 1, log=log, **kw)
        else:
            out = peer_attempt(stage, env, state, step, attempt=attempt, **kw)
        if out is not None:
            return out
    raise AssertionError("unreachable: the last attempt is ok or fatal")


def on_main(stage: RankedStage, env: RunEnv, state: TrainState, step: int, **kw: Any) -> tuple[Any, TrainState]:
    """A stage rank 0 alone runs (calibration, evaluation); the state it moves (sampler,
    calibrator) is broadcast so all ranks continue alike. If it fails, rank 0 exits and
    torchrun stops every rank: failure acts on all together."""
    out = stage.run(env, state, step, **kw) if env.is_main else (None, state)
    if env.world_size == 1:
        return out
    return _adopt(state, broadcast(env, (out[0], out[1].sampler, out[1].calibrator)))


def on_all(stage: RankedStage, env: RunEnv, state: TrainState, step: int, **kw: Any) -> tuple[Any, TrainState]:
    """A collective stage (train, checkpoint): rank 0 runs it as a recorded attempt without
    retries (a retry on one rank would deadlock the others), the other ranks as the bare stage."""
    if env.is_main:
        return stage.run(env, state, step, **kw)
    return stage.bare(env, state, step, attempt=0, **kw)
