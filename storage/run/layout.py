"""Where things live in a run directory, and how runs are found.

A run directory ``RUN_DIR = <runs_root>/<run_id>/`` holds::

    run.json                      run id, config hash, created_at, schema version
    config.yaml                   the resolved campaign config
    ledger.jsonl                  stage ledger (append-only, see storage.ledger.events)
    tables/<table>/run=<run_id>/step=<n>/part-<stage>-<attempt>-<write_id>-<variant>.parquet
    checkpoints/step_<n>/         model/, optimizer.pt, rng.json, state.json, manifest.json
    superseded/                   files set aside by retries, resume --from, reruns
                                  (same relative paths as where they were live)
    tmp/                          files being written; never read by queries

``write_id`` is time-ordered hex (nanoseconds + random), so within one
(table, run, step, stage, variant) the newest complete write is the live one
even if a crash left an older file next to it.

A *root* given to the catalog or the CLI is either one run directory or a
folder whose immediate children are run directories.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping

from storage.errors import DuplicateRun, NotARunDirectory, UnknownRun
from storage.tables.spec import RUN_ID, SCHEMA_VERSION, STAGE_NAME, VARIANT_NAME, check_name, check_schema_version

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
LEDGER_FILE = "ledger.jsonl"
TABLES_DIR = "tables"
CHECKPOINTS_DIR = "checkpoints"
SUPERSEDED_DIR = "superseded"
TMP_DIR = "tmp"
# What a Parquet part says it holds (file key-value metadata, beside fp8rl.table): checked against its location
META_RUN_ID, META_STEP, META_VARIANT = b"fp8rl.run_id", b"fp8rl.step", b"fp8rl.variant"
META_RUN_UID = b"fp8rl.run_uid"  # the run's uid (run.json): a part of another run of the same name is told apart

_PART = re.compile(r"^part-(?P<stage>[^-]+)-(?P<attempt>\d+)-(?P<write_id>[0-9a-f]+)-(?P<variant>.+)\.parquet$")


@dataclass(frozen=True)
class RunInfo:
    """The content of ``run.json`` plus where it was found."""

    run_id: str
    config_hash: str | None
    created_at: str
    schema_version: int
    path: Path
    uid: str | None = None  # made once at creation, kept when the folder is copied or moved; None: an older run
    config: dict | None = None  # the config the run was created with (older runs: None, the hash only)
    config_changes: tuple[dict, ...] = ()  # config edits accepted at resume, oldest first

    @property
    def current_config_hash(self) -> str | None:
        """The hash the run's config.yaml must have now: the creation hash, or the last accepted change's."""
        return self.config_changes[-1]["to_hash"] if self.config_changes else self.config_hash

    @property
    def current_config(self) -> dict | None:
        """The config the run runs with now, as recorded (None for runs written before it was recorded)."""
        return self.config_changes[-1].get("config") if self.config_changes else self.config


@dataclass(frozen=True)
class PartName:
    """The fields encoded in a Parquet part's file name."""

    stage: str
    attempt: int
    write_id: str
    variant: str

    @property
    def filename(self) -> str:
        return f"part-{self.stage}-{self.attempt}-{self.write_id}-{self.variant}.parquet"


def new_run_uid() -> str:
    """A run's identity: 32 random hex digits, made once when the run is created.

    The run id is the folder's name, which two unrelated runs may share; the uid is
    carried in every part's footer, so a part of another run is told apart by it.
    """
    return secrets.token_hex(16)


def new_write_id() -> str:
    """Time-ordered unique id: 16 hex digits of ns since the epoch + 8 random hex digits."""
    return f"{time.time_ns():016x}{secrets.token_hex(4)}"


def part_name(stage: str, attempt: int, variant: str) -> PartName:
    check_name("stage", stage, STAGE_NAME)
    check_name("variant", variant, VARIANT_NAME)
    if not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"attempt must be a non-negative int, got {attempt!r}")
    return PartName(stage, attempt, new_write_id(), variant)


_RANK_SUFFIX = re.compile(r"_rank\d+$")


def stage_of_part(stage: str) -> str:
    """The stage a part belongs to: ``train_rank1`` (rank 1's share of ``train``) -> ``train``."""
    return _RANK_SUFFIX.sub("", stage)


def rank_of_part(stage: str) -> int:
    """The rank that wrote a part: ``train_rank3`` -> 3, a stage name without the suffix -> 0."""
    m = re.search(r"_rank(\d+)$", stage)
    return int(m.group(1)) if m else 0


def parse_part_name(filename: str) -> PartName | None:
    """Fields of a part file name, or None if it is not one of ours."""
    m = _PART.match(filename)
    if m is None:
        return None
    return PartName(m["stage"], int(m["attempt"]), m["write_id"], m["variant"])


