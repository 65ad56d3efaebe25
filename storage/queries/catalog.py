"""The DuckDB catalog: an in-memory connection with one view per table.

``connect(root)`` — ``root`` is one run directory or a folder of them — returns
an in-memory DuckDB connection where each table of ``storage.tables.schemas`` is a
view over the *live* Parquet parts of every selected run, so runs compare in
one query::

    con = connect("runs/")
    con.sql("SELECT run_id, step, clipfrac_lower FROM steps ORDER BY run_id, step").fetchall()

Views, per table ``t``:

- ``t_variants``: every row, all variants (a re-run written as variant
  'whatif' sits beside 'main');
- ``t``: the campaign itself, ``WHERE variant = 'main'`` — queries written
  before any re-run keep their meaning after one.

Plus ``ledger`` / ``ledger_variants`` (from ``ledger.jsonl``), ``job_attempts``
(the cluster jobs of each run, from the ledger's ``job_attempt`` records), ``runs``
(one row per run directory) and ``catalog_problems`` (files skipped, with why).

How the views are built:

- live files are chosen from the file names (newest write per table, run,
  step, stage, variant; see ``storage.run.layout``), so nothing is read to plan;
- each file's Parquet header and footer magic are checked (a few bytes;
  :mod:`storage.parts.checks`); a truncated or foreign file is skipped and listed in ``catalog_problems``
  instead of failing every query on that table (``fp8rl doctor`` names it);
- each file's footer says what it holds (table, run id, step, variant in its
  key-value metadata; for files written before those keys, the ``run_id`` and
  ``step`` column statistics): a part whose footer disagrees with its location
  (a ``steps`` part in ``scores/``, another run's part copied into this run's
  partition) is skipped and listed the same way. Only the footer is read;
- DuckDB, the reader of every query, checks every part: building a table's
  view reads each listed footer, and a part it cannot read (damage that the
  checks above miss) fails the view; each part of that table is then read
  alone, the unreadable ones are skipped and listed, and the view is built
  again. A query that fails on a page finds its part the same way. Either way
  one damaged part costs its own rows only: the rest of its table and every
  other table stay queryable, and a table that still cannot be read fails only
  the queries that name it;
- ``run_id`` and ``step`` (BIGINT) are read from the files, which carry them
  (self-describing even when copied alone); the ``run=/step=`` hive path is
  what listing and ``runs=`` use, so DuckDB's own hive parsing is off (it
  would add a duplicate ``run`` column);
- ``read_parquet([...], union_by_name=true)`` unions evolving schemas; the
  table's schema is unioned in as an empty typed relation, so every contract
  column exists with its type even in a run that has no such file yet (a run
  with no eval gives an empty ``eval_scores``, not an error);
- ``token_stats`` adds the derived columns (ratios, over/under-clipped) as expressions;
  ``steps`` folds the rows written by different stages of one step into one.

Nothing is locked, and nothing is cached but DuckDB's verdicts on parts it
was asked about (per path, size and mtime: a part changed since is asked
about again): a campaign may write while queries run. A file that is set
aside between listing and reading (a retried stage) makes DuckDB raise an I/O
error; :func:`query` then re-lists the files and retries.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from storage.ledger.events import Ledger
from storage.parts.checks import identity_problem, kept_problem, quick_parquet_check, unreadable_parts
from storage.run.identity import no_uid_warning
from storage.run.layout import RunLayout, find_runs, live_parts, scan_parts
from storage.tables.schemas import STORED_TABLES, TABLES
from storage.tables.spec import MAIN_VARIANT, TableSpec

_SOURCE = "_catalog_source"
_PROBLEMS = "catalog_problems"
_EXCLUDED = "_catalog_excluded"  # files found corrupt on reading: (path, why), skipped from then on
_FILES = "_catalog_files"  # the files the views read now
_KEYS = ("run_id", "step", "variant")
_UNREADABLE_TABLE = "cannot be read as a whole"  # a table whose view fails on every read (see refresh)
_NOT_A_PART = (  # errors of the SQL itself, never of a part: no part is read to look for a damaged one
    duckdb.ParserException,
    duckdb.CatalogException,
    duckdb.BinderException,
    duckdb.PermissionException,
    duckdb.ConversionException,
    duckdb.OutOfRangeException,
    duckdb.TypeMismatchException,
    duckdb.InterruptException,
)


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _exclude(con: duckdb.DuckDBPyConnection, bad: list[tuple[str, str]]) -> None:
    con.executemany(f"INSERT INTO {_EXCLUDED} VALUES (?, ?)", bad)


def _excluded(con: duckdb.DuckDBPyConnection) -> dict[str, str]:
    return dict(con.sql(f"SELECT path, problem FROM {_EXCLUDED}").fetchall())


def connect(
    root: str | Path, *, runs: Iterable[str] | None = None, threads: int | None = None, sandbox: bool = True
) -> duckdb.DuckDBPyConnection:
    """Open an in-memory DuckDB connection with the views of the runs under ``root``.

    ``runs``: only these run ids (UnknownRun lists the available ones).
    Raises NotARunDirectory if ``root`` holds no run directory.
    ``sandbox``: SQL on the connection reads the run directories found now and
    nothing else (:func:`sandbox_runs`).
    """
    con = duckdb.connect(":memory:")
    if threads is not None:
        con.execute(f"SET threads = {int(threads)}")
    runs = list(runs) if runs else None
    infos = find_runs(root, runs)  # fail early, before creating anything
    con.execute(f"CREATE TABLE {_SOURCE} (root VARCHAR, run VARCHAR)")
    con.execute(f"CREATE TABLE {_EXCLUDED} (path VARCHAR, problem VARCHAR)")
    con.execute(f"CREATE TABLE {_FILES} (path VARCHAR)")
    if sandbox and runs is None:
        runs = [i.run_id for i in infos]  # the views keep to the runs the sandbox allows
    rows = [(str(Path(root).resolve()), r) for r in (runs or [None])]
    con.executemany(f"INSERT INTO {_SOURCE} VALUES (?, ?)", rows)
    if sandbox:
        sandbox_runs(con, [i.path for i in infos])
    refresh(con)
    return con


def sandbox_runs(con: duckdb.DuckDBPyConnection, run_dirs: Iterable[str | Path]) -> None:
    """Let SQL on ``con`` read files in ``run_dirs`` only, and install or load no extension.

    DuckDB's ``enable_external_access = false`` with ``allowed_directories``
    (each run directory as given and as resolved, so a symlinked run still
    reads), locked so SQL cannot change it back. Registered Arrow tables still
    work. A refused read is a ``duckdb.PermissionException``.
    """
    allowed = sorted({d for p in run_dirs for d in (os.path.abspath(p), os.path.realpath(p))})
    con.execute("SET allowed_directories = ?", [[d.rstrip("/") + "/" for d in allowed]])
    con.execute("SET autoinstall_known_extensions = false")
    con.execute("SET autoload_known_extensions = false")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def _source(con: duckdb.DuckDBPyConnection) -> tuple[str, list[str] | None]:
    rows = con.sql(f"SELECT root, run FROM {_SOURCE}").fetchall()
    runs = [r for _, r in rows if r is not None]
    return rows[0][0], (runs or None)


def _create_from_arrow(con: duckdb.DuckDBPyConnection, name: str, table: pa.Table) -> None:
    con.register("_arrow_in", table)
    try:
        con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT * FROM _arrow_in")
    finally:
        con.unregister("_arrow_in")


def _view_sql(spec: TableSpec, files: list[str]) -> str:
    empty = f"_schema_{spec.name}"
    if files:
        listing = "[" + ", ".join(_sql_str(f) for f in files) + "]"
        scan = f"read_parquet({listing}, union_by_name = true, hive_partitioning = false)"
        base = f"SELECT * FROM {empty} UNION ALL BY NAME SELECT * FROM {scan}"
    else:
        base = f"SELECT * FROM {empty}"
    if spec.derived:
        exprs = ", ".join(f"{expr} AS {name}" for name, expr, _ in spec.derived)
        base = f"SELECT *, {exprs} FROM ({base})"
    if spec.merge_rows:
        keys = ", ".join(_KEYS)
        base = f"SELECT {keys}, any_value(COLUMNS(* EXCLUDE ({keys}))) FROM ({base}) GROUP BY {keys}"
    return base


def _failing_sql(spec: TableSpec, why: str) -> str:
    """A view with the table's columns whose every read fails with ``why``."""
    return f"SELECT * FROM _schema_{spec.name}, (SELECT 1 FROM range(1) WHERE error({_sql_str(why)}) IS NULL)"


