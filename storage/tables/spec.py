"""Columns and table specs: the machinery every table of :mod:`storage.tables.schemas` is declared with.

A :class:`TableSpec` lists its stored columns (:class:`Column`: name, arrow
type, meaning, Parquet encoding), the columns the catalog derives as SQL, and
its rules (strict names, a family of extra columns, rows merged per step).
Every row carries the key columns ``run_id``, ``step`` and ``variant``
(:func:`key_columns`).

Schema versions: ``SCHEMA_VERSION`` is written into every Parquet file's
key-value metadata (``fp8rl.schema_version``) and into ``run.json``. Versions
from ``MIN_READABLE_SCHEMA_VERSION`` up to the current one read fine (changes
between them are additive); anything else fails with :class:`SchemaVersionError`
naming the file and the versions involved.

Names that go into paths (stages, variants, run ids) are checked here
(:func:`check_name`) against conservative alphabets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa

from storage.errors import SchemaError, SchemaVersionError

SCHEMA_VERSION = 1
MIN_READABLE_SCHEMA_VERSION = 1
META_VERSION = b"fp8rl.schema_version"
META_TABLE = b"fp8rl.table"
MAIN_VARIANT = "main"

# Stage names go into file names as a '-'-separated field: no '-' allowed.
STAGE_NAME = re.compile(r"^[A-Za-z0-9_.]+$")
# Variants and run ids go into paths: a conservative, shell-friendly alphabet.
VARIANT_NAME = re.compile(r"^[A-Za-z0-9_.+=-]+$")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=-]*$")


@dataclass(frozen=True)
class Column:
    """One column: name, arrow type, meaning and how Parquet should encode it.

    ``encoding``: 'dict' (dictionary + RLE; low-cardinality values), 'bss'
    (BYTE_STREAM_SPLIT; noisy floats), 'delta' (DELTA_BINARY_PACKED; ids and
    positions that count up) or 'plain'.
    ``required``: the writer refuses rows without it (instead of writing NULLs).
    """

    name: str
    type: pa.DataType
    doc: str
    required: bool = False
    encoding: str = "dict"


@dataclass(frozen=True)
class TableSpec:
    """A table: its stored columns, the columns the catalog derives, its rules.

    Strict: a column a writer passes that the table does not declare is a
    :class:`SchemaError` naming it (a typo must not become a new column).
    Adding a column is one line here. ``extra_pattern`` declares a family of
    columns by name (``steps``: per-stage timings ``<stage>_seconds``), stored
    as ``extra_type``. ``merge_rows``: the view folds the rows written by
    different stages for one (run, step, variant) into a single row.
    ``stored``: False for the ledger (JSONL, not Parquet; the schema is its view's).
    ``fill``: completes conformed rows before writing (token_stats: clip flags).
    """

    name: str
    doc: str
    columns: tuple[Column, ...]
    derived: tuple[tuple[str, str, str], ...] = ()  # (name, SQL expression, doc)
    extra_type: pa.DataType | None = None
    extra_pattern: re.Pattern | None = None
    merge_rows: bool = False
    stored: bool = True
    fill: Callable[[pa.Table], pa.Table] | None = None
    _by_name: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self._by_name.update({c.name: c for c in self.columns})

    def column(self, name: str) -> Column | None:
        return self._by_name.get(name)

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def schema(self) -> pa.Schema:
        """The stored schema, with each column's doc and the version in the metadata."""
        fields = [pa.field(c.name, c.type, nullable=not c.required, metadata={"doc": c.doc}) for c in self.columns]
        return pa.schema(fields, metadata={META_VERSION: str(SCHEMA_VERSION).encode(), META_TABLE: self.name.encode()})


def key_columns() -> tuple[Column, ...]:
    return (
        Column("run_id", pa.string(), "Run id (the run directory's name, from run.json).", required=True),
        Column("step", pa.int64(), "RL step that produced the row (0 = before any update).", required=True),
        Column("variant", pa.string(), "'main' for the campaign; another name for a re-run of a stage.", required=True),
    )


def check_schema_version(version: int | str | None, where: str) -> int:
    """Return ``version`` as int if this code reads it, else raise a clear error about ``where``."""
    if version is None:
        raise SchemaVersionError(f"{where}: no fp8rl schema version recorded; not written by fp8rl storage")
    try:
        v = int(version)
    except (TypeError, ValueError):
        raise SchemaVersionError(f"{where}: schema version {version!r} is not an integer") from None
    if v > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{where}: written with schema version {v}, newer than this fp8rl's {SCHEMA_VERSION}; upgrade fp8rl to "
            f"read it"
        )
    if v < MIN_READABLE_SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{where}: schema version {v} is older than the oldest readable ({MIN_READABLE_SCHEMA_VERSION}); "
            "read it with the fp8rl release that wrote it"
        )
    return v


def check_name(kind: str, value: str, pattern: re.Pattern) -> str:
    """Validate a stage / variant / run id that ends up in a path."""
    if not isinstance(value, str) or not pattern.match(value):
        raise SchemaError(f"bad {kind} {value!r}: allowed characters are {pattern.pattern}")
    return value
