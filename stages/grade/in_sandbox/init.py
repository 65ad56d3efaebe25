"""The sandbox's init: pid 1 of a run's fresh namespaces, then the program's parent.

The host starts it as ``unshare ... -- python -I -S W/init.py W U cpu as fsize
nproc nofile tmp_mb tmp_inodes status_fd channel_fd pivot_nr case_ms out_cap
err_cap`` from a copy in the run's scratch folder ``W`` (root-only). ``U = -1``:
no uid drop (the userns level); ``channel_fd = -1``: no result channel;
``pivot_nr = 0``: no seccomp table (``chroot`` instead of ``pivot_root``);
``case_ms = 0``: one run, else one run per case with that wall clock each.

``W`` holds ``prog.py``, ``view`` (the read-only host paths, one per line,
``/path`` or ``/path=target`` for a symlink), optionally ``seccomp.bpf``,
``cases`` (length-prefixed stdin of each case) and ``put/`` (files the program
gets beside it in its /tmp, such as a harness's data). Everything is read
before a tmpfs is mounted over ``W``, which then becomes the new root; the old
root is detached, so nothing of the host but the view stays reachable.

Order matters: mounts and ``pivot_root`` need root; rlimits, then the uid drop,
then ``no_new_privs`` (the seccomp filter requires it) and the filter last,
so the filter never has to allow what the setup does. The program is forked
(pid 2) so that its own signals mean what they mean anywhere; this process
stays as its init, reaps every process and writes the program's exit status
(or ``-signal``) to ``status_fd``. In case mode it forks one program per case,
captures its stdout and stderr (``out_cap``, ``err_cap``), kills whatever the
case left before the next one, and writes one record per case:
``k status rc len_out len_err\\n`` + stdout + stderr.

It is on the hot path of every graded response: standard library only,
``_ctypes`` rather than ``ctypes`` (faster to import).
"""

import _ctypes as C
import os
import resource as R
import select
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MNT_DETACH = 2
PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 4, 22, 38, 2
DEVICES = ("null", "zero", "random", "urandom")
DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
             ("stderr", "/proc/self/fd/2"))


class Args:
    """The command line, by name (see the module docstring)."""

    def __init__(self, argv):
        self.W = argv[1]
        (self.uid, self.cpu, self.as_, self.fsize, self.nproc, self.nofile, self.tmp_mb, self.tmp_inodes,
         self.status_fd, self.chan_fd, self.pivot_nr, self.case_ms, self.out_cap, self.err_cap) = map(int, argv[2:16])


