"""``fp8rl doctor``: check a run directory's files and say, by name, what is wrong.

Checks, per run:

- ``run.json`` parses and its schema version is readable; it carries the run's
  uid (a run written before uids is a warning); ``config.yaml`` is the config it
  records (an edit is an error: resume refuses it), and config changes taken on
  purpose at a resume are listed as warnings;
- every Parquet part under ``tables/``: its footer parses, it says which table
  and schema version it holds (readable by this code), its ``run_id`` / ``step``
  statistics match its partition path, it carries the run's uid (a part of
  another run of the same name, or one without the uid, is an error), its name
  is one the writer produces; a link is a warning (queries skip it);
  DuckDB, the reader of queries, reads its footer (a part it cannot read is
  an error: queries skip it); with ``deep=True`` every page is also
  decompressed and decoded, by pyarrow (the reader of stages) and by DuckDB;
- two live candidates for one (table, step, stage, variant) (a writer died
  between rename and set-aside: harmless, reported as a warning), chosen as
  queries choose them (a link is never the live one);
- leftover ``tmp/*.tmp`` files and ``checkpoints/.tmp-*`` folders (interrupted
  writes: harmless, safe to delete);
- ``ledger.jsonl``: lines that do not parse (a torn last line is a warning, and
  so is a torn record in the middle that an older version repaired by starting
  the next record on a fresh line; any other bad line is an error; torn tails
  moved to ``ledger.quarantine.jsonl`` by a repair are not in the ledger), finished records whose outputs are neither
  live nor set aside;
- every ``checkpoints/step_<n>/`` against its manifest, its sharded (DCP)
  state in ``checkpoints/.dcp/step_<n>/`` included: sizes, and with
  ``deep=True`` sha256; the manifest must be step n's and name step n's own
  sharded state (a folder copied to another step is not); checkpoints
  deleted by retention are known from ``checkpoints/pruned.jsonl``; leftover
  ``checkpoints/.dcp/.tmp-*`` folders (an interrupted sharded save) are a
  warning.

Errors make ``fp8rl doctor`` exit 1; warnings alone do not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from storage.checkpoints.format import DCP_DIR
from storage.checkpoints.retention import pruned_checkpoints
from storage.checkpoints.verify import list_checkpoints, verify_checkpoint
from storage.errors import DuplicateRun, NotARunDirectory, SchemaVersionError, StorageError
from storage.ledger.events import Ledger
from storage.ledger.records import DONE
from storage.parts.checks import data_problem, footer_problem
from storage.run.identity import config_file_drift, no_uid_warning
from storage.run.layout import (
    META_RUN_ID,
    META_RUN_UID,
    META_STEP,
    META_VARIANT,
    RunInfo,
    RunLayout,
    find_runs,
    is_run_dir,
    live_parts,
    parse_part_name,
    read_run_info,
    scan_parts,
)
from storage.tables.schemas import STORED_TABLES
from storage.tables.spec import META_TABLE, META_VERSION, check_schema_version

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class Problem:
    """One finding: severity, the file or folder concerned, and what is wrong."""

    severity: str
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.path}: {self.message}"


def _check_parquet(path: Path, table: str, run_id: str, step: int, deep: bool, uid: str | None) -> list[Problem]:
    out: list[Problem] = []
    try:
        pf = pq.ParquetFile(path)
        meta = pf.metadata
    except Exception as err:  # pyarrow raises several types for damaged files
        return [Problem(ERROR, str(path), f"unreadable Parquet ({type(err).__name__}: {str(err).splitlines()[0]})")]
    why = footer_problem(path)
    if why is not None:
        return [Problem(ERROR, str(path), f"{why}; queries skip it")]
    kv = pf.schema_arrow.metadata or {}
    if kv.get(META_TABLE, b"").decode() not in ("", table):
        out.append(Problem(ERROR, str(path), f"holds table {kv[META_TABLE].decode()!r}, not {table!r}"))
    name = parse_part_name(path.name)
    if name is not None and kv.get(META_VARIANT, name.variant.encode()).decode() != name.variant:
        out.append(Problem(ERROR, str(path), f"holds variant {kv[META_VARIANT].decode()!r}, not {name.variant!r}"))
    for key, col, want in ((META_RUN_ID, "run_id", run_id), (META_STEP, "step", str(step))):
        if kv.get(key, want.encode()).decode() != want:
            out.append(Problem(ERROR, str(path), f"metadata says {col} {kv[key].decode()!r}, not {want!r} of its path"))
    if uid is not None and kv.get(META_RUN_UID, b"").decode() != uid:
        said = kv.get(META_RUN_UID, b"").decode()
        why = f"written by another run (uid {said[:12]}…)" if said else "carries no run uid: not written by this run"
        out.append(Problem(ERROR, str(path), f"{why}; this run's uid is {uid[:12]}…; queries skip it"))
    try:
        check_schema_version(kv.get(META_VERSION, b"").decode() or None, "file")
    except SchemaVersionError as err:
        out.append(Problem(ERROR, str(path), str(err).removeprefix("file: ")))
    names = pf.schema_arrow.names
    for col, want in (("run_id", run_id), ("step", step)):
        if col not in names:
            out.append(Problem(ERROR, str(path), f"no {col} column"))
            continue
        idx = names.index(col)
        for rg in range(meta.num_row_groups):
            st = meta.row_group(rg).column(idx).statistics
            if st is not None and st.has_min_max and (st.min != want or st.max != want):
                out.append(
                    Problem(ERROR, str(path), f"{col} {st.min!r}..{st.max!r} does not match its path ({want!r})")
                )
                break
    if deep:  # both readers: stages read parts with pyarrow, queries with DuckDB
        try:
            for rg in range(meta.num_row_groups):
                pf.read_row_group(rg)
        except Exception as err:
            out.append(
                Problem(ERROR, str(path), f"corrupt data pages ({type(err).__name__}: {str(err).splitlines()[0]})")
            )
            return out
        if (why := data_problem(path)) is not None:
            out.append(Problem(ERROR, str(path), f"{why}; queries skip it"))
    return out


def _check_tables(layout: RunLayout, run_id: str, deep: bool, uid: str | None) -> tuple[list[Problem], set[str]]:
    out: list[Problem] = []
    known: set[str] = set()
    if not layout.tables.is_dir():
        return out, known
    for table_dir in sorted(p for p in layout.tables.iterdir() if p.is_dir()):
        table = table_dir.name
        if table not in STORED_TABLES:
            out.append(Problem(WARNING, str(table_dir), f"unknown table; known: {', '.join(STORED_TABLES)}"))
            continue
        for f in sorted(table_dir.rglob("*")):
            if f.is_dir():
                continue
            rel = f.relative_to(table_dir).parts
            if any((table_dir / Path(*rel[: i + 1])).is_symlink() for i in range(len(rel))) or table_dir.is_symlink():
                out.append(Problem(WARNING, str(f), "a link, not a file the run's writer made; ignored by queries"))
                continue
            known.add(layout.relative(f))
            if len(rel) != 3 or not rel[0].startswith("run=") or not rel[1].startswith("step="):
                out.append(Problem(WARNING, str(f), "not in the <table>/run=<id>/step=<n>/ layout; ignored by queries"))
                continue
            if rel[0] != f"run={run_id}":
                out.append(
                    Problem(WARNING, str(f), f"partition {rel[0]} is not this run's ({run_id}); ignored by queries")
                )
                continue
            if not f.name.endswith(".parquet"):
                out.append(Problem(WARNING, str(f), "not a .parquet file; ignored by queries"))
                continue
            if parse_part_name(f.name) is None:
                out.append(Problem(WARNING, str(f), "file name not written by fp8rl storage; ignored by queries"))
            try:
                step = int(rel[1][5:])
            except ValueError:
                out.append(Problem(WARNING, str(f), f"bad step partition {rel[1]!r}; ignored by queries"))
                continue
            out += _check_parquet(f, table, run_id, step, deep, uid)
        for p in live_parts(scan_parts(layout, table, run_id))[1]:  # the listing queries use: links never live
            out.append(
                Problem(
                    WARNING,
                    str(p.path),
                    "older write of the same stage output still present (interrupted set-aside); ignored by queries",
                )
            )
    return out, known


def _check_ledger(layout: RunLayout, live_files: set[str]) -> list[Problem]:
    out: list[Problem] = []
    ledger = Ledger(layout.root)
    for line, severity, what in ledger.damage():  # the one reading doctor, query and resume share
        out.append(Problem(ERROR if severity == "error" else WARNING, f"{ledger.path}:{line}", what))
    pruned = pruned_checkpoints(layout.root)
    for r in ledger.records(variant=None):
        if r.status != DONE:
            continue
        for rel in r.outputs:
            if Path(rel).is_absolute() and Path(rel).resolve().is_relative_to(layout.root.resolve()):
                rel = layout.relative(Path(rel))
            if rel in pruned:
                continue  # deleted by checkpoint retention, recorded in checkpoints/pruned.jsonl
            if rel not in live_files and not (layout.root / rel).exists() and not (layout.superseded / rel).exists():
                out.append(
                    Problem(
                        ERROR,
                        str(layout.root / rel),
                        f"output of {r.stage} step {r.step} attempt {r.attempt} ({r.variant}) is missing",
                    )
                )
    return out


def _check_identity(layout: RunLayout, info: RunInfo) -> list[Problem]:
    """The run's uid (a warning for runs written before it), config.yaml against the recorded config,
    and the config changes accepted at resume (warnings: the run mixes two configs on purpose)."""
    out: list[Problem] = []
    if info.uid is None:
        out.append(Problem(WARNING, str(layout.run_json), no_uid_warning(info)))
    try:
        text = layout.config_yaml.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = None
    drift = None if text is None else config_file_drift(info, text)
    if drift:
        out.append(
            Problem(
                ERROR,
                str(layout.config_yaml),
                f"edited since the run was made ({'; '.join(drift)}); resume refuses it unless given "
                "--accept-config-change",
            )
        )
    for change in info.config_changes:
        out.append(
            Problem(
                WARNING,
                str(layout.run_json),
                f"config changed at a resume after step {change.get('after_step')} ({change.get('at')}): "
                + "; ".join(change.get("keys") or []),
            )
        )
    return out


def check_run(run_dir: str | Path, *, deep: bool = False) -> list[Problem]:
    """All problems of one run directory (empty list = healthy)."""
    layout = RunLayout(Path(run_dir))
    try:
        info = read_run_info(layout.root)
    except StorageError as err:
        return [Problem(ERROR, str(layout.run_json), str(err))]
    out = _check_identity(layout, info)
    tables, files = _check_tables(layout, info.run_id, deep, info.uid)
    out += tables
    if layout.tmp.is_dir():
        for f in sorted(layout.tmp.iterdir()):
            out.append(Problem(WARNING, str(f), "leftover temporary file of an interrupted write; safe to delete"))
    out += _check_ledger(layout, files)
    if layout.checkpoints.is_dir():
        for d in sorted([*layout.checkpoints.glob(".tmp-*"), *layout.checkpoints.glob(f"{DCP_DIR}/.tmp-*")]):
            out.append(Problem(WARNING, str(d), "leftover half-written checkpoint; safe to delete"))
    for _, path in list_checkpoints(layout.root):
        for msg in verify_checkpoint(path, hashes=deep):
            where, _, what = msg.partition(": ")
            out.append(Problem(ERROR, where, what))
    return out


def check(root: str | Path, *, deep: bool = False) -> list[Problem]:
    """Problems of every run under ``root`` (a run directory or a folder of them)."""
    root = Path(root)
    if not root.is_dir():
        raise NotARunDirectory(f"{root}: no such directory")
    if is_run_dir(root):
        return check_run(root, deep=deep)
    run_dirs = sorted(p for p in root.iterdir() if is_run_dir(p))
    if not run_dirs:
        raise NotARunDirectory(f"{root}: not a run directory (no run.json) and holds none")
    out: list[Problem] = []
    try:
        find_runs(root)
    except DuplicateRun as err:  # a copy of a run beside it: queries of the root refuse to double-count
        out.append(Problem(ERROR, str(root), str(err)))
    except StorageError:
        pass  # an unreadable run.json: check_run names it
    return out + [problem for d in run_dirs for problem in check_run(d, deep=deep)]
