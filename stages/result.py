"""What a stage returns besides the new state: :class:`StageResult`.

Every stage is ``run_<stage>(env, state, step, *, attempt) -> (StageResult, TrainState)``.
The flow records ``outputs`` and :meth:`StageResult.ledger_info` in the ledger,
adds ``seconds`` (and ``timings``) to the step's ``steps`` row, and reads the
typed fields it acts on: ``shadow`` (train ran the BF16 shadow passes, so the
step calibrates), ``scores`` (an evaluation), ``sampler`` (where rollout and
score left the prompt sampler, restored when a step is resumed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StageResult:
    """One stage's outcome on one step (rank 0's; other ranks may return an empty one)."""

    outputs: list[str] = field(default_factory=list)  # files written (Parquet parts, checkpoint dir)
    seconds: float = 0.0  # the stage's own wall time
    metrics: dict[str, float] = field(default_factory=dict)  # train: the step's ``steps`` row
    shadow: bool = False  # train: the BF16 shadow passes ran (``steps.shadow``)
    scores: dict[str, float] = field(default_factory=dict)  # evaluate: ``<benchmark>/<metric>`` -> value
    sampler: dict | None = None  # rollout, score: the sampler position after the stage
    timings: dict[str, float] = field(default_factory=dict)  # extra ``steps`` columns (engine memory, refills)
    info: dict[str, Any] = field(default_factory=dict)  # other facts for the ledger (counts, bounds, ...)

    def ledger_info(self) -> dict[str, Any]:
        """What the ledger keeps of this result (everything but the outputs and the metrics)."""
        out = {**self.info, "seconds": self.seconds}
        if self.sampler is not None:
            out["sampler"] = self.sampler
        if self.scores:
            out["scores"] = self.scores
        return out | self.timings

    # Read access by name, for callers written against the dict stages used to return.
    def __getitem__(self, key: str) -> Any:
        if key in ("outputs", "seconds", "metrics", "shadow", "scores", "sampler"):
            return getattr(self, key)
        merged = self.ledger_info()
        return merged[key]

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default