def read(W, name):
    try:
        with open(W + "/" + name, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def split_cases(b):
    """``len\\n`` + bytes, repeated: each case's stdin."""
    out = []
    while b:
        n, _, b = b.partition(b"\n")
        out.append(b[: int(n)])
        b = b[int(n):]
    return out


def read_put(W):
    """The files the program gets beside it: ``{name: bytes}`` from ``W/put``."""
    folder = W + "/put"
    if not os.path.isdir(folder):
        return {}
    return {name: read(folder, name) for name in sorted(os.listdir(folder))}


class Libc:
    """The few libc calls the standard library lacks, with errno."""

    def __init__(self):
        class Int(C._SimpleCData):
            _type_ = "i"

        class Fn(C.CFuncPtr):
            _flags_ = C.FUNCFLAG_CDECL | C.FUNCFLAG_USE_ERRNO
            _restype_ = Int

        class Lib:
            _handle = C.dlopen(None)

        self.mount, self.prctl, self.syscall, self.umount2, self.sethostname = (
            Fn((n, Lib)) for n in ("mount", "prctl", "syscall", "umount2", "sethostname")
        )

    @staticmethod
    def check(r, what):
        if r:
            e = C.get_errno()
            raise OSError(e, "sandbox: %s: %s" % (what, os.strerror(e)))

    def mnt(self, src, tgt, fstype, flags, data):
        enc = lambda s: s.encode() if s else None
        self.check(self.mount(enc(src), tgt.encode(), enc(fstype), flags, enc(data)), "mount " + tgt)


def build_root(lc, a, view):
    """The new root on a tmpfs over ``W``: the view read-only, /dev, /proc, a private /tmp;
    then ``pivot_root`` (or ``chroot``), the old root detached, the root read-only."""
    W = a.W
    own = ",uid=%d,gid=%d" % (a.uid, a.uid) if a.uid >= 0 else ""
    lc.mnt("tmpfs", W, "tmpfs", MS_NOSUID | MS_NODEV, "size=256k,nr_inodes=256,mode=0755")
    for d in ("tmp", "proc", "dev", "old"):
        os.mkdir(W + "/" + d)
    for item in view:
        p, _, tgt = item.partition("=")
        if tgt:
            os.symlink(tgt, W + p)
            continue
        os.makedirs(W + p)
        lc.mnt(p, W + p, None, MS_BIND | MS_REC, None)
        lc.mnt(None, W + p, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    tmp_opts = "size=%dm,nr_inodes=%d,mode=0700%s" % (a.tmp_mb, a.tmp_inodes, own)
    lc.mnt("tmpfs", W + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmp_opts)
    lc.mnt("tmpfs", W + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=16k,nr_inodes=32,mode=0755")
    for d in DEVICES:
        open(W + "/dev/" + d, "w").close()
        lc.mnt("/dev/" + d, W + "/dev/" + d, None, MS_BIND, None)
    for d, t in DEV_LINKS:
        os.symlink(t, W + "/dev/" + d)
    lc.mnt("proc", W + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
    if a.pivot_nr:
        lc.check(lc.syscall(a.pivot_nr, W.encode(), (W + "/old").encode()), "pivot_root")
        os.chdir("/")
        lc.check(lc.umount2(b"/old", MNT_DETACH), "umount /old")
    else:
        os.chroot(W)
        os.chdir("/")
    os.rmdir("/old")
    lc.mnt(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, None)
    lc.check(lc.sethostname(b"sandbox", 7), "sethostname")


def place_files(files, uid):
    """The program and the files it gets, in its private /tmp (owned by it, when it has a uid)."""
    for name, data in files.items():
        path = "/tmp/" + name
        with open(path, "wb") as f:
            f.write(data)
        if uid >= 0:
            os.chown(path, uid, uid)


def confine(lc, a, filt):
    """Rlimits, the uid drop, ``no_new_privs``, not dumpable, the seccomp filter (in that order)."""
    R.setrlimit(R.RLIMIT_CORE, (0, 0))
    R.setrlimit(R.RLIMIT_CPU, (a.cpu, a.cpu + 1))
    R.setrlimit(R.RLIMIT_AS, (a.as_, a.as_))
    R.setrlimit(R.RLIMIT_FSIZE, (a.fsize, a.fsize))
    R.setrlimit(R.RLIMIT_NOFILE, (a.nofile, a.nofile))
    if a.uid >= 0:
        R.setrlimit(R.RLIMIT_NPROC, (a.nproc, a.nproc))
        os.setgroups([])
        os.setresgid(a.uid, a.uid, a.uid)
        os.setresuid(a.uid, a.uid, a.uid)
    lc.check(lc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    lc.check(lc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "dumpable")
    if filt:
        class Ch(C._SimpleCData):
            _type_ = "c"

        class Buf(C.Array):
            _type_ = Ch
            _length_ = len(filt)

        buf = Buf.from_buffer_copy(filt)
        prog = (len(filt) // 8).to_bytes(8, "little") + C.addressof(buf).to_bytes(8, "little")
        lc.check(lc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, prog, 0, 0), "seccomp")


def run_child(src, io, status_fd, chan_fd):
    """In the forked child: the case's stdio, the result channel as fd 3, cwd /tmp; the init's
    own names are dropped, then the program runs as ``__main__`` from /tmp/prog.py."""
    os.close(status_fd)
    for i, fd in enumerate(io):
        os.dup2(fd, i)
        os.close(fd)
    if chan_fd >= 0 and chan_fd != 3:
        os.dup2(chan_fd, 3)
        os.close(chan_fd)
    os.chdir("/tmp")
    sys.argv = ["prog.py"]
    done = sys.exit
    init = globals()
    for k in [k for k in init if k[:2] != "__"]:
        del init[k]
    g = {"__name__": "__main__", "__file__": "/tmp/prog.py", "__builtins__": __builtins__}
    exec(compile(src, "/tmp/prog.py", "exec"), g)
    done(0)


def exit_code(st):
    return os.WEXITSTATUS(st) if os.WIFEXITED(st) else -os.WTERMSIG(st)


def kill_all():
    """SIGKILL every process of the namespace but this one (pid 1 is not a target of -1)."""
    try:
        os.kill(-1, 9)
    except ProcessLookupError:
        pass


def reap(pid):
    """Reap every child; the exit code of ``pid`` (``None`` when it was never seen)."""
    rc = None
    while True:
        try:
            w, st = os.waitpid(-1, 0)
        except ChildProcessError:
            return rc
        if w == pid:
            rc = exit_code(st)


def run_once(src, a):
    """One run: stdio inherited; the program's exit status to ``status_fd``, then exit."""
    pid = os.fork()
    if pid == 0:
        run_child(src, (), a.status_fd, a.chan_fd)
    if a.chan_fd >= 0:
        os.close(a.chan_fd)
    n = os.open("/dev/null", os.O_RDWR)
    for d in (0, 1, 2):
        os.dup2(n, d)
    while True:
        try:
            w, st = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if w == pid:
            os.write(a.status_fd, b"%d\n" % exit_code(st))
            os._exit(0)


def run_case(src, a, data):
    """One case in a fresh fork: its stdin from a memfd, stdout and stderr captured, the
    case's wall clock; everything it started killed. Returns ``(status, rc, out, err)``."""
    fi = os.memfd_create("stdin")
    os.write(fi, data)
    os.lseek(fi, 0, 0)
    ro, wo = os.pipe()
    re_, we = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ro)
        os.close(re_)
        run_child(src, (fi, wo, we), a.status_fd, a.chan_fd)
    for fd in (fi, wo, we):
        os.close(fd)
    pf = os.pidfd_open(pid)
    out, err, live = bytearray(), bytearray(), {ro, re_, pf}
    end, st = time.monotonic() + a.case_ms / 1000, b""
    while live and not st:
        left = end - time.monotonic()
        if left <= 0:
            st = b"timeout"
            break
        for fd in select.select(list(live), [], [], left)[0]:
            if fd == pf:
                live.discard(pf)
                kill_all()
                continue
            b = os.read(fd, 65536)
            if not b:
                live.discard(fd)
            elif fd == ro:
                out += b
                if len(out) > a.out_cap:
                    st = b"output_limit"
            elif len(err) < a.err_cap:
                err += b[: a.err_cap - len(err)]
    kill_all()
    rc = reap(pid)
    for fd in (ro, re_, pf):
        os.close(fd)
    return st or (b"ok" if rc == 0 else b"error"), rc, out, err


def run_cases(src, a, cases):
    """Every case in turn; one record per case to ``status_fd``, then exit."""
    for k, data in enumerate(cases):
        st, rc, out, err = run_case(src, a, data)
        rec = b"%d %s %d %d %d\n" % (k, st, rc if rc is not None else -9, len(out), len(err)) + bytes(out) + bytes(err)
        while rec:
            rec = rec[os.write(a.status_fd, rec):]
    os._exit(0)


def main(argv):
    a = Args(argv)
    src, filt = read(a.W, "prog.py"), read(a.W, "seccomp.bpf")
    view, cases, put = read(a.W, "view").decode().split(), split_cases(read(a.W, "cases") or b""), read_put(a.W)
    lc = Libc()
    build_root(lc, a, view)
    place_files({**put, "prog.py": src}, a.uid)
    confine(lc, a, filt)
    if a.case_ms:
        run_cases(src, a, cases)
    run_once(src, a)


if __name__ == "__main__":
    main(sys.argv)
