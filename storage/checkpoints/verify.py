"""Is a checkpoint complete? Verifying folders against their manifests, finding the newest complete one.

A checkpoint is *complete* iff its folder is named ``step_<n>`` and its
manifest verifies (every file it lists, the DCP shards included, present with
its size; and, where hashes are checked, its sha256). :func:`latest_complete`
skips any other (half-written, truncated, bit-rotted) and
:func:`set_aside_broken` moves those newer than the newest complete one under
``superseded/``. A checkpoint whose hashes ``fp8rl resume`` has just checked is
marked in the environment (:data:`VERIFIED_ENV`) so the flow it starts checks
sizes only.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path

from storage.checkpoints.format import DCP_DIR, DCP_METADATA, MANIFEST, STEP_DIR, dcp_dir, sha256_file
from storage.run.layout import RunLayout


def _check_files(base: Path, files: dict, hashes: bool) -> list[str]:
    problems = []
    for rel, meta in files.items():
        p = base / rel
        if not p.is_file():
            problems.append(f"{p}: missing")
        elif p.stat().st_size != meta["size"]:
            problems.append(f"{p}: size {p.stat().st_size} != {meta['size']} in manifest")
        elif hashes and sha256_file(p) != meta["sha256"]:
            problems.append(f"{p}: sha256 does not match the manifest")
    return problems


def _own_step_problems(path: Path, manifest: dict) -> list[str]:
    """A ``step_<n>`` folder must hold step n's checkpoint and name step n's sharded state.

    A folder copied or renamed to another step keeps its manifest, which names
    the sharded state of the step it was made at; that state verifies, but it
    is not this folder's, and this folder's own is missing.
    """
    m = STEP_DIR.match(path.name)
    if m is None:
        return []
    own, out = int(m.group(1)), []
    said = manifest.get("step")
    if said is not None and int(said) != own:
        out.append(f"{path}: its manifest is step {int(said)}'s, not step {own}'s (a copied or renamed folder)")
    dcp = manifest.get("dcp")
    if dcp is not None and dcp.get("dir") != f"{DCP_DIR}/step_{own}":
        mine = dcp_dir(path.parent, own)
        where = "missing" if not mine.is_dir() else "not the one its manifest lists"
        out.append(f"{mine}: {where}; the manifest of {path.name} names {dcp.get('dir')} (a copied or renamed folder)")
    return out


def verify_checkpoint(path: str | Path, *, hashes: bool = True) -> list[str]:
    """Problems of a checkpoint folder against its manifest ([] = complete).

    Its sharded (DCP) state is checked too. ``hashes=False`` checks presence and
    sizes only (fast for large models). A checkpoint written before the manifest
    listed the DCP files is checked for the DCP metadata file only.
    """
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        return [f"{path}: no {MANIFEST} (checkpoint incomplete)"]
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        dcp = manifest.get("dcp")
        dcp_files = None if dcp is None else (path.parent / dcp["dir"], dcp["files"])
        int(manifest.get("step", 0))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"{mpath}: unreadable manifest ({err})"]
    problems = _own_step_problems(path, manifest)
    problems += _check_files(path, files, hashes)
    if dcp_files is not None:
        problems += _check_files(*dcp_files, hashes)
    elif not problems:
        legacy = dcp_dir(path.parent, int(manifest.get("step", -1)))
        if legacy.is_dir() and not (legacy / DCP_METADATA).is_file():
            problems.append(f"{legacy / DCP_METADATA}: missing")
    return problems


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``step_<n>`` folder, complete or not, by step."""
    base = RunLayout(Path(run_dir)).checkpoints
    if not base.is_dir():
        return []
    out = [(int(m.group(1)), d) for d in base.iterdir() if d.is_dir() and (m := STEP_DIR.match(d.name))]
    return sorted(out)


VERIFIED_ENV = "FP8RL_HASHED_CHECKPOINT"
"""``<folder>|<fingerprint>`` of the checkpoint whose hashes ``fp8rl resume`` has just checked, so
the flow it starts (in this process or a child) does not hash the same bytes again."""


def fingerprint(path: str | Path) -> str | None:
    """The manifest's bytes and every listed file's size, mtime and inode, hashed (None: no manifest).

    Any write to the folder's files (a restore of old bytes included) changes it; it costs one
    ``stat`` per file, no reads. It stands for "nothing changed since the hashes were checked".
    """
    path = Path(path)
    try:
        raw = (path / MANIFEST).read_bytes()
        manifest = json.loads(raw)
        entries = [(path, manifest["files"])]
        if manifest.get("dcp"):
            entries.append((path.parent / manifest["dcp"]["dir"], manifest["dcp"]["files"]))
        h = hashlib.sha256(raw)
        for base, files in entries:
            for rel in sorted(files):
                st = (base / rel).stat()
                h.update(f"{base / rel}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}\n".encode())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return h.hexdigest()


def mark_hash_verified(path: str | Path) -> None:
    """Record in the environment that ``path``'s hashes were checked just now (see :data:`VERIFIED_ENV`)."""
    fp = fingerprint(path)
    if fp is not None:
        os.environ[VERIFIED_ENV] = f"{Path(path).resolve()}|{fp}"


def _hash_verified(path: Path) -> bool:
    mark = os.environ.get(VERIFIED_ENV, "")
    folder, _, fp = mark.rpartition("|")
    return bool(folder) and folder == str(path.resolve()) and fp == fingerprint(path)


def latest_complete(run_dir: str | Path, *, at_most: int | None = None, hashes: bool = True) -> Path | None:
    """Newest complete checkpoint (manifest verifies), optionally of a step <= ``at_most``.

    A checkpoint marked by :func:`mark_hash_verified` whose files have not changed since is
    checked for sizes only: its hashes were checked moments ago by the same ``resume``."""
    for step, path in reversed(list_checkpoints(run_dir)):
        if at_most is not None and step > at_most:
            continue
        if not verify_checkpoint(path, hashes=hashes and not _hash_verified(path)):
            return path
    return None


def set_aside_broken(run_dir: str | Path, *, hashes: bool = True) -> list[tuple[Path, str, Path]]:
    """Move the checkpoints newer than the newest complete one under ``superseded/``.

    Resume loads the newest complete checkpoint; the broken ones above it
    (truncated, bit-rotted, half-written) would otherwise be mistaken for the
    newest by a later reader. Returns ``(folder, first problem, where it went)``. The newest
    complete one is marked hash-verified (:func:`mark_hash_verified`) for the restore after it.
    """
    layout = RunLayout(Path(run_dir))
    out = []
    for step, path in reversed(list_checkpoints(run_dir)):
        why = verify_checkpoint(path, hashes=hashes)
        if not why:
            if hashes:
                mark_hash_verified(path)
            break
        moved = []
        for old in (path, dcp_dir(layout.checkpoints, step)):
            if old.exists():
                aside = layout.superseded_path(old)
                if aside.exists():
                    aside = aside.with_name(f"{aside.name}-{secrets.token_hex(4)}")
                aside.parent.mkdir(parents=True, exist_ok=True)
                os.replace(old, aside)
                moved.append(aside)
        out.append((path, why[0] + (f" (+{len(why) - 1} more)" if len(why) > 1 else ""), moved[0]))
    return out
