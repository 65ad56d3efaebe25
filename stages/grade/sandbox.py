"""Sandboxed execution of model-written Python programs (code RL).

A program runs as follows (isolation level ``"namespaces+uid"``, the one this
project's machines give a root process)::

    host:  Popen([unshare --ipc --uts --net --mount --pid --fork --kill-child
                  --propagation private -- python -I -S -c PRELUDE ...],
                 new session, scrubbed env, stdin from a file, stdout/stderr
                 pipes, a status pipe, and with channel=True a result pipe)
    ns:    PRELUDE, pid 1 of a fresh pid namespace, still root, in fresh IPC,
           UTS, network (loopback only, down) and mount namespaces:
             - reads the program, the view list and the seccomp filter from
               the host's per-run folder (root-only),
             - builds a new root on a tmpfs: the interpreter's installation
               (``/usr``; ``/lib``, ``/lib64``, ``/bin`` as symlinks on merged
               /usr) bind-mounted read-only, /dev with null/zero/random/urandom
               only, a fresh /proc of the pid namespace, a private /tmp capped
               in bytes (``tmp_mb``) and inodes (``tmp_inodes``);
               ``pivot_root`` into it, the old root detached, the new root
               remounted read-only; hostname ``sandbox``,
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

bubblewrap is not used: ``unshare`` (util-linux, essential on Debian) plus this
prelude gives every piece above with no package to install and one process
less per run; docs/sandbox.md has the reasoning and the guarantee table. The
interpreter must be readable by the throw-away uid: ``python`` in
:class:`SandboxLimits` defaults to the running interpreter when every folder on
its path is world-traversable, else ``/usr/bin/python3`` (here the venv lives
under ``/root``, mode 0700).
"""

from __future__ import annotations

import functools
import json
import os
import random
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from stages.grade import seccomp as seccomp

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


class IsolationUnavailable(RuntimeError):
    """No isolation could be obtained and unisolated runs were not allowed."""


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
    python: str | None = None  # interpreter run in the sandbox; None = auto (see module doc)


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


