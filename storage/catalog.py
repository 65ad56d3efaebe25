"""The DuckDB catalog: an in-memory connection with one view per table.

``connect(root)`` — ``root`` is one run directory or a folder of them — returns
an in-memory DuckDB connection where each table of ``storage.schemas`` is a
view over the *live* Parquet parts of every selected run, so runs compare in
one query::

    con = connect("runs/")
    con.sql("SELECT run_id, step, clipfrac_lower FROM steps ORDER BY run_id, step").fetchall()

Views, per table ``t``:

- ``t_variants``: every row, all variants (a re-run written as variant
  'whatif' sits beside 'main');
- ``t``: the campaign itself, ``WHERE variant = 'main'`` — queries written
  before any re-run keep their meaning after one.

Plus ``ledger`` / ``ledger_variants`` (from ``ledger.jsonl``), ``runs`` (one
row per run directory) and ``catalog_problems`` (files skipped, with why).

How the views are built:

- live files are chosen from the file names (newest write per table, run,
  step, stage, variant; see ``storage.layout``), so nothing is read to plan;
- each file's Parquet header and footer magic are checked (a few bytes); a
  truncated or foreign file is skipped and listed in ``catalog_problems``
  instead of failing every query on that table (``fp8rl doctor`` names it);
- each file's footer says what it holds (table, run id, step, variant in its
  key-value metadata; for files written before those keys, the ``run_id`` and
  ``step`` column statistics): a part whose footer disagrees with its location
  (a ``steps`` part in ``scores/``, another run's part copied into this run's
  partition) is skipped and listed the same way. Only the footer is read;
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

Nothing is locked or cached: a campaign may write while queries run. A file
that is set aside between listing and reading (a retried stage) makes DuckDB
raise an I/O error; :func:`query` then re-lists the files and retries.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from storage.identity import no_uid_warning
from storage.layout import (
    META_RUN_ID,
    META_RUN_UID,
    META_STEP,
    META_VARIANT,
    Part,
    RunLayout,
    find_runs,
    live_parts,
    scan_parts,
)
from storage.ledger import Ledger
from storage.schemas import MAIN_VARIANT, META_TABLE, STORED_TABLES, TABLES, TableSpec

_SOURCE = "_catalog_source"
_PROBLEMS = "catalog_problems"
_EXCLUDED = "_catalog_excluded"  # files found corrupt on reading: (path, why), skipped from then on
_FILES = "_catalog_files"  # the files the views read now
_KEYS = ("run_id", "step", "variant")
_IDENTITY_KEYS = {"table": META_TABLE, "run_id": META_RUN_ID, "step": META_STEP, "variant": META_VARIANT}


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def quick_parquet_check(path: Path) -> str | None:
    """A cheap validity check: None if the file looks like complete Parquet, else why not.

    Reads 12 bytes: the leading and trailing 'PAR1' magic and the footer length.
    A file cut short by a crash or a partial copy loses its footer and fails here.
    """
    try:
        size = path.stat().st_size
        if size < 12:
            return f"truncated Parquet ({size} bytes)"
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(size - 8)
            tail = f.read(8)
    except OSError as err:
        return f"unreadable ({err.strerror or err})"
    if head != b"PAR1":
        return "not a Parquet file (bad leading magic)"
    footer_len, magic = struct.unpack("<I4s", tail)
    if magic != b"PAR1" or footer_len + 12 > size:
        return "truncated Parquet (no valid footer)"
    return None


def _stats_value(meta: Any, column: str) -> Any:
    """The one value of ``column`` per its row-group statistics, or None if unknown or not single-valued."""
    names = [meta.schema.column(i).name for i in range(meta.num_columns)]
    if column not in names or meta.num_row_groups == 0:
        return None
    idx, seen = names.index(column), set()
    for rg in range(meta.num_row_groups):
        st = meta.row_group(rg).column(idx).statistics
        if st is None or not st.has_min_max:
            return None
        seen |= {st.min, st.max}
    return seen.pop() if len(seen) == 1 else ("mixed", *sorted(map(str, seen)))


def _footer(path: Path) -> bytes | None:
    """The Thrift-encoded footer of a Parquet file (a few KB), or None if it has no valid one."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size < 12:
                return None
            f.seek(size - 8)
            length, magic = struct.unpack("<I4s", f.read(8))
            if magic != b"PAR1" or length + 12 > size:
                return None
            f.seek(size - 8 - length)
            return f.read(length)
    except OSError:
        return None


