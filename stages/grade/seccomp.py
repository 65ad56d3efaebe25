"""The seccomp filter every sandboxed program runs under (a classic-BPF program, built here).

No libseccomp: the filter is a short list of BPF instructions, assembled by
:func:`build_filter` and installed by the sandbox prelude with
``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ...)`` after ``no_new_privs``.
It is an allow-by-default filter with a deny list: the sandbox's confinement
comes from namespaces, the throw-away uid and the minimal filesystem; the
filter removes the kernel interfaces a graded program never needs and that
either undo that confinement or widen the attack surface.

Refused with ``EPERM`` (the call fails, the program goes on):

- new namespaces: ``unshare``, ``setns``, and ``clone`` with any ``CLONE_NEW*``
  flag -- a nested user namespace would give the program every capability
  inside it (mounts, raw sockets, ...), the largest kernel surface there is;
- ``clone3`` gets ``ENOSYS`` instead: its flags live in memory a filter cannot
  read, and ``ENOSYS`` makes glibc fall back to ``clone``, which is checked;
- mounts and roots: ``mount``, ``umount2``, ``pivot_root``, ``chroot``, the new
  mount API (``fsopen`` .. ``mount_setattr``), ``open_by_handle_at`` /
  ``name_to_handle_at`` (a handle can reach files outside the view);
- kernel keyrings: ``add_key``, ``request_key``, ``keyctl`` -- keys are not in
  any namespace the sandbox creates and outlive the program (a channel between
  two runs of the same uid);
- other processes' memory: ``ptrace``, ``process_vm_readv`` / ``writev``;
- ``io_uring_*`` (operations that bypass this filter), ``bpf``,
  ``perf_event_open``, ``userfaultfd``, ``fanotify_init``;
- machine administration (all need capabilities the program does not have,
  refused anyway so the answer never depends on it): modules, kexec, reboot,
  swap, accounting, quotas, clocks, hostname, syslog, iopl/ioperm, vhangup.

On x86-64 the x32 system-call range (``nr >= 0x40000000``) is refused too, and
any other architecture tag kills the process (the numbers below would not mean
what they say). Only x86-64 has a table; elsewhere :func:`build_filter`
returns ``None`` and the isolation probe says the filter is missing.
"""

from __future__ import annotations

import platform
import struct

AUDIT_ARCH_X86_64 = 0xC000003E
EPERM, ENOSYS = 1, 38
RET_ALLOW, RET_ERRNO, RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
# classic BPF opcodes
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06

CLONE_NEW_FLAGS = (
    0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
)  # NEWTIME NEWNS NEWCGROUP NEWUTS NEWIPC NEWUSER NEWPID NEWNET

X86_64 = {
    "clone": 56,
    "clone3": 435,
    "pivot_root": 155,
    "deny": {
        "unshare": 272,
        "setns": 308,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "chroot": 161,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "mount_setattr": 442,
        "open_by_handle_at": 304,
        "name_to_handle_at": 303,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "fanotify_init": 300,
        "init_module": 175,
        "finit_module": 313,
        "delete_module": 176,
        "kexec_load": 246,
        "kexec_file_load": 320,
        "reboot": 169,
        "swapon": 167,
        "swapoff": 168,
        "acct": 163,
        "quotactl": 179,
        "settimeofday": 164,
        "clock_settime": 227,
        "adjtimex": 159,
        "clock_adjtime": 305,
        "sethostname": 170,
        "setdomainname": 171,
        "syslog": 103,
        "iopl": 172,
        "ioperm": 173,
        "vhangup": 153,
        "lookup_dcookie": 212,
    },
}
TABLES = {"x86_64": (AUDIT_ARCH_X86_64, X86_64)}


def table() -> dict | None:
    """The system-call numbers of this machine's architecture (``None``: no table)."""
    entry = TABLES.get(platform.machine())
    return entry[1] if entry else None


def build_filter() -> bytes | None:
    """The filter as packed ``struct sock_filter`` records (``None`` where there is no table)."""
    entry = TABLES.get(platform.machine())
    if entry is None:
        return None
    arch, tab = entry
    deny = sorted(set(tab["deny"].values()))
    # layout: 5 header instructions, one jeq per denied call, 4 for clone3/clone, then the returns
    n_body = 5 + len(deny) + 4
    ret_allow, ret_eperm, ret_enosys = n_body, n_body + 1, n_body + 2
    prog: list[tuple[int, int, int, int]] = []

    def jump(target: int) -> int:
        off = target - (len(prog) + 1)
        assert 0 <= off < 256, off
        return off

    prog.append((LD_W_ABS, 0, 0, 4))  # A = arch
    prog.append((JEQ_K, 1, 0, arch))  # the expected arch: skip the kill
    prog.append((RET_K, 0, 0, RET_KILL_PROCESS))
    prog.append((LD_W_ABS, 0, 0, 0))  # A = nr
    prog.append((JGE_K, jump(ret_eperm), 0, 0x40000000))  # the x32 ABI
    for nr in deny:
        prog.append((JEQ_K, jump(ret_eperm), 0, nr))
    prog.append((JEQ_K, jump(ret_enosys), 0, tab["clone3"]))
    prog.append((JEQ_K, 0, jump(ret_allow), tab["clone"]))
    prog.append((LD_W_ABS, 0, 0, 16))  # A = low 32 bits of args[0] (the clone flags)
    prog.append((JSET_K, jump(ret_eperm), jump(ret_allow), CLONE_NEW_FLAGS))
    assert len(prog) == n_body
    prog += [(RET_K, 0, 0, RET_ALLOW), (RET_K, 0, 0, RET_ERRNO | EPERM), (RET_K, 0, 0, RET_ERRNO | ENOSYS)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)
