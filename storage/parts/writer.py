"""Write table rows as Parquet parts, atomically, one new file per stage attempt.

A write never modifies an existing file. ``TableWriter.write`` converts the
rows to the table's schema, writes ``tmp/<write_id>.parquet.tmp`` (outside
every read glob), fsyncs it and renames it into
``tables/<table>/run=<id>/step=<n>/part-<stage>-<attempt>-<write_id>-<variant>.parquet``.
A reader therefore sees either nothing or the whole file: a process killed
mid-write leaves only a ``.tmp`` that no query reads.

Retries: writing the same (table, run, step, stage, variant) again — a retried
or re-run stage — makes the new file live and moves the older one to
``superseded/`` (same relative path). If the process dies between the rename
and that move, both files exist for a moment; the catalog still reads only the
newest (``write_id`` is time-ordered), so rows are never duplicated.

Parquet settings: zstd level 1 (higher levels cost write speed and gain <1%
on float data); noisy floats BYTE_STREAM_SPLIT, counting ids and positions
DELTA_BINARY_PACKED, repeated values dictionary-encoded (see
``storage.tables.schemas``); min/max statistics on every column except the noisy
floats; row groups of up to ``row_group_size`` rows (1M by default: large
enough for DuckDB to scan fast, small enough to parallelize over big files).
Measured: ~4M token rows per CPU-second, 18.7 bytes/row (benchmarks/storage_scale.py).
"""

from __future__ import annotations

import numbers
import os
import re
import sys
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage import faults
from storage.errors import CorruptFile, SchemaError
from storage.run.layout import (
    META_RUN_ID,
    META_RUN_UID,
    META_STEP,
    META_VARIANT,
    Part,
    RunLayout,
    live_parts,
    new_write_id,
    parse_part_name,
    part_name,
    rank_of_part,
    read_run_info,
    scan_parts,
    stage_of_part,
)
from storage.tables.schemas import STORED_TABLES, get_table
from storage.tables.spec import MAIN_VARIANT, TableSpec

Rows = pa.Table | pa.RecordBatch | Mapping[str, Any] | Sequence[Mapping[str, Any]]
ALL_STEPS = range(0, sys.maxsize)
_COLUMN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KEYS = ("run_id", "step", "variant")


def _as_array(name: str, value: Any) -> pa.Array | pa.ChunkedArray:
    if isinstance(value, (pa.Array, pa.ChunkedArray)):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        return pa.array(value)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as err:
        raise SchemaError(f"column {name!r}: cannot convert to an arrow array ({err})") from None


def _is_scalar(value: Any) -> bool:
    if isinstance(value, (str, bytes, bool, numbers.Number, np.generic)) or value is None:
        return True
    return hasattr(value, "ndim") and getattr(value, "ndim") == 0


def rows_to_table(rows: Rows) -> pa.Table:
    """Normalize the accepted row shapes to a pyarrow Table.

    - ``pa.Table`` / ``pa.RecordBatch``;
    - a dict of columns (numpy arrays, lists, torch tensors, arrow arrays);
      scalar values are broadcast to the column length; a dict whose values are
      *all* scalars is one row (the ``steps`` use: ``{"reward_mean": 0.4, ...}``);
    - a list of dicts, one per row.
    """
    if isinstance(rows, pa.Table):
        return rows
    if isinstance(rows, pa.RecordBatch):
        return pa.Table.from_batches([rows])
    if isinstance(rows, Mapping):
        scalars = {k: v for k, v in rows.items() if _is_scalar(v)}
        if len(scalars) == len(rows):
            return pa.Table.from_pylist([{k: (v.item() if hasattr(v, "item") else v) for k, v in rows.items()}])
        arrays = {k: _as_array(k, v) for k, v in rows.items() if k not in scalars}
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) > 1:
            sizes = ", ".join(f"{k}={len(a)}" for k, a in arrays.items())
            raise SchemaError(f"columns have different lengths: {sizes}")
        n = lengths.pop()
        cols = {}
        for k, v in rows.items():
            if k in scalars:
                v = v.item() if hasattr(v, "item") else v
                cols[k] = pa.repeat(pa.scalar(v), n) if v is not None else pa.nulls(n)
            else:
                cols[k] = arrays[k]
        return pa.table(cols)
    if isinstance(rows, Sequence) and not isinstance(rows, (str, bytes)):
        if rows and not all(isinstance(r, Mapping) for r in rows):
            raise SchemaError("a list of rows must hold dicts (column name -> value)")
        return pa.Table.from_pylist(list(rows))
    raise SchemaError(
        f"cannot write rows of type {type(rows).__name__}: pass a pa.Table, a dict of columns or a list of dicts"
    )


