"""SIGINT to the process group and SIGTERM end a run in one line, leave no process behind, and resume
to the uninterrupted run's tables (``flows.process.shutdown``, ``flows.campaign.launch``, ``flows.process.torchrun``).

Each case is a real ``fp8rl`` process on the micro config. A ``wait`` fault
(``storage.faults``) holds the run at a known point of a step; the test then
sends the signal from outside, as a terminal, ``kill`` or ``timeout`` would. The
matrix covers the distinct paths, not every product of them:

===== ======= ====================== ========================== ============================================
ranks signal  sent to                point                      path
===== ======= ====================== ========================== ============================================
1     SIGINT  the process group      train, mini-batch 1, step 1  the server out of the group's reach; the flow
                                                                  records its crash on a live server
1     SIGTERM the command (``kill``) the DCP save of step 2       Prefect's own SIGTERM bridge, then ours
1     SIGTERM the process group      rollout of step 3 (start)    ``timeout -s TERM``
2     SIGINT  the process group      train, mini-batch 0, step 1  forwarded to torchrun, by torchrun to each
                                                                  rank's group; rank 0's server last
2     SIGTERM the process group      rollout of step 2 (start)    every rank and the launcher get it at once
2     SIGTERM the command            the DCP save of step 2       the launcher forwards a signal only it got
===== ======= ====================== ========================== ============================================

Each one: exit 130 / 143 within 10 s, exactly one line on stderr (the resume
command), no process left (those below the command just before the signal, by
pid and start time, and any process carrying the test's environment tag). The
1-rank run also meets a real full disk (a tmpfs, where the machine lets root
mount one) during the DCP save of step 2: one line, exit 2. The last resume
of each run gives tables identical to the uninterrupted run's
(``benchmarks/compare_runs.py``). A unit case covers the grading pool's workers
and a sandboxed program, which the micro config does not start.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from conftest import CliProcess, default_sigint, kill_session, micro_args, tagged_pids
from shared_prefect import without_server

from flows.process.shutdown import descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[3]
TAG = "FP8RL_SIGNALS_TEST_TAG"  # in the environment of every process a case starts (sandboxed programs aside)


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


class Case(CliProcess):
    """One ``fp8rl`` command in its own session, its output in files (orphans would hold pipes open)."""

    finish_s = 900.0

    def __init__(self, args: list[str], fault: str | None, tmp: Path) -> None:
        self.tag, self.marker = uuid.uuid4().hex, tmp / f"marker-{uuid.uuid4().hex[:8]}"
        # Prefect's temporary server, as by default: its place in the shutdown is part of what is tested
        env = {k: v for k, v in without_server(os.environ).items() if not k.startswith("FP8RL_FAULT")}
        env.update({TAG: self.tag, "OMP_NUM_THREADS": "1"})
        if fault:
            env.update(FP8RL_FAULT=fault, FP8RL_FAULT_MARKER=str(self.marker))
        self.out = tempfile.TemporaryFile("w+")
        super().__init__(args, env, stdout=self.out, sigint=True)

    def reached(self, timeout: float = 600) -> None:
        """Wait until the run holds at its ``wait`` fault."""
        deadline = time.monotonic() + timeout
        while not self.marker.exists():
            assert self.proc.poll() is None, f"ended ({self.proc.returncode}) before the fault point: {self.stderr()}"
            assert time.monotonic() < deadline, "the fault point was never reached"
            time.sleep(0.1)
        time.sleep(0.3)  # every rank at its point (the other rank waits in its next collective)

    def below(self) -> dict[int, str | None]:
        return {p: _start_time(p) for p in descendants(self.proc.pid)}

    def go(self) -> None:
        with open(self.marker, "a") as f:
            f.write("go\n")

    def left(self, before: dict[int, str | None], grace_s: float = 3.0) -> list[str]:
        """Processes of the case still alive ``grace_s`` after it ended (Prefect's watcher takes up to 0.5 s)."""
        deadline = time.monotonic() + grace_s
        while True:
            alive = [p for p, t in before.items() if t is not None and _start_time(p) == t] + tagged_pids(TAG, self.tag)
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        out = []
        for p in sorted(set(alive)):
            try:
                out.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160])
            except OSError:
                continue
        return out


def _interrupt(case: Case, sig: signal.Signals, *, group: bool, resume: str) -> None:
    """Send ``sig`` at the fault point; the run ends in one line, in time, leaving nothing behind."""
    case.reached()
    before = case.below()
    t0 = time.monotonic()
    (os.killpg if group else os.kill)(case.proc.pid, sig)
    code = case.finish(timeout=60)
    took = time.monotonic() - t0
    err = case.stderr()
    assert code == 128 + sig, (code, err[-3000:])
    assert err.strip().splitlines() == [f"interrupted ({sig.name}); the run stays resumable: `{resume}`"], err[-3000:]
    assert took < 10, f"{took:.1f} s from the signal to the end"
    assert len(before) >= 2, before  # the watcher and the server at least (and torchrun, ranks)
    assert case.left(before) == []


def _resume(run_dir: Path, tmp: Path, *extra: str) -> None:
    case = Case(["resume", str(run_dir), *extra], None, tmp)
    assert case.finish() == 0, case.stderr()[-3000:]


def _identical(run_a: Path, run_b: Path) -> None:
    from benchmarks.compare_runs import KEYS, compare

    for table in KEYS:
        assert compare(run_a, run_b, table) == [], f"{table} differs from the uninterrupted run"


