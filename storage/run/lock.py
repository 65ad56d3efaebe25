"""One writer per run directory: an advisory ``flock`` on ``<run_dir>/.lock``.

The process that launches a run (``fp8rl run`` / ``resume`` / ``rerun``, a
deployment's flow run; rank 0 under several ranks) holds the lock for as long
as it writes. The kernel drops a ``flock`` when its holder exits, however it
exits (SIGKILL, OOM killer), so a crashed writer never leaves the run stuck;
the file's content (pid, host, start time) is only there to say who holds it.

The lock is re-entrant within a process: the CLI takes it before it writes
``run.json`` and the campaign flow takes it again; both refer to one open file
description (a second ``open`` + ``flock`` in the same process would conflict
with the first). Object-store roots are read-only for queries.

On a network file system (a cluster's shared path) the lock is one guard of two. Linux
NFS clients take ``flock`` as a whole-file POSIX lock held by the server, which other
nodes see; but a lock can outlive a holder's node until the server's lease expires,
and some file systems take ``flock`` per node only (Lustre's ``localflock``). The
guard that holds there is the supervisor's (``fp8rl submit``): it submits a run's next
job only after the scheduler reports the previous one ended, so no two jobs of one run
ever run at once. The file names the scheduler's job beside pid and host, so a
refusal says which job holds the run.
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
from typing import Iterator

from storage.errors import RunLocked

LOCK_FILE = ".lock"


class _Held:
    """The lock files this process holds, with a count per run directory."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.fds: dict[str, tuple[int, int]] = {}  # resolved run dir -> (fd, count)


_HELD = _Held()


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
        job = f" (Slurm job {info['job']})" if info.get("job") else ""
        return f"pid {info.get('pid')} on {info.get('host')}{job} since {info.get('since')}"
    except (OSError, ValueError):
        return "another process"


LAUNCHER_ENV = "FP8RL_RUN_LOCK_HELD_BY_LAUNCHER"


def _held_by_launcher(run_dir: str | Path) -> bool:
    """Under ``fp8rl run --nproc-per-node N`` the launching process holds the lock while
    torchrun runs the ranks; it names the run in this variable of their environment."""
    held = os.environ.get(LAUNCHER_ENV)
    return bool(held) and held == str(Path(run_dir).resolve())


def acquire(run_dir: str | Path) -> None:
    """Take the run's lock (or count one more use of it); RunLocked if another process holds it.

    Under ``torchrun`` only rank 0 (``RANK`` unset or 0) takes it; other ranks
    write only their own per-rank part files under rank 0's lock.
    """
    if int(os.environ.get("RANK", "0") or 0) != 0 or _held_by_launcher(run_dir):
        return
    run_dir = Path(run_dir).resolve()
    key = str(run_dir)
    with _HELD.mutex:
        if key in _HELD.fds:
            fd, n = _HELD.fds[key]
            _HELD.fds[key] = (fd, n + 1)
            return
        path = run_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunLocked(
                f"{run_dir} is being written by {_holder(path)}; "
                "wait for it to finish (or stop it), then `fp8rl resume`"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "job": os.environ.get("SLURM_JOB_ID"),  # None outside a cluster job
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        _HELD.fds[key] = (fd, 1)


def release(run_dir: str | Path) -> None:
    """Drop one use of the run's lock; the last one unlocks and closes the file."""
    if int(os.environ.get("RANK", "0") or 0) != 0 or _held_by_launcher(run_dir):
        return
    key = str(Path(run_dir).resolve())
    with _HELD.mutex:
        if key not in _HELD.fds:
            return
        fd, n = _HELD.fds[key]
        if n > 1:
            _HELD.fds[key] = (fd, n - 1)
            return
        del _HELD.fds[key]
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextmanager
def run_lock(run_dir: str | Path) -> Iterator[None]:
    """``with run_lock(run_dir):`` hold the single-writer lock of a run for the block."""
    acquire(run_dir)
    try:
        yield
    finally:
        release(run_dir)


def is_locked(run_dir: str | Path) -> bool:
    """Whether some process (this one included) holds the run's lock now."""
    run_dir = Path(run_dir).resolve()
    if str(run_dir) in _HELD.fds:
        return True
    path = run_dir / LOCK_FILE
    if not path.exists():
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
