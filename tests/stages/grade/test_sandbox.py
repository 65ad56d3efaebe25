"""The sandbox against hostile programs: each is graded zero and leaves the machine as it was.

"As it was": no process of a throw-away sandbox uid survives, no file appears
outside the program's private /tmp, and (for the allocation) memory comes back.
The fork bomb is only run after the bounded fork loop shows the process cap holds.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from stages.grade.code import CodeGradingConfig, grade_code_batch, grade_program
from stages.grade.code_tests import parse_tests
from stages.grade.sandbox import Sandbox, probe_isolation
from stages.grade.sandbox_limits import SandboxLimits

LEVEL, REASON = probe_isolation()
pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(LEVEL != "namespaces+uid", reason=f"full sandbox isolation unavailable here: {REASON}"),
]

# A uid band of its own (the default band is the graders'): `sandbox_pids` then sees only
# this file's sandboxes, even while a code-RL campaign grades beside it (make test: -n 2).
LIM = SandboxLimits(
    wall_s=3.0, cpu_s=3, memory_mb=512, nproc=16, output_bytes=1 << 16, uid_range=(1_900_000, 1_990_000)
)
PROJECT = Path(__file__).resolve().parents[3]
ECHO_OK = parse_tests([{"input": "", "output": "ok"}])


@pytest.fixture(scope="module")
def sb() -> Sandbox:
    return Sandbox(LIM)


def sandbox_pids() -> list[int]:
    """Processes whose real uid is in the throw-away range."""
    lo, hi = LIM.uid_range
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for line in Path(f"/proc/{d}/status").read_text().splitlines():
                if line.startswith("Uid:"):
                    if lo <= int(line.split()[1]) < hi:
                        out.append(int(d))
                    break
        except OSError:
            continue
    return out


def assert_clean() -> None:
    for _ in range(40):
        left = sandbox_pids()
        if not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"sandbox processes survived: {left}")


def grade_zero(sb: Sandbox, code: str, tests=ECHO_OK, per_test_s: float = 2.0):
    t0 = time.monotonic()
    g = grade_program(sb, code, tests, per_test_s=per_test_s, per_sample_s=per_test_s + 1)
    took = time.monotonic() - t0
    assert g.passed == 0 and not g.correct, g
    assert took < per_test_s + 3, f"grading took {took:.1f}s"
    assert_clean()
    return g


def test_isolation_level_and_good_program(sb):
    assert sb.isolation == "namespaces+uid"
    r = sb.run("import os, sys\nprint(os.getuid(), os.getcwd(), sys.stdin.read())", "hi")
    assert r.status == "ok" and r.stdout.split()[1:] == ["/tmp", "hi"]
    assert int(r.stdout.split()[0]) >= LIM.uid_range[0]
    assert grade_program(sb, "print('ok')", ECHO_OK, per_test_s=2, per_sample_s=3).correct
    assert_clean()


def test_refuses_without_isolation(monkeypatch):
    import stages.grade.sandbox as S

    monkeypatch.setattr(S, "probe_isolation", lambda python=None: ("none", "probe patched out"))
    with pytest.raises(S.IsolationUnavailable, match="refusing"):
        S.Sandbox(LIM)
    s = S.Sandbox(LIM, allow_unisolated=True)
    assert s.isolation == "none" and s.run("print(2+2)").stdout.strip() == "4"


def test_infinite_loop(sb):
    g = grade_zero(sb, "while True:\n    pass")
    assert "timeout" in g.detail or "error" in g.detail


def test_sleep_past_wall_clock(sb):
    g = grade_zero(sb, "import time\ntime.sleep(60)\nprint('ok')")
    assert "timeout" in g.detail


def test_process_cap_holds_for_a_bounded_fork_loop(sb):
    # harmless: at most 40 forks, each child sleeps 1s; the cap (16 processes) must stop it early
    code = (
        "import os, time\nn = 0\nfor _ in range(40):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(1); os._exit(0)\n    n += "
        "1\nprint(n)"
    )
    r = sb.run(code)
    assert r.status == "ok", r
    assert int(r.stdout) < LIM.nproc
    assert_clean()


def test_fork_bomb(sb):
    test_process_cap_holds_for_a_bounded_fork_loop(sb)  # the cap holds: only now run the bomb
    grade_zero(sb, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def test_50_gib_allocation(sb):
    before = _mem_available()
    g = grade_zero(sb, "x = bytearray(50 * 1024 ** 3)\nprint('ok')")
    assert "MemoryError" in g.detail
    assert _mem_available() > before - (1 << 30)  # nothing held (other users move it by less)


def test_one_gib_to_stdout(sb):
    g = grade_zero(sb, "import sys\nb = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(b)\nprint('ok')")
    assert "output_limit" in g.detail


def test_writes_outside_the_temp_folder(sb, tmp_path):
    stamp = f"fp8rl-escape-{os.getpid()}-{time.monotonic_ns()}"
    targets = [
        PROJECT / stamp,
        tmp_path / stamp,
        Path("/var/tmp") / stamp,
        Path("/dev/shm") / stamp,
        Path("/tmp") / ".." / "var" / "tmp" / stamp,
        Path.home() / stamp,
    ]
    code = (
        "import os\nwrote = []\n"
        f"for p in {[str(t) for t in targets]!r}:\n"
        "    try:\n        open(p, 'w').write('x'); wrote.append(p)\n    except OSError:\n        pass\n"
        "print('ok' if wrote else 'blocked', wrote)"
    )
    grade_zero(sb, code)
    for t in targets:
        assert not t.exists(), t
    # the private /tmp itself is writable and vanishes with the run
    r = sb.run(f"open('/tmp/{stamp}', 'w').write('x'); print('wrote')")
    assert r.stdout.strip() == "wrote" and not Path("/tmp", stamp).exists()


def test_network_connection_to_localhost(sb):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(5)
    srv.settimeout(2.0)
    port = srv.getsockname()[1]
    got = []

    def accept():
        try:
            conn, _ = srv.accept()
            got.append(conn.recv(100))
            conn.close()
        except OSError:
            pass

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    code = (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'leak')\nprint('ok')"
    )
    g = grade_zero(sb, code)
    assert "error" in g.detail
    srv.close()
    th.join(5)
    assert got == []


def test_environment_secret_not_visible(sb, monkeypatch):
    secret = f"s3cr3t-{time.monotonic_ns()}"
    monkeypatch.setenv("FP8RL_PLANTED_SECRET", secret)
    code = (
        "import os\nfound = [v for v in os.environ.values() if 's3cr3t' in v]\n"
        "for p in os.listdir('/proc'):\n    try:\n        found.append(open('/proc/%s/environ' % p).read())\n"
        "    except OSError:\n        pass\n"
        f"for pid in (1, os.getppid(), {os.getpid()}):\n    try:\n        found.append(open('/proc/%d/environ' "
        f"% pid).read())\n"
        "    except OSError:\n        pass\n"
        "print('ok' if any('s3cr3t' in f for f in found) else 'none')"
    )
    grade_zero(sb, code)
    r = Sandbox(LIM).run(code)
    assert secret not in r.stdout and r.stdout.strip() == "none"


def test_ignores_sigterm(sb):
    code = (
        "import os, signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "if os.fork() == 0:\n    os.setsid()\n    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n    while "
        "True: time.sleep(0.1)\n"
        "while True: time.sleep(0.1)"
    )
    g = grade_zero(sb, code)
    assert "timeout" in g.detail


def test_sys_exit_inside_leetcode_function(sb):
    tests = parse_tests(
        {
            "functional": "def check(candidate):\n    assert candidate(a=1) == 2\n    assert "
            "candidate(a=2) == 3\n\n"
            "check(Solution().inc)"
        }
    )
    good = "class Solution:\n    def inc(self, a):\n        return a + 1"
    assert grade_program(sb, good, tests, per_test_s=2, per_sample_s=5).correct
    for bad in (
        "import sys\nclass Solution:\n    def inc(self, a):\n        sys.exit(0)",
        "import os\nclass Solution:\n    def inc(self, a):\n        os._exit(0)",
        "import sys\nprint('__FP8RL_CASE__ 0 1')\nclass Solution:\n    def inc(self, a):\n        sys.exit(0)",
    ):
        grade_zero(sb, bad, tests)


def test_batch_deadline_never_exceeded():
    cfg = CodeGradingConfig(per_test_s=5.0, per_sample_s=5.0, batch_wall_s=1.5, max_sandboxes=2, memory_mb=512)
    n = 6
    t0 = time.monotonic()
    res = grade_code_batch([str(i) for i in range(n)], ["import time\ntime.sleep(30)"] * n, [ECHO_OK] * n, cfg)
    took = time.monotonic() - t0
    assert took < cfg.batch_wall_s + 2.0, took
    assert all(r.passed == 0 for r in res)
    assert any(r.status == "deadline" for r in res)
    assert_clean()