def _create_views(con: duckdb.DuckDBPyConnection, name: str, sql: str) -> None:
    con.execute(f"CREATE OR REPLACE VIEW {name}_variants AS {sql}")
    con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {name}_variants WHERE variant = '{MAIN_VARIANT}'")


def _first_line(err: BaseException) -> str:
    return next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)


def _live_files(
    spec: TableSpec, infos: list, problems: list[tuple[str, str]], excluded: Mapping[str, str] = {}
) -> list[str]:
    files: list[str] = []
    for info in infos:
        parts = scan_parts(RunLayout(info.path), spec.name, info.run_id)
        placed = []
        for p in parts:
            if p.link:
                problems.append((str(p.path), "a link, not a file the run's writer made; skipped (run `fp8rl doctor`)"))
            elif p.name is None:
                problems.append((str(p.path), "file name not written by fp8rl storage; ignored"))
            elif (
                str(p.path) not in excluded
                and quick_parquet_check(p.path) is None
                and (why := identity_problem(p, info.uid))
            ):
                problems.append((str(p.path), f"{why}; skipped (run `fp8rl doctor`)"))
            else:
                placed.append(p)  # (a misplaced part never hides the part it claims to replace)
        live, _ = live_parts(placed)
        for p in live:
            why = excluded.get(str(p.path)) or quick_parquet_check(p.path) or kept_problem(p.path)
            if why is None:
                files.append(str(p.path))
            elif os.path.exists(p.path):
                problems.append((str(p.path), f"{why}; skipped (run `fp8rl doctor`)"))
    return files


