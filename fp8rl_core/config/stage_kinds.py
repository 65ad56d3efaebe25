"""The campaign's stages as data: one frozen :class:`StageSpec` per stage, in DAG order.

A step of a campaign runs the stages of :data:`STAGES` in order, each when its
``when`` says so. Everything the flow, the CLI and ``fp8rl rerun`` know of a stage
comes from its row here:

============ ========= ======= ========== ======= ===== ===============================
stage        ranks     retries when       replays sync  why the retries
============ ========= ======= ========== ======= ===== ===============================
rollout      together  2       step       no      yes   generation is pure given (weights, seed)
score        together  2       step       no      yes   grading reads persisted rollouts (DAPO refills generate)
train        all       0       step       yes     no    an update is not idempotent in-process: resume instead
calibrate    main      1       shadow     yes     no    reads persisted token_stats
evaluate     together  2       eval       no      yes   generation again
checkpoint   all       2       checkpoint yes     no    on OSError
============ ========= ======= ========== ======= ===== ===============================

* **ranks**: how the ranks of a job run the stage (``stages.runtime.rank_outcome``):
  ``together`` — every rank runs it, attempts retried on every rank together;
  ``main`` — rank 0 alone, the state it moves broadcast; ``all`` — a collective every
  rank enters at once, retried only by rank 0 in one process.
* **when**: ``step`` — every step from 1; ``shadow`` — the steps whose train stage ran
  the BF16 shadow passes (``steps.shadow``); ``eval`` — step 0 and every
  ``evaluation.interval``; ``checkpoint`` — every ``checkpoint.interval`` and the last step.
* **replays**: a stage the ledger marks done runs again after a restore (the weights
  must be rebuilt); one that does not replay gives back what its ledger record holds.
* **syncs_engine**: the rollout engine takes the trainer's weights before the stage,
  on every rank together (the stage generates).
* **limit_s**: the stage's default time limit, the default of ``timeouts.<name>_s``
  (a stage without such a field runs under this limit).
* **rerun**: ``fp8rl rerun --stage <name>`` can recompute the stage from persisted inputs.
* **ahead**: a stage of the rollout side. With ``rollout.max_staleness`` k ≥ 1, step t
  runs it for step t + k (step 1 for steps 1 … 1 + k, and for any step in t … t + k
  whose record is missing), before step t trains: step t then trains on rows sampled by
  policy version t − 1 − k. With k = 0 it runs for step t, as every other stage.
* **beside_rollout**: the stage may run while the rollout side works for a later step
  in a thread of the step (``stages/rollout_side.py``): it neither generates nor reads
  the sampler (train, calibrate). The step waits for the rollout side before any other.

Plain data (no torch, no pydantic, no Prefect), so that ``fp8rl --help``, the CLI's
stage choices and the config's time limits read it without the heavy imports. The
stage functions are bound in ``stages/dag.py``; the flow's runner is
``flows/campaign/flow.py``. A new stage is a row here, its function, and its binding.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterator

__all__ = ["STAGES", "Ranks", "StageSpec", "StageTable", "When"]


class Ranks(str, Enum):
    """How the ranks of a job run a stage (``stages.runtime.rank_outcome``)."""

    TOGETHER = "together"  # on_ranks: every rank, each attempt ending with rank 0's outcome
    MAIN = "main"  # on_main: rank 0 alone; the sampler and calibrator it moves are broadcast
    ALL = "all"  # on_all: a collective every rank enters at once


class When(str, Enum):
    """At which steps a stage runs."""

    STEP = "step"  # every step from 1
    SHADOW = "shadow"  # steps whose train stage ran the BF16 shadow passes
    EVAL = "eval"  # step 0 and every evaluation.interval
    CHECKPOINT = "checkpoint"  # every checkpoint.interval and the last step


@dataclass(frozen=True)
class StageSpec:
    """One stage of the campaign's DAG; see the module docstring for each field."""

    name: str
    ranks: Ranks
    retries: int
    when: When
    replays: bool
    syncs_engine: bool
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    limit_s: float
    rerun: bool = False
    waits_for_go: bool = False  # peers enter the body only after rank 0's go (its attempt opened)
    refill_rounds: bool = False  # DAPO's refill rounds run inside it, in the ledger as rollout1, rollout2, ...
    ahead: bool = False  # the rollout side: runs for step + rollout.max_staleness (see StageSpec's docs)
    beside_rollout: bool = False  # may run while the rollout side works for a later step (stages.rollout_side)

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"stage name {self.name!r} must be an identifier (it names timeouts.<name>_s)")
        if self.retries < 0 or self.limit_s <= 0:
            raise ValueError(f"stage {self.name}: retries must be >= 0 and limit_s > 0")
        if self.waits_for_go and self.ranks is not Ranks.TOGETHER:
            raise ValueError(f"stage {self.name}: only a stage the ranks run together waits for rank 0's go")


