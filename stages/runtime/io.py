"""Reading a step's inputs back from the run's Parquet tables.

Stages read what earlier stages wrote (live files only: superseded and shadowed
files are ignored), so any stage can be re-run from persisted inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from storage.parts.writer import read_step_rows
from storage.run.layout import RunLayout, read_run_info


@dataclass(frozen=True)
class RunTables:
    """What :func:`read_step` needs of a run, without a model or an engine (sweeps, reports)."""

    layout: RunLayout
    run_id: str
    variant: str = "main"
    input_variant: str | None = None

    @classmethod
    def open(cls, run_dir: str | Path, variant: str = "main") -> "RunTables":
        return cls(RunLayout(Path(run_dir)), read_run_info(run_dir).run_id, variant)


def read_step(ctx, table: str, step: int, *, stages: tuple[str, ...] | None = None) -> pa.Table:
    """Rows of ``table`` for ``step`` (this run; the variant it reads), concatenated in file order."""
    return read_step_rows(ctx.layout, ctx.run_id, table, step, variant=ctx.input_variant or ctx.variant, stages=stages)


def shadow_steps(ctx, steps) -> list[int]:
    """The steps of ``steps`` whose train stage ran the BF16 shadow passes, from ``steps.shadow``.

    The train stage records the schedule's decision (fixed K, drift, or a guard's
    remedy) in its ``steps`` row; this is the one place that decision is read
    back (re-runs, sweeps, reports, replays), so no reader re-derives a rule.
    Steps without a ``steps`` row (not trained) are left out.
    """
    out = []
    for s in steps:
        try:
            row = read_step(ctx, "steps", s)
        except FileNotFoundError:
            continue
        vals = [v for v in row.column("shadow").to_pylist() if v is not None] if "shadow" in row.column_names else []
        if vals and vals[-1]:
            out.append(s)
    return out