def _ledger_views(con: duckdb.DuckDBPyConnection, infos: list, problems: list[tuple[str, str]]) -> None:
    """The ``ledger`` views; a damaged ledger line (the ledger's one reading: ``Ledger.damage``) is a problem."""
    ledgers = []
    for info in infos:
        ledger = Ledger(info.path)
        ledgers.append(ledger.to_arrow(variant=None))
        problems += [
            (f"{ledger.path}:{line}", f"{what}; the ledger view lacks that record (run `fp8rl doctor`)")
            for line, severity, what in ledger.damage()
            if severity == "error"
        ]
    _create_from_arrow(
        con, "_ledger_rows", pa.concat_tables(ledgers) if ledgers else TABLES["ledger"].schema().empty_table()
    )
    con.execute("CREATE OR REPLACE VIEW ledger_variants AS SELECT * FROM _ledger_rows")
    con.execute(f"CREATE OR REPLACE VIEW ledger AS SELECT * FROM ledger_variants WHERE variant = '{MAIN_VARIANT}'")


JOB_ATTEMPTS = pa.schema(
    [
        ("run_id", pa.string()),
        ("attempt", pa.int64()),
        ("backend", pa.string()),
        ("job_id", pa.string()),
        ("nodes", pa.string()),
        ("state", pa.string()),
        ("exit_reason", pa.string()),
        ("resumed_from_step", pa.int64()),
        ("submitted_at", pa.string()),
        ("ended_at", pa.string()),
    ]
)


def _job_attempts_table(infos: list) -> pa.Table:
    """One row per cluster job of each run, in the order the jobs ended (``fp8rl submit``'s supervisor)."""
    rows = []
    for info in infos:
        for ev in Ledger(info.path).job_attempts():
            row = {k: ev.get(k) for k in JOB_ATTEMPTS.names}
            row["run_id"] = ev.get("run_id") or info.run_id
            rows.append({k: (str(v) if JOB_ATTEMPTS.field(k).type == pa.string() and v is not None else v)
                         for k, v in row.items()})  # fmt: skip
    return pa.Table.from_pylist(rows, schema=JOB_ATTEMPTS)


def _runs_table(infos: list) -> pa.Table:
    """One row per run directory: id, uid, where, config hash and the config changes taken at resume."""
    return pa.Table.from_pylist(
        [
            {
                "run_id": i.run_id,
                "path": str(i.path),
                "config_hash": i.config_hash,
                "created_at": i.created_at,
                "schema_version": i.schema_version,
                "uid": i.uid,
                "config_changes": json.dumps(
                    [{k: c.get(k) for k in ("at", "after_step", "keys", "to_hash")} for c in i.config_changes]
                )
                if i.config_changes
                else None,
            }
            for i in infos
        ],
        schema=pa.schema(
            [
                ("run_id", pa.string()),
                ("path", pa.string()),
                ("config_hash", pa.string()),
                ("created_at", pa.string()),
                ("schema_version", pa.int32()),
                ("uid", pa.string()),
                ("config_changes", pa.string()),
            ]
        ),
    )


