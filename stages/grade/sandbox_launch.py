"""Starting one sandboxed launch: the interpreter, the view, the scratch folder, the command.

Per launch the host makes a scratch folder (``mkdtemp``, mode 0700: only root
reads it) and writes into it everything the namespace's init needs: a copy of
the init itself (:mod:`stages.grade.in_sandbox.init`), the program as
``prog.py``, the view, the seccomp filter, the cases' stdin and, under
``put/``, the files the program gets beside it in its /tmp (a harness's
prelude, solution and spec). The init reads them all before it mounts a tmpfs
over the folder and makes that its root, so a program sees copies of those
files in its own /tmp and nothing of the project they came from. The folder
is removed when the launch returns.
"""

from __future__ import annotations

import functools
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping

from stages.grade import seccomp as seccomp
from stages.grade.in_sandbox import program_source
from stages.grade.sandbox_collect import collect
from stages.grade.sandbox_limits import SCRUBBED_ENV, ExecResult, Isolation, SandboxLimits

_PUT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_RESERVED = ("prog.py", "stdin", "init.py", "unisolated.py", "view", "cases", "seccomp.bpf", "put")


def _world_traversable(path: str) -> bool:
    p = Path(path).resolve()
    for parent in [p, *p.parents]:
        try:
            mode = parent.stat().st_mode
        except OSError:
            return False
        need = 0o005 if parent == p else 0o001
        if mode & need != need:
            return False
    return True


@functools.lru_cache(maxsize=None)
def sandbox_python(explicit: str | None = None) -> str:
    """The interpreter programs run under (see :mod:`stages.grade.sandbox`)."""
    if explicit:
        return explicit
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and os.path.exists(cand) and _world_traversable(cand):
            return str(Path(cand).resolve())
    return sys.executable


