"""Reading a step's inputs back from the run's Parquet tables.

Stages read what earlier stages wrote (live files only: superseded and shadowed
files are ignored), so any stage can be re-run from persisted inputs.
"""

from __future__ import annotations

import pyarrow as pa

from storage.layout import live_parts, scan_parts
from storage.writer import read_table


def read_step(ctx, table: str, step: int, *, stages: tuple[str, ...] | None = None) -> pa.Table:
    """Rows of ``table`` for ``step`` (this run, this variant), concatenated in file order."""
    parts = [p for p in scan_parts(ctx.layout, table, ctx.run_id) if p.step == step]
    live, _ = live_parts(parts)
    tables = [
        read_table(p.path)
        for p in live
        if p.name.variant == (ctx.input_variant or ctx.variant) and (stages is None or p.name.stage in stages)
    ]
    if not tables:
        raise FileNotFoundError(f"no live {table} rows for step {step} of run {ctx.run_id} (variant {ctx.variant})")
    return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