def refresh(con: duckdb.DuckDBPyConnection, *, retries: int = 5) -> list[tuple[str, str]]:
    """(Re)build the views from the files now on disk; returns the problems found.

    Creating a view reads the listed files' schemas; if a concurrent writer
    sets one aside meanwhile, the table is listed again (up to ``retries`` times).
    """
    root, runs = _source(con)
    infos = find_runs(root, runs)
    problems: list[tuple[str, str]] = [(str(i.path), no_uid_warning(i)) for i in infos if i.uid is None]
    all_files: list[str] = []
    for name in STORED_TABLES:
        spec = TABLES[name]
        _create_from_arrow(con, f"_schema_{name}", spec.schema().empty_table())
        relisted = 0
        while True:
            found: list[tuple[str, str]] = []
            files = _live_files(spec, infos, found, _excluded(con))
            try:
                _create_views(con, name, _view_sql(spec, files))
                break
            except duckdb.Error as err:
                # building a view reads every listed footer (DuckDB is the check): a part it cannot read
                # fails the view, so find it, skip it and build again (each pass skips one at least); a
                # part that a writer set aside meanwhile (the file gone) means: list again
                if relisted < retries and not all(map(os.path.exists, files)):
                    relisted += 1
                    continue
                bad = unreadable_parts(files, err, data=False)
                if bad:
                    _exclude(con, bad)
                    continue
                why = f"table {name!r} {_UNREADABLE_TABLE} ({_first_line(err)}); queries of it fail"
                _create_views(con, name, _failing_sql(spec, why))  # the other tables stay queryable
                found.append((root, f"{why} (run `fp8rl doctor`)"))
                break
        problems += found
        all_files += files
    con.execute(f"DELETE FROM {_FILES}")
    if all_files:
        con.executemany(f"INSERT INTO {_FILES} VALUES (?)", [(f,) for f in all_files])

    _ledger_views(con, infos, problems)
    _create_from_arrow(con, "runs", _runs_table(infos))
    _create_from_arrow(con, "job_attempts", _job_attempts_table(infos))
    _create_from_arrow(
        con,
        _PROBLEMS,
        pa.table(
            {
                "path": pa.array([p for p, _ in problems], pa.string()),
                "problem": pa.array([w for _, w in problems], pa.string()),
            }
        ),
    )
    return problems


def problems(con: duckdb.DuckDBPyConnection) -> list[tuple[str, str]]:
    """Files the views skipped: (path, why)."""
    return con.sql(f"SELECT path, problem FROM {_PROBLEMS}").fetchall()


def set_params(con: duckdb.DuckDBPyConnection, params: Mapping[str, Any]) -> None:
    """``SET VARIABLE name = value`` for each param (named queries read them with getvariable)."""
    for name, value in params.items():
        if not str(name).isidentifier():
            raise ValueError(f"parameter name {name!r} is not an identifier")
        con.execute(f"SET VARIABLE {name} = ?", [value])


_READ_ONLY = ("SELECT", "EXPLAIN")


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Refuse SQL that would write (COPY … TO, CREATE, INSERT, ATTACH, SET, …): queries only read.

    Raises ``duckdb.ParserException`` for SQL that does not parse, StorageError otherwise.
    """
    from storage.errors import StorageError

    for st in con.extract_statements(sql):
        kind = st.type.name
        if kind not in _READ_ONLY:
            hint = "; use --out FILE (.parquet, .csv or .json) to save a result" if kind == "COPY" else ""
            raise StorageError(f"queries are read-only: {kind} statements are refused (only SELECT){hint}")


def _tables_named(sql: str) -> set[str]:
    """The stored tables whose names (or ``<table>_variants``) appear in ``sql`` as words."""
    return {t for t in STORED_TABLES if re.search(rf"\b{t}(_variants)?\b", sql)}


def query(con: duckdb.DuckDBPyConnection, sql: str, *, retries: int = 10) -> pa.Table:
    """Run ``sql`` and return the result as an arrow table.

    A part DuckDB cannot read (a page that does not decode, a length that
    points past the file's end) is found by reading the listed parts one by one
    (:func:`storage.parts.checks.unreadable_parts`), skipped, listed in
    ``catalog_problems``, and the query retried. A file set aside by a
    concurrent writer between listing and reading gives DuckDB an I/O error;
    the views are then rebuilt and the query retried (with a short growing
    pause, so a writer superseding files in a burst cannot win every race).
    """
    attempt = 0
    while True:
        try:
            rel = con.sql(sql)
            return rel.to_arrow_table() if rel is not None else pa.table({})
        except _NOT_A_PART:
            raise
        except duckdb.Error as err:
            if _UNREADABLE_TABLE in str(err):
                raise
            files = [f for (f,) in con.sql(f"SELECT path FROM {_FILES}").fetchall()]
            if all(map(os.path.exists, files)):
                # a part DuckDB cannot read (a page that does not decode, a length past the file's end):
                # find it, skip it, say so, retry (each pass skips one at least)
                # the parts of the tables the query names first (a part's path: tables/<t>/run=…/step=…/…)
                tables = _tables_named(sql)
                named = [f for f in files if Path(f).parts[-4] in tables]
                rest = [f for f in files if Path(f).parts[-4] not in tables]
                bad = unreadable_parts(named, err, data=True) or unreadable_parts(rest, err, data=True)
                if bad:
                    _exclude(con, bad)
                    refresh(con)
                    continue
                if not isinstance(err, duckdb.IOException):
                    raise
            # a file set aside by a concurrent writer (or an I/O error that may pass): list again, retry
            if attempt == retries:
                raise
            attempt += 1
            time.sleep(min(0.02 * attempt, 0.2))
            refresh(con)
