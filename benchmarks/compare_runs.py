"""Are two runs numerically the same? Bit-for-bit comparison of their ``steps``, ``bounds`` and ``token_stats``.

A refactor that claims "numerics unchanged" runs the same campaign before and
after and compares the tables here. Timing columns (``*_seconds``, ``*_s``,
``*_per_second``) and bookkeeping columns (run id, attempt, write time) differ
between any two runs and are left out; every other value must be identical,
NaN included (NaN equals NaN here).

    python benchmarks/compare_runs.py RUN_A RUN_B [--tables steps,bounds,token_stats]

Exit 0 and one line per table when identical; exit 1 and the first differing
columns otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

KEYS = {"steps": ("step",), "bounds": ("step",), "token_stats": ("step", "sample_id", "position")}
BOOKKEEPING = {"run_id", "attempt", "variant", "created_at", "written_at"}


def is_timing(column: str) -> bool:
    return column.endswith(("_seconds", "_s", "_per_second"))


def load(run_dir: Path, table: str) -> dict[str, np.ndarray]:
    """Columns of ``table`` (variant 'main'), sorted by the table's key, without timing or bookkeeping columns."""
    from storage.catalog import connect, query

    con = connect(run_dir)
    order = ", ".join(KEYS[table])
    t = query(con, f"SELECT * FROM {table} WHERE variant = 'main' ORDER BY {order}")
    return {
        c: t.column(c).to_numpy(zero_copy_only=False)
        for c in t.column_names
        if c not in BOOKKEEPING and not is_timing(c)
    }


def same_column(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "f" and b.dtype.kind == "f":
        return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    return bool(np.all((a == b) | ((a != a) & (b != b)))) if a.dtype.kind == "O" else np.array_equal(a, b)


def compare(run_a: Path, run_b: Path, table: str) -> list[str]:
    """Names of the columns that differ (a missing column counts), empty when the tables are identical."""
    a, b = load(run_a, table), load(run_b, table)
    bad = sorted(set(a) ^ set(b))
    bad += [c for c in sorted(set(a) & set(b)) if not same_column(a[c], b[c])]
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--tables", default="steps,bounds,token_stats")
    args = ap.parse_args()
    failed = False
    for table in args.tables.split(","):
        bad = compare(args.run_a, args.run_b, table)
        n = len(next(iter(load(args.run_a, table).values()), []))
        print(f"{table}: {'identical' if not bad else 'DIFFERENT in ' + ', '.join(bad[:10])} ({n} rows)")
        failed |= bool(bad)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
