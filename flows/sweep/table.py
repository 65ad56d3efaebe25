"""A sweep's comparison table: one row per cell (labels, seed, state, the ``paper-table`` and
failure-signal columns of its run), the mean over seeds with their spread, as ``table.csv`` and ``table.md``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flows.report.figures import FAILURE_COLUMNS, TABLE_COLUMNS, paper_table_markdown
from flows.sweep.spec import Cell, SweepSpec
from flows.sweep.state import CellOutcome, cell_state, run_name
from storage.run.layout import is_run_dir, write_text_atomic


def comparison_table(
    sweep_dir: Path, spec: SweepSpec, cells: list[Cell], outcomes: list[CellOutcome] | None = None
) -> list[dict]:
    """One row per cell: labels, seed, status, then the ``paper-table`` columns of its run."""
    from storage.queries import get_query
    from storage.queries.catalog import connect, query, set_params

    finished = ("done", "skipped", "same")
    status = {
        o.cell.id: ("failed" if o.status == "failed" else "finished" if o.status in finished else o.status)
        for o in outcomes or []
    }
    runs = {c.id: run_name(sweep_dir, c) for c in cells}  # a twin reads its counterpart's run
    have = sorted({r for r in runs.values() if is_run_dir(Path(sweep_dir) / r)})
    by_run: dict[str, dict] = {}
    if have:
        con = connect(sweep_dir, runs=have)
        for name, columns in (("paper-table", None), ("failure-signals", [c for c, _, _ in FAILURE_COLUMNS])):
            named = get_query(name)
            set_params(con, {k: d for k, (d, _) in named.params.items()})
            for r in query(con, named.sql).to_pylist():
                keep = r if columns is None else {k: r.get(k) for k in columns}
                by_run.setdefault(r["run_id"], {}).update(keep)
    rows = []
    for c in cells:
        state = status.get(c.id) or cell_state(sweep_dir, c)
        metrics = {k: v for k, v in by_run.get(runs[c.id], {}).items() if k != "run_id"}
        rows.append({"cell": c.id, **dict(c.labels), "seed": c.seed, "status": state, **metrics})
    return rows


def _mean_over_seeds(spec: SweepSpec, rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[a] for a in spec.axes), []).append(r)
    out = []
    for key, members in groups.items():
        row: dict[str, Any] = dict(zip(spec.axes, key))
        row["seeds"] = sum(m["status"] == "finished" for m in members)
        for col, _, _ in TABLE_COLUMNS + FAILURE_COLUMNS:
            vals = [m[col] for m in members if isinstance(m.get(col), (int, float)) and m[col] == m[col]]
            row[col] = sum(vals) / len(vals) if vals else None
            if col in SPREAD_COLUMNS:  # the seeds' spread, shown next to the mean
                header, scale = SPREAD_COLUMNS[col]
                row[header] = _spread(vals, scale)
        # a surge is an event, not a quantity: how many seeds had one, and when each began
        onsets = [m.get("first_surge_step") for m in members if m["status"] == "finished"]
        row["first_surge_step"] = None
        row["seeds with a surge"] = f"{sum(o is not None for o in onsets)}/{len(onsets)}" + (
            f" (steps {', '.join(str(int(o)) for o in onsets if o is not None)})"
            if any(o is not None for o in onsets)
            else ""
        )
        out.append(row)
    return out


# columns whose seed-to-seed spread the mean table shows: column -> (header, scale)
SPREAD_COLUMNS = {
    "best_eval_average": ("best eval % min–max (sd)", 100.0),
    "late_eval_average": ("2nd-half eval % min–max (sd)", 100.0),
    "lower_clip_vs_bf16": ("lower-clip vs BF16 min–max (sd)", 1.0),
    "garbled_last10": ("garbled last-10 % min–max (sd)", 100.0),
    "accuracy_last10": ("train acc last-10 % min–max (sd)", 100.0),
}
_TABLE_SPREADS = ("best_eval_average", "late_eval_average", "lower_clip_vs_bf16")  # the failure table has the rest


def _spread(vals: list[float], scale: float) -> str:
    """``min–max (sd)`` over the seeds (sample sd), scaled (100 for shares in %); "—" under 2 seeds."""
    if len(vals) < 2:
        return "—"
    mean = sum(vals) / len(vals)
    sd = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
    digits = 1 if scale == 100.0 else 2
    return f"{scale * min(vals):.{digits}f}–{scale * max(vals):.{digits}f} ({scale * sd:.{digits}f})"


def write_tables(sweep_dir: Path, spec: SweepSpec, rows: list[dict], extra: str = "") -> str:
    """Save ``table.csv`` (every column, raw values) and ``table.md`` (``extra`` markdown appended:
    the pilots' tables); return the markdown."""
    import csv
    import io

    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(Path(sweep_dir) / "table.csv", buf.getvalue())
    keys = list(spec.axes) + (["seed"] if len(spec.seeds) > 1 else [])
    if any(r["status"] != "finished" for r in rows):
        keys.append("status")
    md = f"## Sweep {spec.name}\n\n{paper_table_markdown(rows, keys)}\n"
    means = _mean_over_seeds(spec, rows) if len(spec.seeds) > 1 else []
    if means:
        spreads = [SPREAD_COLUMNS[c][0] for c in _TABLE_SPREADS]
        md += f"\n### Mean over seeds\n\n{paper_table_markdown(means, list(spec.axes) + ['seeds'] + spreads)}\n"
    md += (
        "\nShares in %; entropy in nats; NMAE and over-clipping on BF16 shadow steps; "
        "column definitions: `fp8rl query --list` (paper-table).\n"
    )
    md += f"\n### Failure signals\n\n{paper_table_markdown(rows, keys, FAILURE_COLUMNS)}\n"
    if means:
        spreads = tuple((h, h, "s") for c, (h, _) in SPREAD_COLUMNS.items() if c not in _TABLE_SPREADS)
        fail_cols = tuple(c for c in FAILURE_COLUMNS if c[0] != "first_surge_step") + spreads
        md += (
            f"\n### Failure signals, mean over seeds\n\n"
            f"{paper_table_markdown(means, list(spec.axes) + ['seeds', 'seeds with a surge'], fail_cols)}\n"
        )
    md += (
        "\nFailure signals (docs/method.md; `fp8rl query <dir> --named failure-signals`): an entropy "
        "surge is a step above 1.5x the median entropy of the previous 10 steps for at least 3 steps; a "
        "garbled response is one the task's answer parser cannot read; A<0 / A>0 clipped: the mean share "
        "of tokens clipped below L with negative advantage / above H with positive advantage.\n"
    )
    md += extra
    write_text_atomic(Path(sweep_dir) / "table.md", md)
    return md