def unshare_cmd(level: Isolation) -> list[str]:
    """``unshare`` with the namespaces of ``level`` (a user namespace too for ``"userns"``)."""
    exe = shutil.which("unshare") or "unshare"
    base = [exe, "--ipc", "--uts", "--net", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private"]
    if level == "userns":
        base.insert(1, "--user")
        base.insert(2, "--map-root-user")
    return base


@functools.lru_cache(maxsize=None)
def filesystem_view(python: str) -> tuple[str, ...]:
    """The host paths a program sees, read-only: the interpreter's installation prefix
    (``/usr`` for a system Python: interpreter, standard library, shared libraries) and
    the top-level library folders; a top-level symlink (merged /usr: ``/lib -> usr/lib``)
    is recreated as a symlink. Entries: ``"/path"`` (bind-mounted) or ``"/path=target"``."""
    prefix = Path(python).resolve().parent.parent
    tops = {Path("/usr"), Path("/" + prefix.relative_to("/").parts[0]) if prefix != Path("/") else Path("/usr")}
    tops |= {Path(p) for p in ("/lib", "/lib64", "/lib32", "/bin")}
    out = []
    for t in sorted(tops):
        if t.is_symlink():
            out.append(f"{t}={os.readlink(t)}")
        elif t.is_dir() and str(t) not in ("/tmp", "/proc", "/dev"):
            out.append(str(t))
    return tuple(out)


def _write_put(workdir: str, files: Mapping[str, bytes | str]) -> None:
    """The files a program gets beside it, under ``put/`` (plain names, none of the launch's own)."""
    put = Path(workdir, "put")
    put.mkdir()
    for name, data in files.items():
        if not _PUT_NAME.match(name) or name in _RESERVED:
            raise ValueError(
                f"sandbox file name {name!r}: a plain name (letters, digits, _ . -), none of {', '.join(_RESERVED)}"
            )
        Path(put, name).write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _init_args(workdir: str, lim: SandboxLimits, level: Isolation, fds: tuple[int, int], case_ms: int) -> list[str]:
    """The init's command line (see :mod:`stages.grade.in_sandbox.init`)."""
    tab = seccomp.table()
    mb = 1 << 20
    uid = random.randrange(*lim.uid_range) if level == "namespaces+uid" else -1
    return [
        workdir,
        str(uid),
        str(max(1, int(lim.cpu_s))),
        str(lim.memory_mb * mb),
        str(lim.file_mb * mb),
        str(lim.nproc),
        str(lim.nofile),
        str(lim.tmp_mb),
        str(lim.tmp_inodes),
        str(fds[0]),
        str(fds[1]),
        str(tab["pivot_root"] if tab else 0),
        str(case_ms),
        str(lim.output_bytes),
        str(lim.stderr_bytes),
    ]


def launch(
    source: str,
    stdin: bytes,
    lim: SandboxLimits,
    level: Isolation,
    channel: bool = False,
    cases: list[bytes] | None = None,
    case_wall_s: float = 0.0,
    files: Mapping[str, bytes | str] | None = None,
) -> ExecResult:
    """One launch. With ``cases`` the namespace's init runs the program once per case (a fresh
    fork each, ``case_wall_s`` each) and the result's ``channel`` holds its per-case records;
    ``files`` lie beside the program in its working folder."""
    t0 = time.monotonic()
    py = sandbox_python(lim.python)
    workdir = tempfile.mkdtemp(prefix="fp8rl-sbx-")
    os.chmod(workdir, 0o700)
    fds: list[int] = []
    try:
        Path(workdir, "prog.py").write_text(source, encoding="utf-8")
        in_path = Path(workdir, "stdin")
        in_path.write_bytes(stdin)
        if files:
            _write_put(workdir, files)
        if level == "none":
            chan_r, chan_w = os.pipe() if channel else (-1, -1)
            fds = [chan_r] if chan_r >= 0 else []  # _run_unisolated closes chan_w once the child has it
            return _run_unisolated(in_path, lim, t0, chan_r, chan_w)
        Path(workdir, "init.py").write_bytes(program_source("init"))
        Path(workdir, "view").write_text("\n".join(filesystem_view(py)))
        if cases is not None:
            Path(workdir, "cases").write_bytes(b"".join(b"%d\n%s" % (len(c), c) for c in cases))
        filt = seccomp.build_filter()
        if filt:
            Path(workdir, "seccomp.bpf").write_bytes(filt)
        status_r, status_w = os.pipe()
        chan_r, chan_w = os.pipe() if channel else (-1, -1)
        fds = [x for x in (status_r, status_w, chan_r, chan_w) if x >= 0]
        case_ms = max(1, int(case_wall_s * 1000)) if cases is not None else 0
        args = _init_args(workdir, lim, level, (status_w, chan_w), case_ms)
        cmd = [*unshare_cmd(level), "--", py, "-I", "-S", str(Path(workdir, "init.py")), *args]
        with open(in_path, "rb") as fin:
            proc = subprocess.Popen(
                cmd,
                stdin=fin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(SCRUBBED_ENV),
                start_new_session=True,
                close_fds=True,
                pass_fds=[x for x in (status_w, chan_w) if x >= 0],
            )
        os.close(status_w)
        fds.remove(status_w)
        if chan_w >= 0:
            os.close(chan_w)
            fds.remove(chan_w)
        status_cap = 64 if cases is None else len(cases) * (lim.output_bytes + lim.stderr_bytes + 128) + 64
        return collect(proc, lim, t0, level, status_r, chan_r, status_cap, multi=cases is not None)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


def _run_unisolated(in_path: Path, lim: SandboxLimits, t0: float, chan_r: int = -1, chan_w: int = -1) -> ExecResult:
    """Explicitly allowed fallback: rlimits + a process group, nothing else; the program
    runs in its scratch folder, with the files it gets beside it."""
    mb = 1 << 20
    scratch = in_path.parent
    Path(scratch, "unisolated.py").write_bytes(program_source("unisolated"))
    for name in os.listdir(Path(scratch, "put")) if Path(scratch, "put").is_dir() else ():
        os.replace(Path(scratch, "put", name), Path(scratch, name))

    def limits() -> None:  # pragma: no cover - runs in the child
        resource.setrlimit(resource.RLIMIT_CPU, (int(lim.cpu_s), int(lim.cpu_s) + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb * mb, lim.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_mb * mb, lim.file_mb * mb))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    with open(in_path, "rb") as fin:
        proc = subprocess.Popen(
            [sandbox_python(lim.python), "-I", "-S", "unisolated.py", str(chan_w), str(Path(scratch, "prog.py"))],
            stdin=fin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(SCRUBBED_ENV, HOME=str(scratch)),
            cwd=scratch,
            start_new_session=True,
            preexec_fn=limits,
            pass_fds=[chan_w] if chan_w >= 0 else [],
        )
    if chan_w >= 0:
        os.close(chan_w)
    return collect(proc, lim, t0, "none", -1, chan_r)
