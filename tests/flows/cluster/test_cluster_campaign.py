"""Campaigns submitted to a real Slurm: two ``slurmd`` on this machine (tests/slurm_cluster.py), one for the module.

The micro campaign of tests/flows/campaign/test_spmd_campaign.py (2 steps, gloo, 1 thread a rank) runs as
``fp8rl submit --backend slurm`` jobs: one torchrun agent per node (``srun``), c10d rendezvous on
the first node's ``NodeAddr`` (127.0.0.1: the node names n1 and n2 do not resolve). Checks:

- a 2-node job gives tables bit-identical to the 2-rank single-machine run
  (``benchmarks/compare_runs.py``'s compare, every table);
- faults, one after the other in one run: one node's torchrun agent SIGKILLed in step 2's train
  (``srun --kill-on-bad-exit`` ends the job: FAILED), then the resubmitted job's ranks SIGSTOPped
  (no stage limit can fire in a stopped rank and torchrun sees live workers, so the supervisor's
  heartbeat, ``timeouts.heartbeat_s``, is what fires: cancelled), then the third job completes; the
  tables equal the uninterrupted run's, so no prompt was skipped or repeated;
- a 2-node x 2-rank job places local ranks 0 and 1 on each node and job ranks 0-3 (rank and local
  rank differ on one node); SIGTERM to ``fp8rl submit`` cancels it and records the attempt;
- bad input that needs the scheduler to see (more nodes than the partition has) is one line;
- after each: no Slurm job and no process of the run left.

Without ``slurm-wlm`` and ``munge`` (or not as root) the module skips with one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import slurm_cluster
from conftest import micro_args
from shared_prefect import free_port

from storage.queries.catalog import connect, query

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
from compare_runs import KEYS, compare  # noqa: E402

EXTRA = [  # as tests/flows/campaign/test_spmd_campaign.py: 2 generation blocks of 4 prompts, one per rank
    "steps=2",
    "threads=1",
    "precision.train=fp8_rowwise",
    "algorithm.overlong_shaping=true",
    "rollout.generation_batch_size=16",
    "algorithm.overlong_max_len=12",
    "algorithm.overlong_cache_len=8",
]
TWO_BY_TWO = ["cluster.gpus_per_node=2", "algorithm.micro_batch_size=4", "rollout.generation_batch_size=8"]
# stage limits far above the micro stages' 1-2 s; the heartbeat above them and above a job's start on a
# busy 2-core machine (imports of torch and Prefect, the rendezvous: up to ~40 s before the first ledger write)
SHORT_LIMITS = [f"timeouts.{s}_s=20" for s in ("rollout", "score", "train", "calibrate", "evaluate", "checkpoint")]
SHORT_LIMITS += ["timeouts.process_group_s=25", "timeouts.heartbeat_s=60"]


@pytest.fixture(scope="module")
def scratch():
    """A folder of this module's own: the cluster's state and the runs (pytest prunes old basetemp folders,
    those of a concurrent pytest session included)."""
    root = Path(tempfile.mkdtemp(prefix="fp8rl-slurm-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(scratch):
    try:
        c = slurm_cluster.start(scratch / "cluster")
    except slurm_cluster.Unavailable as err:
        pytest.skip(str(err))
    yield c
    c.stop()
    assert not [p for p in c.pids() if slurm_cluster._alive(p)], "a Slurm or munge daemon outlived the cluster"


def _sets(*extra: str) -> list[str]:
    return micro_args(*EXTRA, *extra)


def _env(cluster) -> dict:
    return dict(cluster.env, OMP_NUM_THREADS="1", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="300")


def _submit(cluster, run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flows.cli", "submit", "tiny-cpu", "--backend", "slurm", "--run-dir", str(run_dir)]
    cmd += _sets(f"cluster.shared_path={run_dir.parent}", "cluster.nodes=2", "cluster.request_gpus=false",
                 "cluster.poll_s=0.5", f"cluster.rendezvous_port={free_port()}", *extra)  # fmt: skip
    return subprocess.Popen(cmd, env=_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def _supervised(cluster, run_dir: Path, *extra: str):
    """``fp8rl submit`` as a process; if the test fails while it runs, it is stopped the user's way (SIGTERM:
    it cancels its job and waits for Slurm to end it) before the cluster is, so it cannot resubmit."""
    proc = _submit(cluster, run_dir, *extra)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out + err


def _processes_of(run_dir: Path) -> list[tuple[int, str, dict]]:
    """(pid, command line, environment) of the live processes whose command line names ``run_dir``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if str(run_dir) not in cmd or (d / "stat").read_text().split()[2] == "Z":
                continue
            env = dict(e.split("=", 1) for e in (d / "environ").read_bytes().decode().split("\0") if "=" in e)
        except (OSError, ValueError):
            continue
        found.append((int(d.name), cmd, env))
    return found


