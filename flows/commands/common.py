"""What every ``fp8rl`` command shares: one way to fail, and I/O errors as one line.

A user error, or an I/O failure the user can fix (no space left, a read-only
mount, a path blocked by a file), is one line ``error: ...`` on stderr and exit
code 2; a run interrupted that way stays resumable (every write is atomic, the
ledger is the truth). Importing this module imports neither torch nor Prefect.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import typer

# Below this many free bytes a failed write is taken to be a full disk, whatever the
# library said (torch.save reports ENOSPC as "enforce fail at inline_container.cc").
_FULL_BYTES = 1 << 20


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: <message>`` (one line) on stderr and return the Exit to raise."""
    typer.echo(f"error: {' '.join(str(message).split())}", err=True)
    return typer.Exit(code)


def _disk_full(path: Path) -> bool:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free < _FULL_BYTES
    except OSError:
        return False


def io_error_message(err: BaseException, path: Path | None) -> str | None:
    """One line for an I/O failure under ``path``, or None if ``err`` is not one."""
    from storage.errors import os_error_line

    if isinstance(err, OSError) and err.errno is not None:
        return os_error_line(err, None if path is None else str(path))
    cause = err.__cause__ or err.__context__
    if isinstance(cause, OSError) and cause.errno is not None:
        return os_error_line(cause, None if path is None else str(path))
    if path is not None and isinstance(err, RuntimeError) and "unexpected pos" in str(err):
        # torch.save's zip writer says only this when a write comes up short; the space may be free again by now
        # (the half-written file is removed), so the free-space test below would miss it
        return f"{path}: a write came up short (no space left on device, or a quota reached)"
    if path is not None and isinstance(err, (RuntimeError, OSError)) and _disk_full(path):
        return os_error_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), str(path))
    return None


@contextmanager
def io_errors(path: Path | None, *, resume_hint: Path | None = None) -> Iterator[None]:
    """Turn an I/O failure inside the block into one line and exit 2 (other errors pass)."""
    try:
        yield
    except typer.Exit:
        raise
    except (OSError, RuntimeError) as err:
        msg = io_error_message(err, path)
        if msg is None:
            raise
        if resume_hint is not None and (resume_hint / "run.json").exists():
            msg += f"; fix it, then `fp8rl resume {resume_hint}`"
        raise fail(msg) from None


def run_dir_holding(path: Path) -> Path | None:
    """The run directory ``path`` lies in or is (links followed, as a write would), or None."""
    from storage.run.layout import is_run_dir

    target = Path(path).expanduser().resolve()
    return next((d for d in [target, *target.parents] if is_run_dir(d)), None)


def refuse_run_paths(out: Path, option: str = "--out", *, own: str | None = None) -> None:
    """A file or folder written by a command other than the run's writer never lands in a run directory.

    ``own``: a folder of the run directory that belongs to this command (the report's ``report/``).
    """
    run = run_dir_holding(out)
    if run is None:
        return
    if own is not None and Path(out).expanduser().resolve().is_relative_to(run / own):
        return
    raise fail(
        f"{option} {out}: inside the run directory {run}, whose files only the run's writer changes; "
        "write it somewhere else"
    )

