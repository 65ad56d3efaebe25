"""Every server a run starts dies with it: a watcher for Prefect's temporary server.

Without ``PREFECT_API_URL`` a flow starts Prefect's temporary API server as a
child process (~200 MB). If the ``fp8rl`` process is killed with SIGKILL (the
OOM killer, ``kill -9``) it cannot stop that child, which then lives on under
PID 1 — one more per crash.

:func:`start` launches a small watcher process (``python -m flows.child_guard
PID``) that follows the ``fp8rl`` process through a pidfd (immune to PID
reuse). While it lives, the watcher notes each of its children that is a
Prefect server (again by pidfd); when it dies, however it dies, the watcher
terminates those servers (SIGTERM, then SIGKILL after 5 s) and exits. A normal
exit finds them already stopped by Prefect. Linux only (pidfds, ``/proc``);
elsewhere :func:`start` does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from flows.shutdown import children

SERVER_MARK = "prefect.server.api.server:create_app"
POLL_S = 0.5


def start(pid: int | None = None) -> subprocess.Popen | None:
    """Watch ``pid`` (default: this process) and its Prefect servers; None where unsupported."""
    if not (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")):
        return None
    pid = os.getpid() if pid is None else pid
    return subprocess.Popen(
        [sys.executable, "-m", "flows.child_guard", str(pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _is_server(pid: int) -> bool:
    try:
        return SERVER_MARK in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _alive(pidfd: int) -> bool:
    return not select.select([pidfd], [], [], 0)[0]


def _stop(servers: dict[int, int]) -> None:
    for pid, fd in servers.items():
        if _alive(fd):
            signal.pidfd_send_signal(fd, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(fd) for fd in servers.values()):
        time.sleep(0.1)
    for fd in servers.values():
        if _alive(fd):
            signal.pidfd_send_signal(fd, signal.SIGKILL)


def watch(pid: int) -> None:
    """Follow ``pid`` until it exits, then stop the Prefect servers it had started."""
    try:
        parent = os.pidfd_open(pid)
    except OSError:
        return
    servers: dict[int, int] = {}
    while True:
        for child in children(pid):
            if child not in servers and _is_server(child):
                try:
                    servers[child] = os.pidfd_open(child)
                except OSError:
                    continue
        if select.select([parent], [], [], POLL_S)[0]:
            break
    _stop(servers)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for fp8rl, which stops its servers itself
    watch(int(sys.argv[1]))