def _reference(tmp: Path, extra: list[str], *nproc: str) -> Path:
    d = tmp / "reference"
    case = Case(["run", "tiny-cpu", "--run-dir", str(d), *micro_args(*extra), *nproc], None, tmp)
    assert case.finish() == 0, case.stderr()[-3000:]
    return d


def _mount_tmpfs(where: Path) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    cmd = ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(where)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _fill(where: Path) -> Path:
    """A file that takes every free byte of ``where``'s file system."""
    filler = where / "filler"
    block = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def test_one_rank_sigint_sigterm_and_a_full_disk_then_resume_equals_the_uninterrupted_run(tmp_path):
    ref = _reference(tmp_path, [])
    mnt = tmp_path / "mnt"
    mounted = _mount_tmpfs(mnt)
    d = mnt / "run"
    hint = f"fp8rl resume {d}"
    try:
        run = ["run", "tiny-cpu", "--run-dir", str(d), *micro_args()]
        _interrupt(Case(run, "train@1:mb1=wait", tmp_path), signal.SIGINT, group=True, resume=hint)
        case = Case(["resume", str(d)], "checkpoint@2:write:dcp=wait", tmp_path)
        _interrupt(case, signal.SIGTERM, group=False, resume=hint)
        if mounted:  # a real full disk in the middle of the sharded save
            case = Case(["resume", str(d)], "checkpoint@2:write:dcp=wait", tmp_path)
            case.reached()
            filler = _fill(mnt)
            case.go()
            code, err = case.finish(), case.stderr()
            filler.unlink()
            errors = [ln for ln in err.strip().splitlines() if ln.startswith("error: ")]
            assert code == 2 and errors and err.strip().splitlines()[-1] == errors[0], err[-3000:]
            assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
            assert "no space left on device" in errors[0] and hint in errors[0], errors[0]
        case = Case(["resume", str(d)], "rollout@3=wait", tmp_path)
        _interrupt(case, signal.SIGTERM, group=True, resume=hint)
        _resume(d, tmp_path)
        _identical(ref, d)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_two_ranks_sigint_and_sigterm_at_three_points_then_resume_equals_the_uninterrupted_run(
    tmp_path,
):
    from test_spmd_campaign import EXTRA

    ref = _reference(tmp_path, EXTRA, "--nproc-per-node", "2")
    d = tmp_path / "run"
    hint = f"fp8rl resume {d} --nproc-per-node 2"
    run = ["run", "tiny-cpu", "--run-dir", str(d), *micro_args(*EXTRA), "--nproc-per-node", "2"]
    _interrupt(Case(run, "train@1:mb0=wait", tmp_path), signal.SIGINT, group=True, resume=hint)
    case = Case(["resume", str(d), "--nproc-per-node", "2"], "rollout@2=wait", tmp_path)
    _interrupt(case, signal.SIGTERM, group=True, resume=hint)
    case = Case(["resume", str(d), "--nproc-per-node", "2"], "checkpoint@2:write:dcp=wait", tmp_path)
    _interrupt(case, signal.SIGTERM, group=False, resume=hint)
    _resume(d, tmp_path, "--nproc-per-node", "2")
    _identical(ref, d)


_POOL_AND_SANDBOX = """
import sys, threading, time
from pathlib import Path
from flows.campaign.launch import until_signal
from flows.process.shutdown import RunEnded, exit_now

def body(start_server):
    from stages.grade.pool import GradingPool
    from stages.grade.sandbox import Sandbox

    GradingPool(workers=1).grade(["a"], ["so \\\\boxed{{1}}"], ["1"], verifier="math", timeout_s=60)
    box = Sandbox(allow_unisolated=True)
    threading.Thread(target=box.run, args=("import time; time.sleep(120)",), kwargs={{"wall_s": 120}}).start()
    time.sleep(1.0)
    Path({ready!r}).write_text("ready")
    time.sleep(120)

try:
    until_signal(body, resume="fp8rl resume RUN")
except RunEnded as end:
    exit_now(end)
"""


def test_the_grading_pool_and_a_sandboxed_program_end_with_the_run(tmp_path):
    """A Ctrl-C reaches the pool's workers (the run's process group; they stay quiet) but not a sandboxed
    program (a session of its own): both are ended by the shutdown path, which says one line."""
    ready, tag = tmp_path / "ready", uuid.uuid4().hex
    env = dict(os.environ, **{TAG: tag})
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _POOL_AND_SANDBOX.format(ready=str(ready))],
            cwd=ROOT,
            env=env,
            stderr=err,
            text=True,
            start_new_session=True,
            preexec_fn=default_sigint,
        )
        try:
            deadline = time.monotonic() + 120
            while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            before = {p: _start_time(p) for p in descendants(proc.pid)}
            names = [Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in before]
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            code = proc.wait(timeout=30)
            took = time.monotonic() - t0
        finally:
            kill_session(proc.pid)
        err.seek(0)
        text = err.read()
    assert code == 130, (code, text[-3000:])
    assert text.strip().splitlines() == ["interrupted (SIGINT); the run stays resumable: `fp8rl resume RUN`"], text
    assert took < 10
    assert len(before) >= 3, names  # forkserver, a worker, the sandbox's launcher (and its program)
    time.sleep(1.0)
    assert [p for p, t in before.items() if t is not None and _start_time(p) == t] == []