# ----------------------------------------------------------------- the in-namespace prelude
# Runs as root, pid 1 of the new pid namespace. argv: W U cpu as fsize nproc nofile tmpmb tmpinodes
# status_fd channel_fd pivot_nr (U = -1: no uid drop, the userns level; channel_fd = -1: none;
# pivot_nr = 0: no seccomp table). W holds prog.py, view (the read-only host paths) and, when
# there is a filter, seccomp.bpf. Kept small: it is on the hot path.
PRELUDE = r"""
import sys, os, resource as R, _ctypes as C
A = sys.argv; W = A[1]; U, cpu, as_, fs, npr, nof, tmb, tino, SF, CF, PV, MW, OB, EB = map(int, A[2:16])
def rd(n):
    try:
        with open(W + '/' + n, 'rb') as f: return f.read()
    except FileNotFoundError: return None
src, view, filt, cases = rd('prog.py'), rd('view').decode().split(), rd('seccomp.bpf'), rd('cases')
def split(b):
    out = []
    while b: n, _, b = b.partition(b'\n'); out.append(b[:int(n)]); b = b[int(n):]
    return out
cases = split(cases or b'')
class I(C._SimpleCData): _type_ = 'i'
class Fn(C.CFuncPtr): _flags_ = C.FUNCFLAG_CDECL | C.FUNCFLAG_USE_ERRNO; _restype_ = I
class L: _handle = C.dlopen(None)
mount, prctl, syscall, umount2, sethost = (Fn((n, L)) for n in ('mount', 'prctl', 'syscall', 'umount2',
                                                                   'sethostname'))
def ck(r, what):
    if r: e = C.get_errno(); raise OSError(e, 'sandbox: %s: %s' % (what, os.strerror(e)))
def mnt(s, t, fst, fl, d):
    ck(mount(s.encode() if s else None, t.encode(), fst.encode() if fst else None, fl,
             d.encode() if d else None), 'mount ' + t)
NS, ND, NX, RO, RM, BD, RC = 2, 4, 8, 1, 32, 4096, 16384
own = ',uid=%d,gid=%d' % (U, U) if U >= 0 else ''
mnt('tmpfs', W, 'tmpfs', NS | ND, 'size=256k,nr_inodes=256,mode=0755')
for d in ('tmp', 'proc', 'dev', 'old'): os.mkdir(W + '/' + d)
for item in view:
    p, _, tgt = item.partition('=')
    if tgt: os.symlink(tgt, W + p); continue
    os.makedirs(W + p); mnt(p, W + p, None, BD | RC, None); mnt(None, W + p, None, RM | BD | RO | NS | ND, None)
mnt('tmpfs', W + '/tmp', 'tmpfs', NS | ND, 'size=%dm,nr_inodes=%d,mode=0700%s' % (tmb, tino, own))
mnt('tmpfs', W + '/dev', 'tmpfs', NS | NX, 'size=16k,nr_inodes=32,mode=0755')
for d in ('null', 'zero', 'random', 'urandom'):
    open(W + '/dev/' + d, 'w').close(); mnt('/dev/' + d, W + '/dev/' + d, None, BD, None)
for d, t in (('fd', '/proc/self/fd'), ('stdin', '/proc/self/fd/0'), ('stdout', '/proc/self/fd/1'),
             ('stderr', '/proc/self/fd/2')): os.symlink(t, W + '/dev/' + d)
mnt('proc', W + '/proc', 'proc', NS | ND | NX, None)
if PV:
    ck(syscall(PV, W.encode(), (W + '/old').encode()), 'pivot_root')
    os.chdir('/'); ck(umount2(b'/old', 2), 'umount /old')
else:
    os.chroot(W); os.chdir('/')
os.rmdir('/old')
mnt(None, '/', None, RM | RO | NS | ND, None)
ck(sethost(b'sandbox', 7), 'sethostname')
with open('/tmp/prog.py', 'wb') as f: f.write(src)
if U >= 0: os.chown('/tmp/prog.py', U, U)
R.setrlimit(R.RLIMIT_CORE, (0, 0))
R.setrlimit(R.RLIMIT_CPU, (cpu, cpu + 1))
R.setrlimit(R.RLIMIT_AS, (as_, as_))
R.setrlimit(R.RLIMIT_FSIZE, (fs, fs))
R.setrlimit(R.RLIMIT_NOFILE, (nof, nof))
if U >= 0:
    R.setrlimit(R.RLIMIT_NPROC, (npr, npr))
    os.setgroups([]); os.setresgid(U, U, U); os.setresuid(U, U, U)
ck(prctl(38, 1, 0, 0, 0), 'no_new_privs')
ck(prctl(4, 0, 0, 0, 0), 'dumpable')
if filt:
    class Ch(C._SimpleCData): _type_ = 'c'
    class B(C.Array): _type_ = Ch; _length_ = len(filt)
    buf = B.from_buffer_copy(filt)
    ck(prctl(22, 2, (len(filt) // 8).to_bytes(8, 'little') + C.addressof(buf).to_bytes(8, 'little'), 0, 0),
       'seccomp')
def run_child(io):
    os.close(SF)
    for i, fd in enumerate(io): os.dup2(fd, i); os.close(fd)
    if CF >= 0 and CF != 3: os.dup2(CF, 3); os.close(CF)
    os.chdir('/tmp')
    for k in [k for k in globals() if k[:2] != '__' and k not in ('src', 'sys', 'os')]: del globals()[k]
    sys.argv = ['prog.py']
    __g = {'__name__': '__main__', '__file__': '/tmp/prog.py', '__builtins__': __builtins__}
    exec(compile(src, '/tmp/prog.py', 'exec'), __g)
    sys.exit(0)
def code(st): return os.WEXITSTATUS(st) if os.WIFEXITED(st) else -os.WTERMSIG(st)
def zap():
    try: os.kill(-1, 9)
    except ProcessLookupError: pass
def reap(pid):
    rc = None
    while True:
        try: w, st = os.waitpid(-1, 0)
        except ChildProcessError: return rc
        if w == pid: rc = code(st)
if not MW:
    pid = os.fork()
    if pid == 0: run_child(())
    if CF >= 0: os.close(CF)
    n = os.open('/dev/null', os.O_RDWR)
    for d in (0, 1, 2): os.dup2(n, d)
    while True:
        try: w, st = os.waitpid(-1, 0)
        except ChildProcessError: os._exit(0)
        if w == pid: os.write(SF, b'%d\n' % code(st)); os._exit(0)
import select, time as T
for k, data in enumerate(cases):
    fi = os.memfd_create('stdin'); os.write(fi, data); os.lseek(fi, 0, 0)
    ro, wo = os.pipe(); re_, we = os.pipe()
    pid = os.fork()
    if pid == 0: os.close(ro); os.close(re_); run_child((fi, wo, we))
    for fd in (fi, wo, we): os.close(fd)
    pf = os.pidfd_open(pid); out, err, live = bytearray(), bytearray(), {ro, re_, pf}
    end, st = T.monotonic() + MW / 1000, b''
    while live and not st:
        left = end - T.monotonic()
        if left <= 0: st = b'timeout'; break
        for fd in select.select(list(live), [], [], left)[0]:
            if fd == pf: live.discard(pf); zap(); continue
            b = os.read(fd, 65536)
            if not b: live.discard(fd)
            elif fd == ro:
                out += b
                if len(out) > OB: st = b'output_limit'
            elif len(err) < EB: err += b[:EB - len(err)]
    zap(); rc = reap(pid)
    for fd in (ro, re_, pf): os.close(fd)
    if not st: st = b'ok' if rc == 0 else b'error'
    rec = b'%d %s %d %d %d\n' % (k, st, rc if rc is not None else -9, len(out), len(err)) + bytes(out) + bytes(err)
    while rec: rec = rec[os.write(SF, rec):]
os._exit(0)
"""


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
    """The interpreter programs run under (see the module docstring)."""
    if explicit:
        return explicit
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and os.path.exists(cand) and _world_traversable(cand):
            return str(Path(cand).resolve())
    return sys.executable


