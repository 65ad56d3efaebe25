"""What a sandboxed run may use and what it reports: :class:`SandboxLimits` and :class:`ExecResult`.

Shared by the launcher (:mod:`stages.grade.sandbox_launch`), the reader of a
run's pipes (:mod:`stages.grade.sandbox_collect`) and the :class:`~stages.grade.sandbox.Sandbox`
that callers hold; the module docstring of :mod:`stages.grade.sandbox` explains the isolation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Isolation = Literal["namespaces+uid", "userns", "none"]
ExecStatus = Literal["ok", "error", "timeout", "output_limit", "sandbox_error"]

SCRUBBED_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "HOME": "/tmp",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
}


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one program run (defaults: our choice, sized for unit-test-sized programs)."""

    wall_s: float = 10.0  # wall clock of one run, host-enforced (SIGKILL of the whole namespace)
    cpu_s: int = 10  # RLIMIT_CPU (seconds of CPU, all threads)
    memory_mb: int = 1024  # RLIMIT_AS (address space; Python itself needs ~30 MiB)
    file_mb: int = 16  # RLIMIT_FSIZE: largest file the program may write
    tmp_mb: int = 32  # size of the program's private /tmp (tmpfs; counts as memory)
    tmp_inodes: int = 1024  # files + folders the private /tmp may hold (kernel memory is not in tmp_mb)
    nproc: int = 32  # RLIMIT_NPROC for the throw-away uid (processes + threads)
    nofile: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 1 << 20  # stdout cap; past it the program is killed (status "output_limit")
    stderr_bytes: int = 64 << 10  # stderr kept (head); more is read and dropped, never killed for
    uid_range: tuple[int, int] = (1_000_000, 1_900_000)  # throw-away uids (not in /etc/passwd)
    python: str | None = None  # interpreter run in the sandbox; None = auto (see stages.grade.sandbox)


@dataclass
class ExecResult:
    """Outcome of one run. ``status``: ``ok`` (exit 0), ``error`` (non-zero exit
    or a signal), ``timeout`` (wall clock), ``output_limit`` (stdout cap),
    ``sandbox_error`` (the sandbox itself failed to start the program)."""

    status: ExecStatus
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    isolation: Isolation
    detail: str = ""
    channel: bytes = b""  # what the program wrote to the result channel (fd 3), when one was opened