def _varint(b: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while i < len(b):
        value |= (b[i] & 0x7F) << shift
        i += 1
        if not b[i - 1] & 0x80:
            break
        shift += 7
    return value, i


def _footer_kv(footer: bytes, key: bytes) -> str | None:
    """The value of ``key`` in the footer's key-value metadata, found without parsing the footer.

    A ``KeyValue`` is Thrift compact ``0x18 <len> key 0x18 <len> value``; the
    key-value list follows the row groups (their statistics) in the footer, so
    its entry is the last match. None if absent (the caller then parses).
    """
    pattern = b"\x18" + bytes([len(key)]) + key + b"\x18"
    i = footer.rfind(pattern)
    if i < 0:
        return None
    length, j = _varint(footer, i + len(pattern))
    return footer[j : j + length].decode(errors="replace")


def _said_by_footer(path: Path) -> dict[str, str] | None:
    """What the part's footer says it holds (table, run_id, step, variant, and run_uid where it carries one),
    or None if it cannot be read."""
    import pyarrow.parquet as pq

    footer = _footer(path)
    if footer is not None:
        said = {k: v for k, key in _IDENTITY_KEYS.items() if (v := _footer_kv(footer, key)) is not None}
        if len(said) == len(_IDENTITY_KEYS):
            if (uid := _footer_kv(footer, META_RUN_UID)) is not None:
                said["run_uid"] = uid
            return said  # the common case: every key found in the raw footer
    try:
        meta = pq.read_metadata(path)
    except Exception:  # pyarrow raises several types; a damaged footer is found and named by footer_problem
        return None
    kv = meta.metadata or {}
    keys = {**_IDENTITY_KEYS, "run_uid": META_RUN_UID}
    said = {k: kv[key].decode(errors="replace") for k, key in keys.items() if key in kv}
    for col in ("run_id", "step"):
        if col not in said and (v := _stats_value(meta, col)) is not None:
            said[col] = str(v) if not isinstance(v, tuple) else "..".join(v[1:])
    return said


def identity_problem(part: Part, run_uid: str | None = None) -> str | None:
    """None if ``part``'s footer agrees with its location (table, run, step, variant) and with its run's
    uid (``run_uid``, from run.json; None for runs written before uids), else why not.

    Reads the footer only. A key the file does not carry (written before it was
    added) is taken from the column statistics, or not checked; in a run with a
    uid every part carries it, so a part without one was not written by this run.
    A footer that does not parse is left to :func:`footer_problem`.
    """
    said = _said_by_footer(part.path)
    if said is None:
        return None
    where = {
        "table": part.table,
        "run_id": part.run_id,
        "step": str(part.step),
        "variant": part.name.variant if part.name is not None else None,
    }
    wrong = [f"{k} {said[k]!r}" for k in where if k in said and where[k] is not None and said[k] != where[k]]
    if not wrong:
        if run_uid is None or said.get("run_uid") == run_uid:
            return None
        if "run_uid" not in said:
            return "part without its run's uid: not written by this run's writer"
        return f"part of another run (uid {said['run_uid'][:12]}…, this run's is {run_uid[:12]}…)"
    here = ", ".join(f"{k} {where[k]!r}" for k in where if where[k] is not None)
    return f"misplaced part: it holds {', '.join(wrong)} but its location is {here}"


def footer_problem(path: str | Path, con: duckdb.DuckDBPyConnection | None = None) -> str | None:
    """None if DuckDB can read ``path``'s Parquet footer (its schema), else why not (one line)."""
    con = con or duckdb.connect(":memory:")
    try:
        con.execute(f"DESCRIBE SELECT * FROM read_parquet({_sql_str(str(path))})").fetchall()
    except duckdb.Error as err:
        return f"corrupt Parquet footer ({_first_line(err)})"
    return None


def pages_problem(path: str | Path) -> str | None:
    """None if every page of ``path`` decodes (reads the whole file), else why not (one line)."""
    import pyarrow.parquet as pq

    try:
        pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for damaged files
        return f"corrupt Parquet data ({type(err).__name__}: {_first_line(err)})"
    return None


def _first_line(err: BaseException) -> str:
    return next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)


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
            why = excluded.get(str(p.path)) or quick_parquet_check(p.path)
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
        for attempt in range(retries + 1):
            found: list[tuple[str, str]] = []
            files = _live_files(spec, infos, found, _excluded(con))
            try:
                con.execute(f"CREATE OR REPLACE VIEW {name}_variants AS {_view_sql(spec, files)}")
                con.execute(
                    f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {name}_variants WHERE variant = '{MAIN_VARIANT}'"
                )
                break
            except duckdb.IOException:
                if attempt == retries or all(os.path.exists(f) for f in files):
                    raise
            except duckdb.Error:
                # a file whose footer DuckDB cannot parse fails the whole view: find it, skip it
                bad = [(f, why) for f in files if (why := footer_problem(f)) is not None]
                if not bad or attempt == retries:
                    raise
                _exclude(con, bad)
        problems += found
        all_files += files
    con.execute(f"DELETE FROM {_FILES}")
    if all_files:
        con.executemany(f"INSERT INTO {_FILES} VALUES (?)", [(f,) for f in all_files])

    _ledger_views(con, infos, problems)
    _create_from_arrow(con, "runs", _runs_table(infos))
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


def query(con: duckdb.DuckDBPyConnection, sql: str, *, retries: int = 10) -> pa.Table:
    """Run ``sql`` and return the result as an arrow table.

    A file set aside by a concurrent writer between listing and reading gives
    DuckDB an I/O error; the views are then rebuilt and the query retried (with
    a short growing pause, so a writer superseding files in a burst cannot win
    every race).
    """
    for attempt in range(retries + 1):
        try:
            rel = con.sql(sql)
            return rel.to_arrow_table() if rel is not None else pa.table({})
        except duckdb.IOException:
            if attempt == retries:
                raise
            time.sleep(min(0.02 * (attempt + 1), 0.2))
            refresh(con)
        except (duckdb.ParserException, duckdb.CatalogException, duckdb.BinderException, duckdb.PermissionException):
            raise
        except duckdb.Error:
            # a data page DuckDB cannot decode: find the file(s), skip them, say so, retry
            files = [f for (f,) in con.sql(f"SELECT path FROM {_FILES}").fetchall()]
            bad = [(f, why) for f in files if (why := pages_problem(f)) is not None]
            if not bad or attempt == retries:
                raise
            _exclude(con, bad)
            refresh(con)
    raise AssertionError("unreachable")
