"""Sandboxed execution of model-written Python programs (code RL).

A program runs as follows (isolation level ``"namespaces+uid"``, the one this
project's machines give a root process)::

    host:  Popen([unshare --ipc --uts --net --mount --pid --fork --kill-child
                  --propagation private -- python -I -S W/init.py W ...],
                 new session, scrubbed env, stdin from a file, stdout/stderr
                 pipes, a status pipe, and with channel=True a result pipe)
    ns:    the init (stages/grade/in_sandbox/init.py, copied into the host's
           per-run folder W, root-only), pid 1 of a fresh pid namespace,
           still root, in fresh IPC, UTS, network (loopback only, down) and
           mount namespaces:
             - reads the program, the view list, the seccomp filter and the
               files the program gets beside it from W,
             - builds a new root on a tmpfs: the interpreter's installation
               (``/usr``; ``/lib``, ``/lib64``, ``/bin`` as symlinks on merged
               /usr) bind-mounted read-only, /dev with null/zero/random/urandom
               only, a fresh /proc of the pid namespace, a private /tmp capped
               in bytes (``tmp_mb``) and inodes (``tmp_inodes``);
               ``pivot_root`` into it, the old root detached, the new root
               remounted read-only; hostname ``sandbox``; the program (and
               its files) copied into its /tmp,
             - sets RLIMIT_CPU / AS / FSIZE / NPROC / CORE / NOFILE,
             - drops to a throw-away uid/gid (random, in ``uid_range``; no
               groups, no capabilities, ``no_new_privs``, not dumpable),
             - installs the seccomp filter (:mod:`stages.grade.seccomp`),
             - forks the program (pid 2) and stays as its init: reaps every
               process, writes the program's own exit status or signal to the
               status pipe, exits (the kernel then kills what is left).

Why each piece: the pid namespace makes "everything killed" a kernel guarantee;
the IPC namespace makes SysV shared memory, queues, semaphores and POSIX
message queues private to the run (they vanish with it, and /proc/sysvipc
lists only the run's own); the minimal view leaves nothing of the host's to
read -- no project, no data sets, no home, no host /proc; the throw-away uid
makes the program unable to write what root owns or read other processes;
the seccomp filter refuses nested namespaces (a user namespace would hand the
program every capability inside it), mounts, keyrings (not namespaced: they
would outlive the run), ptrace and a few other kernel interfaces. The program
is pid 2, not pid 1, so its own signals mean what they mean anywhere (pid 1 of
a namespace ignores its own SIGKILL). The host caps stdout, enforces the wall
clock, kills the namespace's pid 1 at the end and lets the launcher reap it
before the run returns (no process of the run outlives it), removes the
per-run folder.

Isolation levels (:func:`probe_isolation`, checked once per process):

- ``"namespaces+uid"`` -- all of the above (root, or CAP_SYS_ADMIN + CAP_SETUID).
- ``"userns"`` -- an unprivileged user namespace (``unshare --user
  --map-root-user``): same namespaces, view and filter, but no uid drop, so no
  per-program process cap (RLIMIT_NPROC would count the user's other processes).
- ``"none"`` -- neither works: :class:`Sandbox` refuses to run
  (:class:`IsolationUnavailable`) unless built with ``allow_unisolated=True``,
  in which case programs run with rlimits and a process group only.

bubblewrap is not used: ``unshare`` (util-linux, essential on Debian) plus the
init gives every piece above with no package to install and one process
less per run; docs/sandbox.md has the reasoning and the guarantee table. The
interpreter must be readable by the throw-away uid: ``python`` in
:class:`SandboxLimits` defaults to the running interpreter when every folder on
its path is world-traversable, else ``/usr/bin/python3`` (here the venv lives
under ``/root``, mode 0700).

The modules: :mod:`stages.grade.sandbox_limits` (limits, results),
:mod:`stages.grade.sandbox_launch` (the interpreter, the view, one launch),
:mod:`stages.grade.sandbox_collect` (reading a launch to its end),
:mod:`stages.grade.in_sandbox` (the programs that run inside), this one (the
isolation probe and :class:`Sandbox`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from stages.grade import seccomp as seccomp
from stages.grade.sandbox_collect import parse_case_records
from stages.grade.sandbox_launch import launch, sandbox_python, unshare_cmd
from stages.grade.sandbox_limits import ExecResult, Isolation, SandboxLimits


class IsolationUnavailable(RuntimeError):
    """No isolation could be obtained and unisolated runs were not allowed."""


@functools.lru_cache(maxsize=None)
def probe_isolation(python: str | None = None) -> tuple[Isolation, str]:
    """The strongest isolation this machine gives, with a one-line reason.

    Probes by running a tiny program at each level: it must exit 0, see no
    network interface up, run in a fresh IPC namespace behind the minimal
    filesystem view, and (for ``namespaces+uid``) run under the dropped uid.
    The reason names the seccomp filter (or says it is missing: no table for
    this architecture).
    """
    if shutil.which("unshare") is None:
        return "none", "util-linux 'unshare' not found"
    py = sandbox_python(python)
    reasons = []
    levels: list[Isolation] = ["namespaces+uid", "userns"] if os.geteuid() == 0 else ["userns"]
    probe = (
        "import os, socket\ns = socket.socket()\n"
        "try:\n    s.connect(('127.0.0.1', 9)); print('NET')\nexcept OSError:\n    print('NONET')\n"
        "print(os.getuid(), sorted(os.listdir('/')) == ['bin', 'dev', 'lib', 'lib64', 'proc', 'tmp', 'usr']"
        " or sorted(os.listdir('/')))\n"
    )
    for level in levels:
        try:
            res = launch(probe, b"", SandboxLimits(wall_s=20, python=py), level)
        except OSError as exc:
            reasons.append(f"{level}: {exc}")
            continue
        lines = res.stdout.split()
        if res.status == "ok" and lines[:1] == ["NONET"] and (level != "namespaces+uid" or lines[1:2] != ["0"]):
            filt = "seccomp filter on" if seccomp.build_filter() else f"no seccomp table for {os.uname().machine}"
            return level, (
                f"{level} via {unshare_cmd(level)[0]} (ipc, uts, net, mount, pid namespaces; "
                f"probe uid {lines[1] if len(lines) > 1 else '?'}; {filt})"
            )
        reasons.append(f"{level}: probe {res.status} rc={res.returncode} {res.stderr.strip()[-200:]!r}")
    return "none", "; ".join(reasons)


@dataclass
class Sandbox:
    """Runs programs with :class:`SandboxLimits` at the strongest isolation the
    machine gives; refuses (``IsolationUnavailable``) when none, unless
    ``allow_unisolated``."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    allow_unisolated: bool = False

    def __post_init__(self) -> None:
        self.isolation, self.isolation_reason = probe_isolation(self.limits.python)
        if self.isolation == "none" and not self.allow_unisolated:
            raise IsolationUnavailable(
                f"no sandbox isolation available ({self.isolation_reason}); refusing to run model-written code "
                "(set code.allow_unisolated: true to run with rlimits only)"
            )

    def run(
        self,
        source: str,
        stdin: str | bytes = b"",
        *,
        wall_s: float | None = None,
        cpu_s: int | None = None,
        channel: bool = False,
        files: Mapping[str, bytes | str] | None = None,
    ) -> ExecResult:
        """Run ``source`` (a Python program) with ``stdin``; ``wall_s`` and ``cpu_s`` override the limits
        (a harness running many cases in one process needs more than one case's worth); ``channel``
        opens the result channel (fd 3 of the program, :attr:`ExecResult.channel`); ``files``
        (name: content) lie beside the program in its working folder, copies made for this run."""
        lim = self.limits
        if wall_s is not None or cpu_s is not None:
            lim = SandboxLimits(
                **{
                    **lim.__dict__,
                    "wall_s": wall_s if wall_s is not None else lim.wall_s,
                    "cpu_s": cpu_s if cpu_s is not None else lim.cpu_s,
                }
            )
        data = stdin.encode("utf-8") if isinstance(stdin, str) else stdin
        return launch(source, data, lim, self.isolation, channel, files=files)

    def run_cases(
        self, source: str, inputs: Sequence[str | bytes], *, case_wall_s: float, total_wall_s: float
    ) -> list[ExecResult | None]:
        """Run ``source`` once per input in one launch: the namespace's init forks a fresh
        process per case (its own stdin, stdout, stderr, CPU limit and ``case_wall_s``) and
        kills everything the case started before the next one. Cases share the run's /tmp
        and IPC namespace (none of them holds an expected output). ``None``: a case never
        run within ``total_wall_s``; all :class:`ExecResult` alike when the launch failed."""
        datas = [x.encode("utf-8") if isinstance(x, str) else x for x in inputs]
        if self.isolation == "none":
            out: list[ExecResult | None] = []
            end = time.monotonic() + total_wall_s
            for d in datas:
                left = end - time.monotonic()
                out.append(self.run(source, d, wall_s=min(case_wall_s, left)) if left > 0 else None)
            return out
        lim = SandboxLimits(**{**self.limits.__dict__, "wall_s": total_wall_s})
        res = launch(source, b"", lim, self.isolation, cases=datas, case_wall_s=case_wall_s)
        if res.status == "sandbox_error":
            return [res] * len(datas)
        return parse_case_records(res.channel, len(datas), self.isolation, case_wall_s, lim)


def describe() -> str:
    """One line: the isolation this machine gives (for logs and the CLI)."""
    level, reason = probe_isolation()
    return json.dumps({"isolation": level, "reason": reason})