def _wait_for(proc: subprocess.Popen, run_dir: Path, step: int, stage: str, status: str, timeout: float = 300) -> None:
    from storage.ledger.events import Ledger

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "run.json").exists() and Ledger(run_dir).status(step, stage) == status:
            return
        time.sleep(0.2)
    _, out = _finish(proc, timeout=5)
    raise AssertionError(f"step {step} {stage} never became {status} in {run_dir}: {out[-2000:]}")


def _attempts(run_dir: Path) -> list[dict]:
    return query(connect(run_dir), "SELECT * FROM job_attempts ORDER BY attempt").to_pylist()


def _nothing_left(cluster, run_dir: Path) -> None:
    deadline = time.monotonic() + 30
    while (cluster.jobs() or _processes_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.jobs() == [], "a Slurm job was left behind"
    assert _processes_of(run_dir) == [], "a process of the run was left behind"


def _same_tables(a: Path, b: Path) -> None:
    for table in KEYS:
        assert compare(a, b, table) == [], table


@pytest.fixture(scope="module")
def reference(scratch) -> Path:
    """The 2-rank single-machine run (torchrun --standalone), as tests/flows/campaign/test_spmd_campaign.py makes it,
    here through ``fp8rl submit --backend local`` (which is ``fp8rl run --nproc-per-node 2``)."""
    run_dir = scratch / "local" / "two-ranks"
    cmd = [sys.executable, "-m", "flows.cli", "submit", "tiny-cpu", "--backend", "local", "--gpus-per-node", "2"]
    cmd += ["--run-dir", str(run_dir)]
    r = subprocess.run(cmd + _sets(), env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_two_node_job_equals_the_two_rank_run_on_one_machine(cluster, reference, scratch):
    run_dir = scratch / "shared" / "two-nodes"
    with _supervised(cluster, run_dir) as proc:
        code, out = _finish(proc)
    assert code == 0, out[-3000:]
    _same_tables(reference, run_dir)
    [a] = _attempts(run_dir)
    assert (a["attempt"], a["state"], a["exit_reason"], a["nodes"]) == (1, "COMPLETED", "completed", "n[1-2]")
    assert a["resumed_from_step"] is None
    [log] = (run_dir / "cluster").glob("job-*.out")  # the rendezvous host: n1's NodeAddr, looked up in the job
    assert f"fp8rl job {a['job_id']} on n[1-2]: rendezvous 127.0.0.1:" in log.read_text()
    _nothing_left(cluster, run_dir)


def _ranks(run_dir: Path, *, not_of_job: str | None = None) -> list[tuple[int, dict]]:
    """(pid, environment) of the run's ranks (flows.spmd under torchrun), those of ``not_of_job`` left out."""
    return [
        (p, env)
        for p, cmd, env in _processes_of(run_dir)
        if "-m flows.spmd" in cmd and "torchrun" not in cmd and env.get("SLURM_JOB_ID") != not_of_job
    ]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_node_then_stopped_ranks_are_resubmitted_and_resume_to_the_same_tables(cluster, reference, scratch):
    """Attempt 1: one node's torchrun agent SIGKILLed in step 2's train (srun ends the job: FAILED). Attempt 2:
    both ranks SIGSTOPped as they start (no rank can fire a stage limit, torchrun sees live workers: the
    heartbeat fires; cancelled). Attempt 3 resumes and completes with the uninterrupted run's tables."""
    run_dir = scratch / "shared" / "faults"
    with _supervised(cluster, run_dir, *SHORT_LIMITS) as proc:
        _wait_for(proc, run_dir, 2, "train", "running")
        torchrun = ["-m", "flows.process.torchrun"]
        agents = [(p, env) for p, cmd, env in _processes_of(run_dir) if cmd.split()[1:3] == torchrun]
        n2 = [(p, env) for p, env in agents if env.get("SLURMD_NODENAME") == "n2"]
        assert len(agents) == 2 and len(n2) == 1, [(p, env.get("SLURMD_NODENAME")) for p, env in agents]
        os.kill(n2[0][0], signal.SIGKILL)
        first_job = n2[0][1]["SLURM_JOB_ID"]
        deadline = time.monotonic() + 300
        while len(_ranks(run_dir, not_of_job=first_job)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        stopped = _ranks(run_dir, not_of_job=first_job)
        assert len(stopped) == 2, stopped
        for p, _ in stopped:
            os.kill(p, signal.SIGSTOP)
        code, out = _finish(proc)
    assert code == 0, out[-3000:]
    killed, hung, done = _attempts(run_dir)
    assert killed["state"] == "FAILED" and killed["exit_reason"].startswith("job FAILED"), killed
    assert hung["state"] == "CANCELLED" and hung["exit_reason"].startswith("heartbeat missed"), hung  # what fired
    assert (done["exit_reason"], done["resumed_from_step"], hung["resumed_from_step"]) == ("completed", 2, 2), done
    assert len({killed["job_id"], hung["job_id"], done["job_id"]}) == 3
    assert killed["ended_at"] <= hung["submitted_at"] and hung["ended_at"] <= done["submitted_at"]
    _same_tables(reference, run_dir)  # every prompt of every step once: the same rollouts, bit for bit
    _nothing_left(cluster, run_dir)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_two_by_two_job_places_ranks_per_node_and_a_stopped_supervisor_cancels_it(cluster, scratch):
    """2 nodes x 2 ranks: each node runs local ranks 0 and 1, the job ranks 0-3 (so rank and local rank
    differ on one node). SIGTERM to ``fp8rl submit`` (a user's Ctrl-C or kill) cancels the job, records
    the attempt as interrupted, and leaves nothing running."""
    run_dir = scratch / "shared" / "two-by-two"
    with _supervised(cluster, run_dir, *TWO_BY_TWO) as proc:
        _wait_for(proc, run_dir, 0, "evaluate", "running")
        placed = sorted((e["SLURMD_NODENAME"], e["LOCAL_RANK"], e["RANK"]) for _, e in _ranks(run_dir))
        assert [(n, lr) for n, lr, _ in placed] == [("n1", "0"), ("n1", "1"), ("n2", "0"), ("n2", "1")], placed
        assert sorted(r for _, _, r in placed) == ["0", "1", "2", "3"], placed
        assert {e["WORLD_SIZE"] for _, e in _ranks(run_dir)} == {"4"}
        proc.terminate()
        code, out = _finish(proc, timeout=120)
    assert code == 143, out[-3000:]
    [a] = _attempts(run_dir)
    assert a["state"] == "CANCELLED" and a["exit_reason"].startswith("interrupted"), a
    _nothing_left(cluster, run_dir)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_more_nodes_than_the_partition_has_is_one_line_before_anything_is_written(cluster, scratch):
    run_dir = scratch / "shared" / "too-many"
    with _supervised(cluster, run_dir, "cluster.nodes=3") as proc:
        code, out = _finish(proc, timeout=100)
    assert code == 2 and out.strip() == "error: cluster.nodes=3: partition debug has 2 node(s)", out
    assert not run_dir.exists() and cluster.jobs() == []
