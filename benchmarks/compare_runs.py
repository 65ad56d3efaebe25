"""Are two runs numerically the same? Bit-for-bit comparison of every table a campaign writes.

A refactor that claims "numerics unchanged" runs the same campaign before and
after and compares the tables here. Timing columns (``*_seconds``, ``*_s``,
``*_per_second``) and bookkeeping columns (run id, attempt, write time) differ
between any two runs and are left out; every other value must be identical,
NaN included (NaN equals NaN here).

    python benchmarks/compare_runs.py RUN_A RUN_B [--tables steps,bounds,token_stats,rollouts,scores,evals,eval_scores]

List columns (token ids, per-token log-probs) are compared element by element,
their offsets included. A table neither run has is reported and passes; a table
only one of them has fails.

Exit 0 and one line per table when identical; exit 1 and the first differing
columns otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KEYS = {
    "steps": ("step",),
    "bounds": ("step",),
    "token_stats": ("step", "sample_id", "position"),
    "rollouts": ("step", "sample_id"),
    "scores": ("step", "sample_id"),
    "evals": ("step", "benchmark", "problem_id", "sample_index"),
    "eval_scores": ("step", "benchmark", "metric", "k"),
}
DEFAULT_TABLES = ",".join(KEYS)
BOOKKEEPING = {"run_id", "attempt", "variant", "created_at", "written_at"}


def is_timing(column: str) -> bool:
    return column.endswith(("_seconds", "_s", "_per_second"))


def as_arrays(column: pa.ChunkedArray) -> np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A flat column as one numpy array; a list column as (offsets, validity, flattened values)."""
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        arr = column.combine_chunks()
        valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False))
        offsets = np.asarray(arr.offsets.to_numpy())
        return offsets, valid, arr.flatten().to_numpy(zero_copy_only=False)
    return column.to_numpy(zero_copy_only=False)


def load(run_dir: Path, table: str) -> dict[str, np.ndarray | tuple] | None:
    """Columns of ``table`` (variant 'main'), sorted by the table's key, without timing or bookkeeping
    columns; None when the run has no such table."""
    from storage.queries.catalog import connect, query

    if not (run_dir / "tables" / table).is_dir():
        return None
    con = connect(run_dir)
    order = ", ".join(KEYS[table])
    t = query(con, f"SELECT * FROM {table} WHERE variant = 'main' ORDER BY {order}")
    return {c: as_arrays(t.column(c)) for c in t.column_names if c not in BOOKKEEPING and not is_timing(c)}


def same_column(a: np.ndarray | tuple, b: np.ndarray | tuple) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and all(map(same_column, a, b))
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "f" and b.dtype.kind == "f":
        return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    return bool(np.all((a == b) | ((a != a) & (b != b)))) if a.dtype.kind == "O" else np.array_equal(a, b)


def compare(run_a: Path, run_b: Path, table: str) -> list[str]:
    """Names of the columns that differ (a missing column counts), empty when the tables are identical."""
    a, b = load(run_a, table), load(run_b, table)
    if a is None or b is None:
        return [] if a is None and b is None else ["<table present in one run only>"]
    bad = sorted(set(a) ^ set(b))
    bad += [c for c in sorted(set(a) & set(b)) if not same_column(a[c], b[c])]
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--tables", default=DEFAULT_TABLES)
    args = ap.parse_args()
    failed = False
    for table in args.tables.split(","):
        bad = compare(args.run_a, args.run_b, table)
        cols = load(args.run_a, table) or load(args.run_b, table) or {}
        first = next(iter(cols.values()), ())
        n = len(first[1] if isinstance(first, tuple) else first)
        print(f"{table}: {'identical' if not bad else 'DIFFERENT in ' + ', '.join(bad[:10])} ({n} rows)")
        failed |= bool(bad)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
