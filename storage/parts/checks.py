"""Is a Parquet part what it claims to be? Cheap checks of one file, cheapest first.

- :func:`quick_parquet_check`: 12 bytes -- the leading and trailing ``PAR1``
  magic and the footer length (a file cut short loses its footer);
- :func:`identity_problem`: the footer only -- the table, run id, step, variant
  and run uid the part says it holds, against its location (found in the raw
  footer bytes where possible, else from the parsed metadata and the column
  statistics of files written before those keys);
- :func:`footer_problem`: DuckDB reads the footer's schema;
- :func:`data_problem`: DuckDB decodes every page (reads the whole file).

The first two are cheap enough to run on every part each time a run is
listed. DuckDB, the reader of every query, has the last word: the
catalog's views read every listed part's footer when they are built, and when
that (or a query) fails, :func:`unreadable_parts` asks DuckDB about each part
alone to name the ones it cannot read. Its verdicts are kept per (path, size,
mtime), so a part is judged once while it is unchanged. The catalog
(:mod:`storage.queries.catalog`) skips a part that fails a check and lists it in
``catalog_problems``; ``fp8rl doctor`` names it.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import duckdb

from storage.run.layout import META_RUN_ID, META_RUN_UID, META_STEP, META_VARIANT, Part
from storage.tables.spec import META_TABLE

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
    return _judged("footer", path, con)


def data_problem(path: str | Path, con: duckdb.DuckDBPyConnection | None = None) -> str | None:
    """None if DuckDB decodes every page of ``path`` (reads the whole file), else why not (one line)."""
    return _judged("data", path, con)


_SQL = {
    "footer": "DESCRIBE SELECT * FROM read_parquet({})",
    "data": "SELECT bit_xor(hash(t)) FROM read_parquet({}) t",  # hashes each whole row: every column decodes
}
_WHAT = {"footer": "corrupt Parquet footer", "data": "corrupt Parquet data"}
_VERDICTS: dict[tuple[str, str, int, int], str | None] = {}
_MAX_VERDICTS = 20_000  # a few MB at most; cleared when full


def _judged(kind: str, path: str | Path, con: duckdb.DuckDBPyConnection | None) -> str | None:
    """DuckDB's verdict on ``path`` (``kind``: footer or data), kept per (path, size, mtime): parts never
    change in place, and a file that does is judged again."""
    try:
        st = os.stat(path)
    except OSError as err:
        return f"unreadable ({err.strerror or err})"
    key = (kind, str(path), st.st_size, st.st_mtime_ns)
    if key in _VERDICTS:
        return _VERDICTS[key]
    con = con or duckdb.connect(":memory:")
    try:
        con.execute(_SQL[kind].format(_sql_str(str(path)))).fetchall()
        why = None
    except duckdb.Error as err:
        quoted = f'"{path}"'  # (the path is the subject of the line already)
        why = f"{_WHAT[kind]} ({_first_line(err).replace(f' from file {quoted}', '')})"
    if len(_VERDICTS) >= _MAX_VERDICTS:
        _VERDICTS.clear()
    _VERDICTS[key] = why
    return why


def kept_problem(path: str | Path) -> str | None:
    """Why DuckDB could not read ``path`` when it was last asked, if the file has not changed since (else None).

    A catalog lists a part found unreadable once without giving it to DuckDB again.
    """
    if not _VERDICTS:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return next((why for kind in _SQL if (why := _VERDICTS.get((kind, str(path), st.st_size, st.st_mtime_ns)))), None)


def forget_verdicts() -> None:
    """Drop the kept verdicts (a benchmark measures the first look at a damaged part with it)."""
    _VERDICTS.clear()


def unreadable_parts(files: list[str], error: BaseException, *, data: bool) -> list[tuple[str, str]]:
    """The parts among ``files`` that DuckDB cannot read, each alone: ``(path, why)``.

    ``error`` is the failure that raised the question; a part it names is asked
    about first, and if that one is unreadable the others are not read. ``data``:
    decode every page (a query failed), not only the footer (a view failed).
    """
    said = str(error)
    named = [f for f in files if f in said]
    con = duckdb.connect(":memory:")
    for group in (named, [f for f in files if f not in named]):
        bad = [(f, why) for f in group if (why := footer_problem(f, con) or (data_problem(f, con) if data else None))]
        if bad:
            return bad
    return []


def _first_line(err: BaseException) -> str:
    return next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
