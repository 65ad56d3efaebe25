"""``fp8rl query`` and ``fp8rl doctor``: SQL over a campaign's tables, and a health check.

    fp8rl query runs/ "SELECT run_id, step, clipfrac_lower FROM steps ORDER BY 1, 2"
    fp8rl query runs/ --named calibration-history --format csv
    fp8rl query runs/ --named entropy-bins --param bin_width=0.5 --out bins.parquet
    fp8rl query --list
    fp8rl doctor runs/tiny-cpu-20260101-120000

User errors (no run directory there, unknown run id, SQL that does not parse or
bind) print one line ``error: ...`` on stderr and exit 2, without traceback.
"""

from __future__ import annotations

import json
import math
import sys
from enum import Enum
from pathlib import Path
from typing import Any, Optional

import typer

from flows.commands.common import fail as _fail
from flows.commands.common import io_errors, refuse_run_paths


class Format(str, Enum):
    """Output formats of ``fp8rl query``."""

    table = "table"
    csv = "csv"
    json = "json"


FORMATS = tuple(f.value for f in Format)
OUT_SUFFIXES = (".parquet", ".csv", ".json")


def _one_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return " ".join(lines[:1] + [ln for ln in lines[1:] if ln.startswith("LINE")][:1])


def _cell(v: Any, width: int = 60) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return "NaN" if math.isnan(v) else f"{v:.6g}"
    s = str(v)
    return s if len(s) <= width else s[: width - 1] + "…"


def format_table(table, max_rows: int) -> str:
    """An aligned plain-text table of the first ``max_rows`` rows (0 = all)."""
    n = table.num_rows
    shown = table.slice(0, max_rows) if max_rows and n > max_rows else table
    cols = shown.column_names
    rows = [[_cell(v) for v in r.values()] for r in shown.to_pylist()]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]
    numeric = [all(_is_num(r[i]) for r in rows) and bool(rows) for i in range(len(cols))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric)).rstrip()

    out = [line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows]
    tail = f"({n} row{'s' if n != 1 else ''})"
    if shown.num_rows < n:
        tail += f", first {shown.num_rows} shown; --max-rows 0 for all, or --format csv / --out FILE"
    return "\n".join(out + [tail])