class StageTable:
    """The stages in DAG order; a stage added later names the stage it comes before."""

    def __init__(self, specs: tuple[StageSpec, ...]) -> None:
        self._specs: list[StageSpec] = []
        for s in specs:
            self.add(s)

    def add(self, spec: StageSpec, *, before: str | None = None) -> StageSpec:
        """Add ``spec`` at the end, or just before stage ``before``."""
        if spec.name in self:
            raise ValueError(f"stage {spec.name!r} is already in the table")
        at = len(self._specs) if before is None else self.names().index(self.get(before).name)
        self._specs.insert(at, spec)
        return spec

    def remove(self, name: str) -> None:
        self._specs.remove(self.get(name))

    def get(self, name: str) -> StageSpec:
        for s in self._specs:
            if s.name == name:
                return s
        raise KeyError(f"unknown stage {name!r}; valid: {', '.join(self.names())}")

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._specs)

    def producer(self, table: str) -> StageSpec:
        """The first stage that writes ``table``."""
        for s in self._specs:
            if table in s.writes:
                return s
        raise KeyError(f"no stage writes table {table!r}")

    def rerunnable(self) -> tuple[str, ...]:
        """The stages ``fp8rl rerun`` recomputes from persisted inputs, in DAG order."""
        return tuple(s.name for s in self._specs if s.rerun)

    def __iter__(self) -> Iterator[StageSpec]:
        return iter(tuple(self._specs))

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self._specs)


STAGES = StageTable(
    (
        StageSpec(
            "rollout", Ranks.TOGETHER, 2, When.STEP, replays=False, syncs_engine=True,
            reads=(), writes=("rollouts",), limit_s=3600.0, waits_for_go=True, ahead=True,
        ),
        StageSpec(
            "score", Ranks.TOGETHER, 2, When.STEP, replays=False, syncs_engine=True,
            reads=("rollouts",), writes=("scores", "rollouts"), limit_s=3600.0, rerun=True, waits_for_go=True,
            refill_rounds=True, ahead=True,
        ),
        StageSpec(
            "train", Ranks.ALL, 0, When.STEP, replays=True, syncs_engine=False,
            reads=("rollouts", "scores"), writes=("steps", "token_stats"), limit_s=3600.0, beside_rollout=True,
        ),
        StageSpec(
            "calibrate", Ranks.MAIN, 1, When.SHADOW, replays=True, syncs_engine=False,
            reads=("token_stats", "rollouts"), writes=("bounds",), limit_s=1800.0, rerun=True, beside_rollout=True,
        ),
        StageSpec(
            "evaluate", Ranks.TOGETHER, 2, When.EVAL, replays=False, syncs_engine=True,
            reads=(), writes=("evals", "eval_scores"), limit_s=3600.0, rerun=True,
        ),
        StageSpec(
            "checkpoint", Ranks.ALL, 2, When.CHECKPOINT, replays=True, syncs_engine=False,
            reads=(), writes=(), limit_s=1800.0,
        ),
    )
)  # fmt: skip
"""The campaign's DAG, one row per stage, in the order a step runs them."""
