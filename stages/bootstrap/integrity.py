"""The bootstrap cache is checked, not trusted: a hash of each entry's files, kept with the entry and in the run.

A cache entry (``~/.cache/fp8rl/bootstrap/tiny-<config hash>``) is the base policy every rollout
of a run starts from, and its name says only which configs made it, not what its files hold now.
So:

* **Published**: :func:`entry_digest` (sha256 over every file of the entry but ``bootstrap.json``:
  the weights, the model and generation configs, the tokenizer; each file's relative name, size and
  bytes) goes into the entry's ``bootstrap.json`` as ``weights_sha256``.
* **Read** (every cache hit, :func:`verified_entry`): the files are hashed again; a difference is
  refused in one line (:class:`BasePolicyChanged`) naming the entry and the fix (delete it: the next
  run rebuilds it, the same bits on any x86-64 CPU). An entry made before the hash existed gets it
  recorded on its first read (trust on first use).
* **Run** (:func:`check_base_policy`, when a run opens its policy): ``run.json``'s ``base_policy``
  records the entry and its hash on the first start; every resume compares the entry it loads with
  that record and refuses a different one (a run without a checkpoint would replay its stored rows
  on another policy).
* **Doctor** (``fp8rl doctor --deep``, :func:`base_policy_problems`): the entry a run records is
  hashed and compared with the record.

Cost: one read of the entry (docs/integrity.md has the figure for the tiny policy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from pathlib import Path

from storage.errors import StorageError

log = logging.getLogger(__name__)

META_FILE = "bootstrap.json"
DIGEST_KEY = "weights_sha256"  # in bootstrap.json and in run.json's base_policy
RUN_KEY = "base_policy"  # run.json: {"path": entry, "weights_sha256": digest}
_CHUNK = 1 << 20


class BasePolicyChanged(StorageError):
    """A bootstrap cache entry whose files differ from their record (the entry's or the run's)."""


def entry_digest(entry: str | Path) -> str:
    """sha256 (hex) of every file under ``entry`` but ``bootstrap.json``, in name order: each file's
    relative name, size and bytes."""
    entry = Path(entry)
    h = hashlib.sha256()
    files = sorted(p for p in entry.rglob("*") if p.is_file() and p.name != META_FILE)
    for p in files:
        rel = p.relative_to(entry).as_posix().encode()
        h.update(len(rel).to_bytes(8, "little") + rel + p.stat().st_size.to_bytes(8, "little"))
        with open(p, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def verified_entry(entry: Path) -> str:
    """The digest of a published cache entry, checked against its ``bootstrap.json`` (recorded there
    first if the entry predates the check). Raises :class:`BasePolicyChanged` (one line) on a difference."""
    meta_path = entry / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as err:
        raise BasePolicyChanged(f"bootstrap cache entry {entry}: unreadable {META_FILE} ({err}); {_fix(entry)}")
    found = entry_digest(entry)
    recorded = meta.get(DIGEST_KEY) if isinstance(meta, dict) else None
    if recorded is None:
        try:
            _write_atomic(meta_path, json.dumps({**meta, DIGEST_KEY: found}, indent=2) + "\n")
        except OSError:  # a read-only cache: the run's own record still holds the hash
            log.warning("bootstrap cache entry %s: could not record its hash (read-only?)", entry)
    elif recorded != found:
        raise BasePolicyChanged(
            f"bootstrap cache entry {entry} changed after it was built (its files hash to {found[:12]}…, "
            f"{META_FILE} records {str(recorded)[:12]}…); {_fix(entry)}"
        )
    return found


def _fix(entry: Path) -> str:
    return f"delete it to rebuild it (rm -r {entry})"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # one pid on two nodes
    tmp.write_text(text)
    os.replace(tmp, path)


def check_base_policy(run_dir: str | Path, entry: Path, *, record: bool) -> None:
    """Check the cache entry a run opens (:func:`verified_entry`) and compare it with the one the run
    recorded (``run.json``'s ``base_policy``); record it on the run's first start (``record``: this
    process writes run.json). Raises :class:`BasePolicyChanged`."""
    from storage.run.layout import RUN_FILE, update_run_info

    digest = verified_entry(entry)
    data = json.loads((Path(run_dir) / RUN_FILE).read_text(encoding="utf-8"))
    before = data.get(RUN_KEY)
    if isinstance(before, dict) and before.get(DIGEST_KEY) not in (None, digest):
        raise BasePolicyChanged(
            f"{run_dir} started from the base policy {before.get('path')} with files hashing to "
            f"{str(before[DIGEST_KEY])[:12]}…; {entry} now hashes to {digest[:12]}…: restore that policy "
            "(or start a new run): the run's stored rows belong to the other one"
        )
    if record and not isinstance(before, dict):
        update_run_info(run_dir, **{RUN_KEY: {"path": str(entry), DIGEST_KEY: digest}})


def base_policy_problems(root: str | Path) -> list[tuple[str, str, str]]:
    """``(severity, path, message)`` for each run under ``root`` whose recorded base policy is missing
    (a warning: a resume rebuilds it and compares) or hashes otherwise now (an error)."""
    from storage.run.layout import RUN_FILE, find_runs

    out = []
    for info in find_runs(root):
        data = json.loads((info.path / RUN_FILE).read_text(encoding="utf-8"))
        rec = data.get(RUN_KEY)
        if not isinstance(rec, dict) or not rec.get(DIGEST_KEY):
            continue
        entry = Path(str(rec.get("path")))
        if not (entry / META_FILE).is_file():
            out.append(("warning", str(entry), "the run's base policy is no longer in the bootstrap cache"))
        elif (found := entry_digest(entry)) != rec[DIGEST_KEY]:
            out.append(
                (
                    "error",
                    str(entry),
                    f"the run's base policy changed: its files hash to {found[:12]}…, run.json records "
                    f"{str(rec[DIGEST_KEY])[:12]}… (a resume refuses it)",
                )
            )
    return out
