"""Programs written to game the grader: each is graded zero and leaves nothing on the host.

"Nothing on the host" is checked by :func:`snapshot` before and after: processes
(of this file's throw-away uid band, or descendants of this test process), files
owned by the band in the world-writable folders, SysV IPC objects and kernel keys
of the band. Everything is filtered to the band (or to this process), so the
other test worker running beside this one does not disturb the check.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import pytest

from stages.data.code_benchmarks import CODE_SOURCES, records_to_set
from stages.grade.code import grade_code_responses, grade_program
from stages.grade.code_tests import parse_tests
from stages.grade.functional import functional_run
from stages.grade.sandbox import Sandbox, probe_isolation
from stages.grade.sandbox_limits import SandboxLimits
from stages.grade.stdio_match import outputs_match, statement_allows_any_case

LEVEL, REASON = probe_isolation()
pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(LEVEL != "namespaces+uid", reason=f"full sandbox isolation unavailable here: {REASON}"),
]

BAND = (2_000_000, 2_090_000)  # this file's own throw-away uids
LIM = SandboxLimits(wall_s=3.0, cpu_s=3, memory_mb=512, nproc=16, output_bytes=1 << 16, uid_range=BAND, tmp_inodes=256)
PROJECT = Path(__file__).resolve().parents[3]
ECHO_OK = parse_tests([{"input": "", "output": "ok"}])
INC = parse_tests(
    {
        "functional": "def check(candidate):\n    assert candidate(a=1) == 987654321\n"
        "    assert candidate(a=2) == 3\n\ncheck(Solution().inc)"
    }
)
LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    return Sandbox(LIM)


def _in_band(uid: int) -> bool:
    return BAND[0] <= uid < BAND[1]


def _processes() -> list[str]:
    me, out = os.getpid(), []
    parents: dict[int, int] = {}
    uids: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = Path(f"/proc/{d}/status").read_text().splitlines()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in st if ":" in line)
        parents[int(d)] = int(fields.get("PPid", "0").split()[0])
        uids[int(d)] = int(fields.get("Uid", "0").split()[0])
    for pid in parents:
        p, seen = parents[pid], 0
        while p > 1 and p != me and seen < 64:
            p, seen = parents.get(p, 0), seen + 1
        if p == me or _in_band(uids[pid]):
            out.append(f"pid {pid} uid {uids[pid]}")
    return out


def _sysvipc() -> list[str]:
    out = []
    for kind in ("shm", "msg", "sem"):
        lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        col = lines[0].split().index("uid")
        out += [f"{kind}: {ln.split()[:2]}" for ln in lines[1:] if _in_band(int(ln.split()[col]))]
    return out


def _keys() -> list[str]:
    """Key counts per uid of the band (a uid's keyrings, once created, stay registered on the host)."""
    try:
        lines = Path("/proc/key-users").read_text().splitlines()
    except OSError:
        return []
    return [f"uid {ln.split(':')[0].strip()} keys {ln.split()[1]}" for ln in lines if _in_band(int(ln.split(":")[0]))]


def _files() -> list[str]:
    out = []
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue"):
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                if _in_band(e.stat(follow_symlinks=False).st_uid):
                    out.append(e.path)
            except OSError:
                continue
    return out


def snapshot() -> dict[str, set[str]]:
    return {"processes": set(_processes()), "ipc": set(_sysvipc()), "keys": set(_keys()), "files": set(_files())}


def left_since(before: dict[str, set[str]]) -> dict[str, list[str]]:
    after = snapshot()
    return {k: sorted(after[k] - before[k]) for k in after if after[k] - before[k]}


def graded_zero(sb: Sandbox, code: str, tests=ECHO_OK, per_test_s: float = 2.0) -> str:
    """Grade ``code`` (must score 0) and check, the moment the grade returns, that nothing was left."""
    before = snapshot()  # a diff: other tests of this worker may have left their own children (a Prefect server)
    g = grade_program(sb, code, tests, per_test_s=per_test_s, per_sample_s=per_test_s + 1.0)
    left = left_since(before)
    assert g.passed == 0 and not g.correct, g
    assert left == {}, left
    return g.detail


# ----------------------------------------------------------------- IPC
SYSV_EVERYTHING = LIBC + (
    "libc.shmat.restype = ctypes.c_void_p\n"
    "shm = libc.shmget(0x5eed01, 8 << 20, 0o1666)\n"
    "ctypes.memset(libc.shmat(shm, None, 0), 1, 8 << 20)\n"
    "libc.msgget(0x5eed02, 0o1666); libc.semget(0x5eed03, 1, 0o1666)\n"
    "libc.syscall(248, b'user', b'fp8rl-key', b'x', 1, -4)\n"  # add_key to the user keyring
    "print('leak')\n"
)


def test_ipc_objects_and_keys_are_not_left_on_the_host(sb):
    graded_zero(sb, SYSV_EVERYTHING)


RELAY_SEND = LIBC + (
    "q = libc.msgget(0x5eed04, 0o1666)\n"
    "msg = ctypes.create_string_buffer(b'\\1\\0\\0\\0\\0\\0\\0\\0ok', 10)\n"
    "print(libc.msgsnd(q, msg, 2, 0))\n"
)
RELAY_RECV = LIBC + (
    "q = libc.msgget(0x5eed04, 0o666)\nbuf = ctypes.create_string_buffer(64)\n"
    "n = libc.msgrcv(q, buf, 56, 0, 0o4000)\nprint(buf.raw[8:8 + n].decode() if n > 0 else 'none')\n"
)


def test_an_answer_left_in_ipc_does_not_reach_a_later_run(sb):
    first = sb.run(RELAY_SEND)
    assert first.status == "ok", first
    graded_zero(sb, RELAY_RECV)


def test_host_ipc_objects_are_invisible(sb):
    libc = ctypes.CDLL(None, use_errno=True)
    shm = libc.shmget(0, 4096, 0o1600)  # IPC_PRIVATE, this host's own
    assert shm >= 0
    try:
        code = (
            "lines = [ln for k in ('shm', 'msg', 'sem')\n"
            "         for ln in open('/proc/sysvipc/' + k).read().splitlines()[1:]]\n"
            "print('ok' if lines else 'empty')"
        )
        assert sb.run(code).stdout.strip() == "empty"
        graded_zero(sb, code)
    finally:
        libc.shmctl(shm, 0, None)  # IPC_RMID


# ----------------------------------------------------------------- the filesystem
def test_only_the_interpreter_is_visible(sb):
    targets = [
        PROJECT / "stages" / "code_grading.py",
        PROJECT / "pyproject.toml",
        "/etc/passwd",
        "/root",
        "/work/shared/data",
        os.environ.get("FP8RL_DATA_DIR", "/nonexistent"),
    ]
    code = (
        "import os\nseen = []\n"
        f"for p in {[str(t) for t in targets]!r}:\n"
        "    try:\n        os.listdir(p) if os.path.isdir(p) else open(p).read(1); seen.append(p)\n"
        "    except OSError:\n        pass\n"
        "print('ok' if seen or sorted(os.listdir('/')) != ['bin', 'dev', 'lib', 'lib64', 'proc', 'tmp', 'usr']"
        " else 'none', seen)"
    )
    assert sb.run(code).stdout.startswith("none []")
    graded_zero(sb, code)


def test_a_dataset_lookup_program_fails(sb):
    """A stdio program that looks its input up in a readable copy of the tests and prints the stored output."""
    planted = PROJECT / f".attack-data-{os.getpid()}"
    planted.mkdir(mode=0o755)
    try:
        data = planted / "tests.json"
        data.write_text(json.dumps([{"input": "6 7\n", "output": "42"}]))
        data.chmod(0o644)
        tests = parse_tests(data.read_text())
        code = (
            f"import json, sys\ninp = sys.stdin.read()\n"
            f"print(next(c['output'] for c in json.load(open({str(data)!r})) if c['input'] == inp))"
        )
        graded_zero(sb, code, tests)
    finally:
        for p in planted.iterdir():
            p.unlink()
        planted.rmdir()


def test_tmp_caps_inodes(sb):
    code = (
        "n = 0\ntry:\n    for n in range(20000):\n        open('/tmp/f%d' % n, 'w').close()\n"
        "except OSError:\n    pass\nprint(n)"
    )
    r = sb.run(code)
    assert r.status == "ok" and int(r.stdout) <= LIM.tmp_inodes, r
    graded_zero(sb, code)


# ----------------------------------------------------------------- processes and the kernel
def test_nested_user_namespace_is_refused(sb):
    code = (
        LIBC + "import subprocess\n"
        "a = libc.unshare(0x10000000)\n"
        "b = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)\n"  # clone(CLONE_NEWUSER | SIGCHLD)
        "if b == 0:\n    libc._exit(0)\n"
        "c = subprocess.run(['unshare', '--user', '--map-root-user', 'true']).returncode\n"
        "print('ok' if 0 in (a, b, c) else 'refused', a, b, c)"
    )
    r = sb.run(code)
    assert r.stdout.startswith("refused -1 -1"), r
    graded_zero(sb, code)


def test_self_sigkill_after_printing_is_not_a_clean_exit(sb):
    code = "import os, sys\nprint('ok')\nsys.stdout.flush()\nos.kill(os.getpid(), 9)"
    r = sb.run(code)
    assert r.stdout.strip() == "ok" and r.status == "error" and r.returncode == -9, r
    assert "signal 9" in graded_zero(sb, code)


@pytest.mark.parametrize(
    "code,times",
    [
        ("import time\ntime.sleep(30)", 6),
        ("import sys\nsys.stdout.write('x' * (1 << 17))", 2),
        ("import os\nos.fork()\nprint('ok')\nos.abort()", 1),
    ],
)
def test_every_process_is_reaped_before_the_grade_returns(sb, code, times):
    # no grace period: the processes are listed the moment the grade returns; repeated, as a
    # namespace's pid 1 orphaned to the host's init lingered only some of the time (~1 run in 4)
    for _ in range(times):
        graded_zero(sb, code, per_test_s=0.3)


# ----------------------------------------------------------------- the functional harness
HONEST_INC = "class Solution:\n    def inc(self, a):\n        return {1: 987654321, 2: 3}[a]"


def test_no_expected_value_enters_the_program(sb):
    run = functional_run(HONEST_INC.replace("987654321", "0"), INC, 2.0)
    for text in (run.source, *(data.decode() for data in run.files.values())):
        assert "987654321" not in text and "== 3" not in text
    assert grade_program(sb, HONEST_INC, INC, per_test_s=2, per_sample_s=3).correct


def test_return_value_whose_eq_is_always_true(sb):
    graded_zero(
        sb,
        "class Yes:\n    __eq__ = lambda s, o: True\n    __hash__ = None\n"
        "class Solution:\n    def inc(self, a):\n        return Yes()",
        INC,
    )
    graded_zero(
        sb,
        "class Big(int):\n    __eq__ = lambda s, o: True\n"
        "class Solution:\n    def inc(self, a):\n        return Big(0)",
        INC,
    )


def test_patching_compile_to_skip_the_tests(sb):
    graded_zero(
        sb,
        "import builtins\n_c = builtins.compile\n"
        "builtins.compile = lambda src, name, mode, *a, **k: _c('None' if mode == 'eval' else 'pass',"
        " name, mode)\n"
        "class Solution:\n    def inc(self, a):\n        return 0",
        INC,
    )


def test_forged_result_lines_and_os_exit(sb):
    """Pass-lines written straight to the harness's own result file (the nonce read from the
    process), then an exit before the harness can write anything true."""
    code = (
        "import os, re, gc\n"
        "def forge():\n"
        "    spec = next((o for o in gc.get_objects() if isinstance(o, dict) and 'nonce' in o), {})\n"
        "    nonce = spec.get('nonce', '')\n"
        "    r = globals()['__res']\n"
        '    line = \'%s %d ok ["i", "0x1"]\\n__FP8RL_CASE__ %d 1\\n\'\n'
        "    r.write(''.join(line % (nonce, k, k) for k in range(2)))\n"
        "    r.flush()\n"
        "    os._exit(0)\n"
        "class Solution:\n    def inc(self, a):\n        forge()"
    )
    graded_zero(sb, code, INC)


def test_reading_expected_values_from_the_process(sb):
    code = (
        "import gc, re\n"
        "class Solution:\n    def inc(self, a):\n"
        "        for o in gc.get_objects() + [v for v in globals().values() if isinstance(v, str)]:\n"
        "            for s in (o if isinstance(o, (list, tuple)) else [o]):\n"
        "                if isinstance(s, str):\n"
        "                    m = re.search(r'candidate\\(a=%d\\) == (\\d+)' % a, s)\n"
        "                    if m:\n                        return int(m.group(1))\n"
        "        return -1"
    )
    graded_zero(sb, code, INC)


# ----------------------------------------------------------------- comparison by the problem's rules
def test_integers_compare_exactly():
    assert not outputs_match("1000000000", "1000000006")
    assert not outputs_match(str(float(1234567890123456789)), "1234567890123456789")
    assert not outputs_match("1234567890123456768", "1234567890123456789")
    assert not outputs_match("5.0", "5")
    assert outputs_match("-0", "0") and outputs_match("007", "7")


def test_floats_compare_within_tolerance():
    assert outputs_match("1/3", "0.333333333") and outputs_match("0.333333333", "1/3")
    assert outputs_match("0.3333333333333333", "0.333333333")
    assert outputs_match("5e-1", "0.5") and outputs_match("0.5", "5e-1")
    assert not outputs_match("0.5001", "0.5") and not outputs_match("nan", "0.5")


def test_letter_case_only_where_the_statement_allows_it(sb):
    assert not outputs_match("yes", "YES") and outputs_match("yes", "YES", case_insensitive=True)
    assert statement_allows_any_case("You can output the answer in any case (upper or lower).")
    assert statement_allows_any_case("Print each letter in any register.")
    assert not statement_allows_any_case("For each test case print YES or NO.")
    rows = [
        {"problem": "Print YES. You may print each letter in any case.", "tests": [{"input": "", "output": "YES"}]},
        {"problem": "Print YES.", "tests": [{"input": "", "output": "YES"}]},
    ]
    bs = records_to_set("codeforces", "-", rows, CODE_SOURCES["codeforces"], None, None or _code_config())
    resp = "```python\nprint('yes')\n```"
    res = grade_code_responses(["a", "b"], [resp, resp], [p.answer for p in bs], "code", _code_config())
    assert [r.correct for r in res] == [True, False]


def _code_config():
    from fp8rl_core.config.model import CodeConfig

    return CodeConfig()


def test_a_case_leaves_no_process_to_the_next(sb):
    """One launch runs every stdin case in a fresh process; what a case started is killed before the next."""
    code = (
        "import os, sys, time\nif sys.stdin.read() == 'first':\n    if os.fork() == 0:\n"
        "        os.setsid(); time.sleep(30)\n    print('forked')\n"
        "else:\n    print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) == [1, os.getpid()])"
    )
    before = snapshot()
    res = sb.run_cases(code, ["first", "second"], case_wall_s=2.0, total_wall_s=5.0)
    assert [(r.status, r.stdout.strip()) for r in res] == [("ok", "forked"), ("ok", "True")], res
    assert left_since(before) == {}