def _is_num(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return s == "NULL"


def _flat(table):
    """Nested columns (lists, structs) as JSON text, for CSV."""
    import pyarrow as pa

    for i, f in enumerate(table.schema):
        if pa.types.is_nested(f.type):
            text = pa.array(
                [None if v is None else json.dumps(v, default=str) for v in table.column(i).to_pylist()], pa.string()
            )
            table = table.set_column(i, f.name, text)
    return table


def _records(table) -> list[dict]:
    def clean(v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return [{k: clean(v) for k, v in r.items()} for r in table.to_pylist()]


def _write_csv(table, sink) -> None:
    import pyarrow.csv as pacsv

    pacsv.write_csv(_flat(table), sink)


def _emit(table, fmt: str, out: Optional[Path], max_rows: int) -> None:
    import pyarrow.parquet as pq

    if out is not None:
        suffix = out.suffix.lower()
        if suffix == ".parquet":
            pq.write_table(table, out, compression="zstd")
        elif suffix == ".csv":
            _write_csv(table, str(out))
        else:
            out.write_text(json.dumps(_records(table), default=str, indent=1) + "\n")
        typer.echo(f"wrote {table.num_rows} rows to {out}", err=True)
    elif fmt == "csv":
        sys.stdout.flush()
        _write_csv(table, sys.stdout.buffer)
    elif fmt == "json":
        typer.echo(json.dumps(_records(table), default=str, indent=1))
    else:
        typer.echo(format_table(table, max_rows))


def _parse_params(items: list[str]) -> dict[str, Any]:
    from storage.queries import parse_value

    params = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip().isidentifier():
            raise _fail(f"--param {item!r}: expected name=value, e.g. bin_width=0.5")
        params[name.strip()] = parse_value(value)
    return params


def query_command(
    root: Optional[Path] = typer.Argument(None, help="A run directory, or a folder of run directories."),
    sql: Optional[str] = typer.Argument(None, help="SQL over the views (steps, token_stats, bounds, ...)."),
    named: Optional[str] = typer.Option(None, "--named", "-n", help="Run a shipped query instead (see --list)."),
    list_: bool = typer.Option(False, "--list", help="List the shipped queries with their descriptions."),
    run: list[str] = typer.Option([], "--run", "-r", help="Only this run id (repeatable)."),
    param: list[str] = typer.Option([], "--param", "-p", help="Query parameter name=value (repeatable)."),
    fmt: Format = typer.Option(Format.table, "--format", "-f", help="Output format."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write to FILE (.parquet, .csv or .json) instead."),
    max_rows: int = typer.Option(100, "--max-rows", help="Rows shown in table format (0 = all)."),
) -> None:
    """Query a campaign's tables with DuckDB SQL (views: steps, token_stats, bounds, evals, ...)."""
    import duckdb

    from storage.errors import StorageError
    from storage.queries import get_query, list_queries
    from storage.queries.catalog import check_read_only, connect, problems, query, set_params

    if list_:
        for q in list_queries():
            typer.echo(f"{q.name}\n    {q.description}")
            for p, (default, doc) in q.params.items():
                typer.echo(f"    --param {p}={default}  {doc}")
        return
    if root is None:
        raise _fail("missing ROOT: a run directory or a folder of run directories (or use --list)")
    if (sql is None) == (named is None):
        raise _fail(
            "give either SQL or --named NAME (not both)" if sql else "missing SQL (or --named NAME; see --list)"
        )
    fmt = Format(fmt).value
    if out is not None and out.suffix.lower() not in OUT_SUFFIXES:
        raise _fail(f"--out {out}: the extension must be one of {', '.join(OUT_SUFFIXES)}")
    if out is not None:
        refuse_run_paths(out)
    params = _parse_params(param)
    try:
        if named is not None:
            q = get_query(named)
            unknown = sorted(set(params) - set(q.params))
            if unknown:
                allowed = ", ".join(q.params) or "none"
                raise _fail(f"query {named!r} has no parameter {unknown[0]!r} (parameters: {allowed})")
            params = {**{k: d for k, (d, _) in q.params.items()}, **params}
            sql = q.sql
        con = connect(root, runs=run or None)
        check_read_only(con, sql)
        set_params(con, params)
        try:
            result = query(con, sql)
        finally:  # after the query: it may have found (and skipped) a corrupt file
            for path, why in problems(con):
                typer.echo(f"warning: {path}: {why}", err=True)
    except StorageError as err:
        raise _fail(str(err))
    except duckdb.ParserException as err:
        raise _fail(f"SQL syntax error: {_one_line(err).removeprefix('Parser Error: ')}")
    except duckdb.PermissionException as err:
        why = _one_line(err).removeprefix("Permission Error: ").split(" - ")[0]
        raise _fail(
            f"{why}: queries read the run directories under {root} only (no other files, no URLs, no extensions)"
        )
    except duckdb.CatalogException as err:
        views = "steps, token_stats, bounds, rollouts, scores, evals, eval_scores, ledger, runs (+ <table>_variants)"
        raise _fail(f"{_one_line(err)} (views: {views})")
    except duckdb.Error as err:
        raise _fail(_one_line(err))
    with io_errors(out):  # a read-only or full file system under --out: one line
        _emit(result, fmt, out, max_rows)


def doctor_command(
    run_dir: Path = typer.Argument(..., help="A run directory, or a folder of run directories."),
    deep: bool = typer.Option(
        False,
        "--deep",
        help="Also decode every Parquet page and hash every checkpoint file and the base policy (slower).",
    ),
) -> None:
    """Check tables, ledger and checkpoints of a run; exit 1 if anything is broken."""
    from stages.bootstrap.integrity import base_policy_problems
    from storage.doctor import ERROR, Problem, check
    from storage.errors import StorageError

    try:
        found = check(run_dir, deep=deep)
        if deep:  # the base policy each run records, hashed again
            found += [Problem(*p) for p in base_policy_problems(run_dir)]
    except StorageError as err:
        raise _fail(str(err))
    for p in found:
        typer.echo(str(p), err=p.severity == ERROR)
    errors = sum(p.severity == ERROR for p in found)
    warnings = len(found) - errors
    if errors:
        typer.echo(f"{errors} error(s), {warnings} warning(s) in {run_dir}", err=True)
        raise typer.Exit(1)
    typer.echo(f"ok: {run_dir}" + (f" ({warnings} warning(s))" if warnings else ""))


def register(app: typer.Typer) -> None:
    """Add ``query`` and ``doctor`` to the ``fp8rl`` app."""
    app.command("query")(query_command)
    app.command("doctor")(doctor_command)