def conform(spec: TableSpec, table: pa.Table, *, run_id: str, step: int, variant: str) -> pa.Table:
    """Cast ``table`` to ``spec``'s schema and stamp the key columns.

    Schema columns are cast (an impossible cast names the column); missing
    optional ones become NULL; missing required ones are an error. Derived
    columns (token_stats ratios) are dropped. A column the schema does not
    declare is an error naming it (``steps`` declares its ``*_seconds`` timing
    family by pattern, stored as float64).
    """
    n = table.num_rows
    expected = {"run_id": run_id, "step": step, "variant": variant}
    for key, want in expected.items():
        if key in table.column_names:
            seen = set(table.column(key).unique().to_pylist())
            if seen - {want}:
                raise SchemaError(
                    f"{spec.name}: column {key!r} holds {sorted(map(str, seen))[:3]}, but this write "
                    f"is for {key}={want!r}"
                )
    derived = {d[0] for d in spec.derived}
    given = {name: table.column(name) for name in table.column_names if name not in derived and name not in _KEYS}
    arrays: list[pa.Array | pa.ChunkedArray] = []
    fields: list[pa.Field] = []
    schema = spec.schema()
    for f in schema:
        if f.name in expected:
            arr = pa.repeat(pa.scalar(expected[f.name], f.type), n)
        elif f.name in given:
            col = given.pop(f.name)
            try:
                arr = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
                raise SchemaError(f"{spec.name}.{f.name}: cannot store {col.type} as {f.type} ({err})") from None
            if not f.nullable and arr.null_count:
                raise SchemaError(f"{spec.name}.{f.name}: required column has {arr.null_count} null value(s)")
        elif not f.nullable:
            raise SchemaError(
                f"{spec.name}: required column {f.name!r} is missing (have: {', '.join(table.column_names)})"
            )
        else:
            arr = pa.nulls(n, f.type)
        arrays.append(arr)
        fields.append(f)
    for name, col in given.items():  # columns beyond the declared ones: only a declared family
        if spec.extra_pattern is None or not spec.extra_pattern.match(name):
            raise SchemaError(
                f"{spec.name}: column {name!r} is not declared in its schema "
                f"(storage/tables/schemas.py); a typo, or a new column to declare there"
            )
        if not _COLUMN_NAME.match(name):
            raise SchemaError(f"{spec.name}: extra column name {name!r} is not SQL-friendly (letters, digits, '_')")
        if spec.extra_type is not None and not pa.types.is_string(col.type):
            if not (
                pa.types.is_integer(col.type)
                or pa.types.is_floating(col.type)
                or pa.types.is_boolean(col.type)
                or pa.types.is_null(col.type)
            ):
                raise SchemaError(
                    f"{spec.name}: extra column {name!r} has type {col.type}; only numbers (stored "
                    f"as float64) or strings"
                )
            col = col.cast(spec.extra_type)
        arrays.append(col)
        fields.append(pa.field(name, col.type))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=schema.metadata))


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class TableWriter:
    """Writes the tables of one run directory.

    ``TableWriter(run_dir).write("token_stats", step, rows, stage="train")``
    returns the live file's path. ``durable=False`` skips fsync (tests,
    benchmarks of the encoder alone).

    ``listeners``: callables ``fn(table, step, rows, variant)`` called after each
    successful write with the exact rows now live in Parquet (experiment
    trackers tee from here, see ``flows.report.trackers``); an exception in one is
    logged and never fails the write.
    """

    run_dir: str | Path
    row_group_size: int = 1_000_000
    compression: str = "zstd"
    compression_level: int | None = 1
    durable: bool = True
    listeners: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layout = RunLayout(Path(self.run_dir))
        info = read_run_info(self.layout.root)
        self.run_id, self.run_uid = info.run_id, info.uid

    def write(
        self, table: str, step: int, rows: Rows, *, stage: str, attempt: int = 0, variant: str = MAIN_VARIANT
    ) -> Path:
        """Write ``rows`` as the output of ``stage`` (attempt ``attempt``) for ``step``.

        Replaces — by setting aside, never deleting — the previous output of
        the same (table, step, stage, variant). Returns the new file's path.
        """
        spec = get_table(table)
        if not spec.stored:
            raise SchemaError(f"table {table!r} is not written as Parquet (use storage.ledger.events.Ledger)")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise SchemaError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        faults.point(f"write:{table}", path=self.layout.partition_dir(table, self.run_id, step))  # FP8RL_FAULT hook
        name = part_name(stage, attempt, variant)
        data = conform(spec, rows_to_table(rows), run_id=self.run_id, step=step, variant=variant)
        if spec.fill is not None:
            data = spec.fill(data)
        data = data.replace_schema_metadata(
            {
                **(data.schema.metadata or {}),
                META_RUN_ID: self.run_id.encode(),
                META_STEP: str(step).encode(),
                META_VARIANT: variant.encode(),
                **({META_RUN_UID: self.run_uid.encode()} if self.run_uid else {}),
            }
        )

        self.layout.tmp.mkdir(parents=True, exist_ok=True)
        tmp = self.layout.tmp / f"{name.write_id}.parquet.tmp"
        dest_dir = self.layout.partition_dir(table, self.run_id, step)
        dest = dest_dir / name.filename
        try:
            self._write_parquet(spec, data, tmp)
            if self.durable:
                _fsync_path(tmp)
            dest_dir.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.durable:
            _fsync_path(dest_dir, directory=True)
        for f in os.scandir(dest_dir):  # only this partition: cost independent of the run's length
            older = parse_part_name(f.name)
            if (
                older is not None
                and older.stage == stage
                and older.variant == variant
                and older.write_id < name.write_id
            ):
                self._set_aside(Path(f.path))
        for listener in self.listeners:
            try:
                listener(table, step, data, variant)
            except Exception:  # a listener (tracker) never fails a write
                import logging

                logging.getLogger("fp8rl").warning("table listener %r failed", listener, exc_info=True)
        return dest

    def _write_parquet(self, spec: TableSpec, data: pa.Table, path: Path) -> None:
        dict_cols, encodings, stats = [], {}, []
        for f in data.schema:
            if pa.types.is_nested(f.type):
                continue
            col = spec.column(f.name)
            encoding = col.encoding if col is not None else ("dict" if pa.types.is_string(f.type) else "plain")
            if encoding != "bss":
                stats.append(f.name)  # min/max of noisy floats prune nothing; skipping them saves ~8%
            if encoding == "dict":
                dict_cols.append(f.name)
            elif encoding == "bss" and pa.types.is_floating(f.type):
                encodings[f.name] = "BYTE_STREAM_SPLIT"
            elif encoding == "delta" and pa.types.is_integer(f.type):
                encodings[f.name] = "DELTA_BINARY_PACKED"
        pq.write_table(
            data,
            path,
            row_group_size=self.row_group_size,
            compression=self.compression,
            compression_level=self.compression_level,
            use_dictionary=dict_cols,
            column_encoding=encodings or None,
            write_statistics=stats,
        )

    def retire_absent_ranks(
        self, table: str, step: int, stage: str, world_size: int, *, variant: str = MAIN_VARIANT
    ) -> list[Path]:
        """Set aside ``step``'s parts of ``stage`` written by ranks >= ``world_size``.

        Each rank writes its share of a stage as its own part (``train``,
        ``train_rank1``, ...), and a re-written part replaces only the same
        rank's. A step replayed on fewer ranks than first ran it (a 2-rank run
        resumed in 1 process) would otherwise leave the absent ranks' old parts
        live beside the new ones: their rows read twice. One partition scanned.
        """
        d = self.layout.partition_dir(table, self.run_id, step)
        moved = []
        for f in os.scandir(d) if d.is_dir() else ():
            n = parse_part_name(f.name)
            if (
                n is not None
                and n.variant == variant
                and stage_of_part(n.stage) == stage
                and rank_of_part(n.stage) >= world_size
            ):
                moved.append(self._set_aside(Path(f.path)))
        return moved

    def _set_aside(self, path: Path) -> Path:
        dest = self.layout.superseded_path(path)
        if dest.exists():  # set aside before (a checkpoint folder re-written twice)
            dest = dest.with_name(f"{dest.name}.{new_write_id()}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, dest)
        return dest

    def supersede(
        self,
        tables: str | Iterable[str] | None = None,
        steps: Container[int] = ALL_STEPS,
        *,
        stages: str | Iterable[str] | None = None,
        variant: str | None = MAIN_VARIANT,
    ) -> list[Path]:
        """Set aside the live outputs of ``stages`` (all if None) for ``steps`` of ``tables``.

        ``steps`` is anything supporting ``in``: ``range(n, sys.maxsize)`` (or
        ``steps_from(n)``) for "from step n on", a list, a set. ``variant=None``
        matches every variant. Files move to ``superseded/``; returns their new paths.
        """
        names = STORED_TABLES if tables is None else ([tables] if isinstance(tables, str) else list(tables))
        stage_set = None if stages is None else ({stages} if isinstance(stages, str) else set(stages))
        moved = []
        for t in names:
            get_table(t)
            for part in scan_parts(self.layout, t, self.run_id):
                if part.step not in steps or part.name is None:
                    continue
                if stage_set is not None and stage_of_part(part.name.stage) not in stage_set:
                    continue  # a rank's share (train_rank1) goes with its stage (train)
                if variant is not None and part.name.variant != variant:
                    continue
                moved.append(self._set_aside(part.path))
        return moved

    def live_files(self, table: str) -> list[Path]:
        """The files of ``table`` that queries read, in step order."""
        return [p.path for p in self.live_parts(table)]

    def live_parts(self, table: str) -> list[Part]:
        """``live_files`` with each file's step and name fields (from its path: nothing is read)."""
        live, _ = live_parts(scan_parts(self.layout, get_table(table).name, self.run_id))
        return live


def steps_from(step: int) -> range:
    """All steps ``>= step``, for ``supersede(steps=...)``."""
    return range(int(step), sys.maxsize)


def read_table(path: str | Path) -> pa.Table:
    """Read one part file, checking its schema version (clear error if unreadable)."""
    from storage.tables.spec import META_VERSION, check_schema_version

    path = Path(path)
    try:
        t = pq.read_table(path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as err:
        if isinstance(err, OSError) and getattr(err, "errno", None) is not None:
            raise  # a real I/O error (permission, missing file) keeps its type
        why = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), type(err).__name__)
        raise CorruptFile(
            f"{path}: corrupt Parquet ({why}); `fp8rl doctor` lists such files — restore it "
            "from a copy, or `fp8rl resume RUN --from STAGE --step N` to recompute it"
        ) from None
    meta = t.schema.metadata or {}
    check_schema_version(meta.get(META_VERSION, b"").decode() or None, str(path))
    return t


