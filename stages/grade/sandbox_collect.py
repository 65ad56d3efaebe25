"""Reading one sandboxed launch to its end: its pipes, its wall clock, its exit.

The host side of a run after :func:`stages.grade.sandbox_launch.launch` has
started it: stdout (capped: past ``output_bytes`` the run is killed), stderr
(head kept, the rest drained), the status pipe the namespace's init writes (the
program's own exit status, or one record per case), the result channel. At the
deadline or the cap the whole namespace is killed by killing its pid 1
(:func:`kill_tree`), and the launcher is reaped before the result returns, so
no process of a run outlives it.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from pathlib import Path

from stages.grade.sandbox_limits import ExecResult, ExecStatus, Isolation, SandboxLimits


def children_of(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the namespace's pid 1 (the kernel then kills the whole pid namespace)
    and let the launcher reap it; only a launcher that does not exit is killed too.
    Killing both at once would orphan pid 1 to the host's init, which reaps it late."""
    for child in children_of(proc.pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=2.0)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def read_all(
    proc: subprocess.Popen, lim: SandboxLimits, deadline: float, extra: dict[int, str], status_cap: int = 64
) -> tuple[dict[str, bytearray], ExecStatus | None]:
    """Read stdout, stderr and the extra pipes until all close, the stdout cap or the deadline."""
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {"out": bytearray(), "err": bytearray(), "status": bytearray(), "chan": bytearray()}
    caps = {"out": lim.output_bytes, "err": lim.stderr_bytes, "status": status_cap, "chan": lim.output_bytes}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    for fd, name in extra.items():
        sel.register(fd, selectors.EVENT_READ, name)
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bufs, "timeout"
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = bufs[key.data]
                if key.data == "out":
                    buf += chunk
                    if len(buf) > lim.output_bytes:
                        return bufs, "output_limit"
                elif len(buf) < caps[key.data]:  # past its cap a pipe is drained and dropped, never killed for
                    buf += chunk[: caps[key.data] - len(buf)]
    finally:
        sel.close()
    return bufs, None


def collect(
    proc: subprocess.Popen,
    lim: SandboxLimits,
    t0: float,
    level: Isolation,
    status_fd: int = -1,
    chan_fd: int = -1,
    status_cap: int = 64,
    multi: bool = False,
) -> ExecResult:
    extra = {fd: name for fd, name in ((status_fd, "status"), (chan_fd, "chan")) if fd >= 0}
    deadline = t0 + lim.wall_s
    try:
        bufs, status = read_all(proc, lim, deadline, extra, status_cap)
        if status is not None:
            kill_tree(proc)
        try:
            rc = proc.wait(timeout=max(0.5, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # output closed but the namespace lives on (e.g. fds closed early)
            status = status or "timeout"
            kill_tree(proc)
            rc = proc.wait()
    finally:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
        if proc.returncode is None:
            kill_tree(proc)
            proc.wait()
    stderr = bufs["err"].decode("utf-8", "replace")
    detail = ""
    said = bytes(bufs["status"]).decode("ascii", "replace").strip()
    if multi:  # per-case records; the launcher's own outcome says only whether it finished
        bufs["chan"] = bufs["status"]
        if status is None and rc != 0:
            status, detail = "sandbox_error", f"launcher exit {rc}"
    elif level != "none":  # the exit of the program itself, as its namespace's init saw it
        if said.lstrip("-").isdigit():
            rc = int(said)
        elif status is None:  # the prelude never started the program
            status = "sandbox_error"
            detail = f"launcher exit {rc}, no program status"
    if status is None:
        status = "ok" if rc == 0 else "error"
    if status == "timeout":
        detail = f"over the wall clock of {lim.wall_s}s"
    elif status == "output_limit":
        detail = f"stdout over {lim.output_bytes} bytes"
    elif rc and rc < 0 and not detail:
        detail = f"killed by signal {-rc}"
    return ExecResult(
        status,
        rc,
        bytes(bufs["out"][: lim.output_bytes]).decode("utf-8", "replace"),
        stderr,
        time.monotonic() - t0,
        level,
        detail,
        bytes(bufs["chan"]),
    )


def parse_case_records(
    buf: bytes, n: int, level: Isolation, case_wall_s: float, lim: SandboxLimits
) -> list[ExecResult | None]:
    """``k status rc len_out len_err\\n`` + stdout + stderr, per case, as the init wrote them."""
    out: list[ExecResult | None] = [None] * n
    pos = 0
    while pos < len(buf):
        nl = buf.find(b"\n", pos)
        if nl < 0:
            break
        try:
            k, st, rc, lo, le = buf[pos:nl].decode("ascii").split()
            k_, rc_, lo_, le_ = int(k), int(rc), int(lo), int(le)
        except ValueError:
            break
        body = buf[nl + 1 : nl + 1 + lo_ + le_]
        if len(body) < lo_ + le_ or not 0 <= k_ < n or st not in ("ok", "error", "timeout", "output_limit"):
            break
        detail = {
            "timeout": f"over the wall clock of {case_wall_s}s",
            "output_limit": f"stdout over {lim.output_bytes} bytes",
        }.get(st, "")
        if not detail and rc_ < 0:
            detail = f"killed by signal {-rc_}"
        out[k_] = ExecResult(
            st,
            rc_,
            body[:lo_].decode("utf-8", "replace"),  # type: ignore[arg-type]
            body[lo_:].decode("utf-8", "replace"),
            0.0,
            level,
            detail,
        )
        pos = nl + 1 + lo_ + le_
    return out
