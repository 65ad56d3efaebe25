"""Every server and engine a run starts dies with it: a watcher for what SIGKILL would orphan.

Without ``PREFECT_API_URL`` a flow starts Prefect's temporary API server as a
child process (~200 MB). With ``rollout.vllm_process: separate`` vLLM runs its
engine core (and, below it, its workers) in processes of their own, holding the
engine's memory (on a GPU, its weights and KV cache). If the ``fp8rl`` process is
killed with SIGKILL (the OOM killer, ``kill -9``, a fault) it cannot stop them,
and they live on under PID 1 — one more per crash, and on a GPU the memory a
resumed run needs. vLLM's engine core does not notice that its client died.

:func:`start` launches a small watcher process (``python -m flows.process.child_guard
PID``) that follows the ``fp8rl`` process through a pidfd (immune to PID
reuse). While it lives, the watcher notes each of its children that is a
Prefect server, and each process below it that is one of vLLM's (they name
themselves ``VLLM::EngineCore``, ``VLLM::Worker``), again by pidfd; when it dies,
however it dies, the watcher terminates them (SIGTERM, then SIGKILL after 5 s)
and exits. A normal exit finds them already stopped. Linux only (pidfds,
``/proc``); elsewhere :func:`start` does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from flows.process.shutdown import children, descendants

SERVER_MARK = "prefect.server.api.server:create_app"
ENGINE_MARK = "VLLM::"  # vLLM's engine processes set their title so (setproctitle rewrites the command line)
POLL_S = 0.5


def start(pid: int | None = None) -> subprocess.Popen | None:
    """Watch ``pid`` (default: this process) and its Prefect servers; None where unsupported."""
    if not (sys.platform.startswith("linux") and hasattr(os, "pidfd_open")):
        return None
    pid = os.getpid() if pid is None else pid
    return subprocess.Popen(
        [sys.executable, "-m", "flows.process.child_guard", str(pid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _marked(pid: int, mark: str) -> bool:
    try:
        return mark in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _is_server(pid: int) -> bool:
    return _marked(pid, SERVER_MARK)


def _to_stop(pid: int) -> Iterator[int]:
    """Prefect servers among ``pid``'s children, vLLM's engine processes anywhere below it."""
    yield from (c for c in children(pid) if _is_server(c))
    yield from (d for d in descendants(pid) if _marked(d, ENGINE_MARK))


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
    """Follow ``pid`` until it exits, then stop the Prefect servers and vLLM engines it had started."""
    try:
        parent = os.pidfd_open(pid)
    except OSError:
        return
    servers: dict[int, int] = {}
    while True:
        for child in _to_stop(pid):
            if child not in servers:
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