@dataclass(frozen=True)
class SetAside:
    """What :func:`set_aside_from` moved to ``superseded/``."""

    files: list[Path]
    checkpoints: list[Path]
    ledger_records: int


def set_aside_from(
    run_dir: str | Path,
    *,
    step: int,
    stages_at_step: Iterable[str] | None = None,
    variant: str = MAIN_VARIANT,
    checkpoint_stage: str = "checkpoint",
) -> SetAside:
    """Set aside every output after a point, for ``resume --from STAGE --step N``.

    Moves to ``superseded/`` the table parts of steps > ``step`` and those of
    ``step`` written by ``stages_at_step`` (all stages if None), hides the
    matching ledger records, and — for the main variant — sets aside
    checkpoints of later steps, and of ``step`` itself when its checkpoint
    stage is among ``stages_at_step``. The caller knows the stage order and
    passes the stages from STAGE on.
    """
    from storage.checkpoints.verify import list_checkpoints
    from storage.ledger.events import Ledger

    stages = None if stages_at_step is None else sorted(set(stages_at_step))
    writer = TableWriter(run_dir)
    files = writer.supersede(None, steps_from(step + 1), variant=variant)
    files += writer.supersede(None, [step], stages=stages, variant=variant) if stages != [] else []
    ckpts = []
    if variant == MAIN_VARIANT:
        for s, path in list_checkpoints(run_dir):
            if s > step or (s == step and (stages is None or checkpoint_stage in stages)):
                ckpts.append(writer._set_aside(path))
    n = Ledger(run_dir).set_aside(from_step=step, stages=stages, variant=variant)
    return SetAside(files, ckpts, n)


def read_step_rows(
    layout: RunLayout, run_id: str, table: str, step: int, *, variant: str, stages: tuple[str, ...] | None = None
) -> pa.Table:
    """The live rows of ``table`` for ``step`` of run ``run_id`` written under ``variant`` (by ``stages``,
    None: any), concatenated in file order; ``FileNotFoundError`` if there are none."""
    parts = [p for p in scan_parts(layout, table, run_id) if p.step == step]
    live, _ = live_parts(parts)
    ours = [p for p in live if p.name.variant == variant and (stages is None or p.name.stage in stages)]
    tables = [read_table(p.path) for p in ours]
    if not tables:
        raise FileNotFoundError(f"no live {table} rows for step {step} of run {run_id} (variant {variant})")
    return pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
