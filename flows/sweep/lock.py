"""One ``fp8rl sweep`` per cell: an advisory ``flock`` on ``<sweep dir>/_cells/<cell>.lock``.

A sweep may run in parts, one process per part, into one directory (``--cells``),
so the lock is taken per cell, not per directory: two sweeps whose cells do not
overlap run side by side, and a second sweep that would run a cell the first one
holds is refused at once, in one line that names the cell and its holder, before
it writes anything. Before, it started the cell's campaign, which met the run's
own lock (:mod:`storage.run.lock`) and reported the cell as failed.

A sweep takes the locks of every cell it selected (those waiting for a pilot's
choice included) when it opens and holds them until it ends. The kernel drops a
``flock`` when its holder exits, however it exits, so a killed sweep never leaves
its cells locked; the file's content (pid, host, start time) only says who holds
it. Making a choice takes ``_choices/<name>.lock`` (waiting for it) so that two
parts that finish a pilot at once make the choice once.

Locks are re-entrant within a process: the command takes the cells' locks before
Prefect starts and the sweep's flow takes them again.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator

from storage.errors import RunLocked

_MUTEX = threading.Lock()
_HELD: dict[str, tuple[int, int]] = {}  # lock file (resolved) -> (fd, uses) held by this process


def cell_lock_path(sweep_dir: Path, cell_id: str) -> Path:
    from flows.sweep.spec import CELLS_DIR

    return Path(sweep_dir) / CELLS_DIR / f"{cell_id}.lock"


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
        return f"pid {info['pid']} on {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _take(path: Path, wait: bool) -> bool:
    """Take (or count one more use of) the lock at ``path``; False when another process holds it."""
    key = str(path.resolve())
    with _MUTEX:
        if key in _HELD:
            fd, uses = _HELD[key]
            _HELD[key] = (fd, uses + 1)
            return True
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        since = datetime.now(timezone.utc).isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(
            fd, (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n").encode(), 0
        )
        _HELD[key] = (fd, 1)
        return True


def _drop(path: Path) -> None:
    key = str(path.resolve())
    with _MUTEX:
        if key not in _HELD:
            return
        fd, uses = _HELD.pop(key)
        if uses > 1:
            _HELD[key] = (fd, uses - 1)
            return
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def cells_held(sweep_dir: Path, cell_ids: Iterable[str]) -> Iterator[None]:
    """Hold the locks of ``cell_ids`` for the block; RunLocked (one line) if another process holds one."""
    taken: list[Path] = []
    try:
        for cell_id in dict.fromkeys(cell_ids):
            path = cell_lock_path(sweep_dir, cell_id)
            if not _take(path, wait=False):
                raise RunLocked(
                    f"cell {cell_id} of {sweep_dir} is being run by another fp8rl sweep ({_holder(path)}); "
                    "wait for it to end, or run other cells of the sweep (--cells)"
                )
            taken.append(path)
        yield
    finally:
        for path in reversed(taken):
            _drop(path)


@contextmanager
def choice_held(sweep_dir: Path, name: str) -> Iterator[None]:
    """Hold the lock of choice ``name`` for the block, waiting for another sweep that holds it."""
    from flows.sweep.choice import CHOICES_DIR

    path = Path(sweep_dir) / CHOICES_DIR / f"{name}.lock"
    _take(path, wait=True)
    try:
        yield
    finally:
        _drop(path)