@dataclass(frozen=True)
class RunLayout:
    """Paths inside one run directory (nothing is created by asking)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def run_json(self) -> Path:
        return self.root / RUN_FILE

    @property
    def config_yaml(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def ledger(self) -> Path:
        return self.root / LEDGER_FILE

    @property
    def tables(self) -> Path:
        return self.root / TABLES_DIR

    def table_dir(self, table: str) -> Path:
        return self.tables / table

    def partition_dir(self, table: str, run_id: str, step: int) -> Path:
        return self.tables / table / f"run={run_id}" / f"step={int(step)}"

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step_{int(step)}"

    @property
    def superseded(self) -> Path:
        return self.root / SUPERSEDED_DIR

    def superseded_path(self, path: Path) -> Path:
        """Where a live file or folder of this run goes when set aside (same relative path)."""
        return self.superseded / Path(path).resolve().relative_to(self.root.resolve())

    @property
    def tmp(self) -> Path:
        return self.root / TMP_DIR

    def relative(self, path: Path) -> str:
        """``path`` relative to the run directory, as stored in the ledger."""
        return Path(path).resolve().relative_to(self.root.resolve()).as_posix()


def config_hash(config: Mapping[str, Any] | str) -> str:
    """sha256 of a config: canonical JSON of a mapping, or the text as given."""
    if isinstance(config, str):
        data = config.encode()
    else:
        data = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(data).hexdigest()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder, fsync, rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def create_run(
    runs_root: str | Path,
    run_id: str,
    *,
    config: Mapping[str, Any] | str | None = None,
    config_hash_value: str | None = None,
    exist_ok: bool = False,
) -> RunLayout:
    """Create ``<runs_root>/<run_id>/`` with run.json (and config.yaml if given).

    ``config`` is a mapping (dumped as YAML) or YAML text written as is; its
    hash goes into run.json unless ``config_hash_value`` is given. With
    ``exist_ok`` an existing run with the same id is returned if its config
    hash matches, and is an error otherwise (resume with another config).
    """
    check_name("run id", run_id, RUN_ID)
    layout = RunLayout(Path(runs_root) / run_id)
    if config is not None and config_hash_value is None:
        config_hash_value = config_hash(config)
    if layout.run_json.exists():
        if not exist_ok:
            raise NotARunDirectory(f"{layout.root}: a run with id {run_id!r} already exists")
        info = read_run_info(layout.root)
        if config_hash_value is not None and info.config_hash not in (None, config_hash_value):
            raise NotARunDirectory(
                f"{layout.root}: existing run has config hash {info.config_hash[:12]}…, "
                f"not {config_hash_value[:12]}…; use another run id or the original config"
            )
        return layout
    for d in (layout.root, layout.tables, layout.checkpoints, layout.tmp):
        d.mkdir(parents=True, exist_ok=True)
    recorded = None
    if config is not None:
        import yaml

        if isinstance(config, str):
            text = config
            recorded = yaml.safe_load(text)
        else:
            text = yaml.safe_dump(dict(config), sort_keys=False)
            recorded = dict(config)
        write_text_atomic(layout.config_yaml, text)
    info = {
        "run_id": run_id,
        "uid": new_run_uid(),
        "config_hash": config_hash_value,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "schema_version": SCHEMA_VERSION,
    }
    if isinstance(recorded, dict):
        info["config"] = recorded  # what resume compares an edited config.yaml with, key by key
    write_text_atomic(layout.run_json, json.dumps(info, indent=2) + "\n")
    return layout


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / RUN_FILE).is_file()


def read_run_info(run_dir: str | Path) -> RunInfo:
    """Parse ``run.json``; errors name the directory and the problem."""
    run_dir = Path(run_dir)
    p = run_dir / RUN_FILE
    if not p.is_file():
        raise NotARunDirectory(f"{run_dir}: not a run directory (no {RUN_FILE})")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
        run_id = data["run_id"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise NotARunDirectory(f"{p}: unreadable run file ({err.__class__.__name__}: {err})") from None
    version = check_schema_version(data.get("schema_version"), str(p))
    uid = data.get("uid")
    changes = data.get("config_changes") or ()
    return RunInfo(
        run_id,
        data.get("config_hash"),
        data.get("created_at", ""),
        version,
        run_dir,
        uid=uid if isinstance(uid, str) else None,
        config=data.get("config") if isinstance(data.get("config"), dict) else None,
        config_changes=tuple(c for c in changes if isinstance(c, dict)) if isinstance(changes, list) else (),
    )


def update_run_info(run_dir: str | Path, **fields: Any) -> None:
    """Add or replace top-level ``fields`` of ``run.json`` (atomic; the identity keys cannot change)."""
    read_run_info(run_dir)  # a run directory with a readable run.json, or the usual error
    p = Path(run_dir) / RUN_FILE
    data = json.loads(p.read_text(encoding="utf-8"))
    fixed = {"run_id", "uid", "config", "config_hash", "created_at", "schema_version"} & set(fields)
    if fixed:
        raise ValueError(f"update_run_info: {sorted(fixed)} are fixed at creation")
    data.update(fields)
    write_text_atomic(p, json.dumps(data, indent=2) + "\n")


def find_runs(root: str | Path, runs: Iterable[str] | None = None) -> list[RunInfo]:
    """The runs under ``root`` (a run directory or a folder of them), filtered by id.

    Raises NotARunDirectory if ``root`` holds no run, UnknownRun if a requested
    id is not there (the message lists the ones that are).
    """
    root = Path(root)
    if not root.exists():
        raise NotARunDirectory(f"{root}: no such directory")
    if not root.is_dir():
        raise NotARunDirectory(f"{root}: not a directory")
    if is_run_dir(root):
        found = [read_run_info(root)]
    else:
        found = [read_run_info(d) for d in sorted(root.iterdir()) if d.is_dir() and is_run_dir(d)]
        if not found:
            raise NotARunDirectory(f"{root}: not a run directory (no {RUN_FILE}) and holds none")
    found = _refuse_duplicates(root, found)
    if runs is None:
        return found
    wanted = list(dict.fromkeys(runs))
    by_id = {r.run_id: r for r in found}
    missing = [r for r in wanted if r not in by_id]
    if missing:
        known = ", ".join(sorted(by_id)[:10]) + (" …" if len(by_id) > 10 else "")
        raise UnknownRun(f"unknown run id {missing[0]!r} under {root}; runs there: {known}")
    return [by_id[r] for r in wanted]


def _refuse_duplicates(root: Path, found: list[RunInfo]) -> list[RunInfo]:
    """Two directories (not two names of one: symlinks and bind mounts are one) carrying one run id
    would count that run's rows twice in every query; refuse, naming both.

    One run's per-rank part files live in one directory and are one run.
    """
    seen: dict[str, tuple[tuple[int, int], Path]] = {}
    unique: list[RunInfo] = []
    for info in found:
        st = info.path.stat()
        ident = (st.st_dev, st.st_ino)
        prev = seen.setdefault(info.run_id, (ident, info.path))
        if prev[1] == info.path:
            unique.append(info)
        elif prev[0] == ident:
            continue  # another name (a symlink) of a directory already listed
        else:
            raise DuplicateRun(
                f"run id {info.run_id!r} is in two directories under {root}: {prev[1].name} and {info.path.name} "
                "(a copy?); its rows would count twice: move the copy out of the root, or query one run "
                "directory itself"
            )
    return unique


@dataclass(frozen=True)
class Part:
    """One Parquet file of a table partition, with the fields of its name."""

    path: Path
    table: str
    run_id: str
    step: int
    name: PartName | None  # None: a file name not written by storage.parts.writer
    link: bool = False  # a symbolic link (or below one): not a file the run's writer made; never live

    @property
    def key(self) -> tuple[str, str, int, str, str] | None:
        """(table, run, step, stage, variant): at most one live file per key."""
        if self.name is None or self.link:
            return None
        return (self.table, self.run_id, self.step, self.name.stage, self.name.variant)


def scan_parts(layout: RunLayout, table: str, run_id: str) -> list[Part]:
    """Every ``*.parquet`` under ``tables/<table>/run=<run_id>/step=<n>/`` (no reads).

    A symbolic link (a file, a step folder, or the table's folder itself pointing
    elsewhere) is listed with ``link=True``: the writer makes none, so none is live.
    """
    base = layout.partition_dir(table, run_id, 0).parent
    parts: list[Part] = []
    try:
        step_dirs = list(os.scandir(base))
    except FileNotFoundError:
        return parts
    inside = os.path.join(os.path.realpath(layout.root), os.path.relpath(base, layout.root))
    linked_base = os.path.realpath(base) != inside  # (a linked run directory is fine: the root is resolved too)
    for d in step_dirs:
        if not (d.is_dir() and d.name.startswith("step=")):
            continue
        try:
            step = int(d.name[5:])
        except ValueError:
            continue
        for f in os.scandir(d.path):
            if f.name.endswith(".parquet") and f.is_file():
                link = linked_base or d.is_symlink() or f.is_symlink()
                parts.append(Part(Path(f.path), table, run_id, step, parse_part_name(f.name), link))
    parts.sort(key=lambda p: (p.step, p.path.name))
    return parts


def live_parts(parts: Iterable[Part]) -> tuple[list[Part], list[Part]]:
    """Split parts into (live, shadowed): per key the newest write is live.

    Shadowed files exist only if a writer died between renaming its new file
    and setting the old one aside; they are ignored by queries. Files with a
    foreign name, and links, are neither (the caller reports them).
    """
    newest: dict[tuple, Part] = {}
    shadowed: list[Part] = []
    for p in parts:
        k = p.key
        if k is None:
            continue
        cur = newest.get(k)
        if cur is None or p.name.write_id > cur.name.write_id:
            if cur is not None:
                shadowed.append(cur)
            newest[k] = p
        else:
            shadowed.append(p)
    live = sorted(newest.values(), key=lambda p: (p.step, p.path.name))
    return live, shadowed