def _unshare_cmd(level: Isolation) -> list[str]:
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
            res = _run(probe, b"", SandboxLimits(wall_s=20, python=py), level)
        except OSError as exc:
            reasons.append(f"{level}: {exc}")
            continue
        lines = res.stdout.split()
        if res.status == "ok" and lines[:1] == ["NONET"] and (level != "namespaces+uid" or lines[1:2] != ["0"]):
            filt = "seccomp filter on" if seccomp.build_filter() else f"no seccomp table for {os.uname().machine}"
            return level, (
                f"{level} via {_unshare_cmd(level)[0]} (ipc, uts, net, mount, pid namespaces; "
                f"probe uid {lines[1] if len(lines) > 1 else '?'}; {filt})"
            )
        reasons.append(f"{level}: probe {res.status} rc={res.returncode} {res.stderr.strip()[-200:]!r}")
    return "none", "; ".join(reasons)


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the namespace's pid 1 (the kernel then kills the whole pid namespace)
    and let the launcher reap it; only a launcher that does not exit is killed too.
    Killing both at once would orphan pid 1 to the host's init, which reaps it late."""
    for child in _children(proc.pid):
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


def _run(
    source: str,
    stdin: bytes,
    lim: SandboxLimits,
    level: Isolation,
    channel: bool = False,
    cases: list[bytes] | None = None,
    case_wall_s: float = 0.0,
) -> ExecResult:
    """One launch. With ``cases`` the namespace's init runs the program once per case (a fresh
    fork each, ``case_wall_s`` each) and the result's ``channel`` holds its per-case records."""
    t0 = time.monotonic()
    py = sandbox_python(lim.python)
    workdir = tempfile.mkdtemp(prefix="fp8rl-sbx-")
    os.chmod(workdir, 0o700)
    fds: list[int] = []
    try:
        Path(workdir, "prog.py").write_text(source, encoding="utf-8")
        in_path = Path(workdir, "stdin")
        in_path.write_bytes(stdin)
        if level == "none":
            chan_r, chan_w = os.pipe() if channel else (-1, -1)
            fds = [chan_r] if chan_r >= 0 else []  # _run_unisolated closes chan_w once the child has it
            return _run_unisolated(source, in_path, lim, t0, chan_r, chan_w)
        Path(workdir, "view").write_text("\n".join(filesystem_view(py)))
        if cases is not None:
            Path(workdir, "cases").write_bytes(b"".join(b"%d\n%s" % (len(c), c) for c in cases))
        filt = seccomp.build_filter()
        if filt:
            Path(workdir, "seccomp.bpf").write_bytes(filt)
        tab = seccomp.table()
        status_r, status_w = os.pipe()
        chan_r, chan_w = os.pipe() if channel else (-1, -1)
        fds = [x for x in (status_r, status_w, chan_r, chan_w) if x >= 0]
        uid = random.randrange(*lim.uid_range) if level == "namespaces+uid" else -1
        mb = 1 << 20
        prelude_args = [
            workdir,
            str(uid),
            str(max(1, int(lim.cpu_s))),
            str(lim.memory_mb * mb),
            str(lim.file_mb * mb),
            str(lim.nproc),
            str(lim.nofile),
            str(lim.tmp_mb),
            str(lim.tmp_inodes),
            str(status_w),
            str(chan_w),
            str(tab["pivot_root"] if tab else 0),
            str(max(1, int(case_wall_s * 1000)) if cases is not None else 0),
            str(lim.output_bytes),
            str(lim.stderr_bytes),
        ]
        cmd = [*_unshare_cmd(level), "--", py, "-I", "-S", "-c", PRELUDE, *prelude_args]
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
        return _collect(proc, lim, t0, level, status_r, chan_r, status_cap, multi=cases is not None)
    finally:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)


UNISOLATED_LAUNCHER = (
    "import os, sys\nf = int(sys.argv[1])\nif f >= 0 and f != 3:\n    os.dup2(f, 3); os.close(f)\n"
    "sys.argv = sys.argv[2:]\n"
    "exec(compile(open(sys.argv[0], 'rb').read(), sys.argv[0], 'exec'), {'__name__': '__main__'})\n"
)


def _run_unisolated(
    source: str, in_path: Path, lim: SandboxLimits, t0: float, chan_r: int = -1, chan_w: int = -1
) -> ExecResult:
    """Explicitly allowed fallback: rlimits + a process group, nothing else."""
    mb = 1 << 20
    prog = Path(in_path.parent, "prog.py")

    def limits() -> None:  # pragma: no cover - runs in the child
        resource.setrlimit(resource.RLIMIT_CPU, (int(lim.cpu_s), int(lim.cpu_s) + 1))
        resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb * mb, lim.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_mb * mb, lim.file_mb * mb))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    with open(in_path, "rb") as fin:
        proc = subprocess.Popen(
            [sandbox_python(lim.python), "-I", "-S", "-c", UNISOLATED_LAUNCHER, str(chan_w), str(prog)],
            stdin=fin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(SCRUBBED_ENV, HOME=str(in_path.parent)),
            cwd=in_path.parent,
            start_new_session=True,
            preexec_fn=limits,
            pass_fds=[chan_w] if chan_w >= 0 else [],
        )
    if chan_w >= 0:
        os.close(chan_w)
    return _collect(proc, lim, t0, "none", -1, chan_r)


def _read_all(
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


def _collect(
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
        bufs, status = _read_all(proc, lim, deadline, extra, status_cap)
        if status is not None:
            _kill_tree(proc)
        try:
            rc = proc.wait(timeout=max(0.5, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # output closed but the namespace lives on (e.g. fds closed early)
            status = status or "timeout"
            _kill_tree(proc)
            rc = proc.wait()
    finally:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
        if proc.returncode is None:
            _kill_tree(proc)
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


def _parse_case_records(
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
    ) -> ExecResult:
        """Run ``source`` (a Python program) with ``stdin``; ``wall_s`` and ``cpu_s`` override the limits
        (a harness running many cases in one process needs more than one case's worth); ``channel``
        opens the result channel (fd 3 of the program, :attr:`ExecResult.channel`)."""
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
        return _run(source, data, lim, self.isolation, channel)

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
        res = _run(source, b"", lim, self.isolation, cases=datas, case_wall_s=case_wall_s)
        if res.status == "sandbox_error":
            return [res] * len(datas)
        return _parse_case_records(res.channel, len(datas), self.isolation, case_wall_s, lim)


def describe() -> str:
    """One line: the isolation this machine gives (for logs and the CLI)."""
    level, reason = probe_isolation()
    return json.dumps({"isolation": level, "reason": reason})
