"""The campaign end to end through the CLI and Prefect.

One uninterrupted micro campaign is the reference (with an injected transient
rollout failure, which Prefect retries and the ledger records). Two more runs
are killed with SIGKILL — during the train stage, and during a rollout — and
finished with ``fp8rl resume``: their final weights and every table must equal
the reference's (timings aside), with no duplicate or missing rows.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import CliProcess, last_checkpoint_weights, micro_args

from storage.queries.catalog import connect, query

# end to end on a shared 2-core machine: a module fixture's campaign counts in its first test
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# (table, ordering key) of every table compared between runs
TABLES = {
    "rollouts": "step, sample_id",
    "scores": "step, sample_id",
    "token_stats": "step, sample_id, position",
    "steps": "step",
    "bounds": "step",
    "evals": "step, benchmark, problem_id, sample_index",
    "eval_scores": "step, benchmark, metric",
}
TIMING = ("_seconds", "_s", "per_second")


def _cli(*args: str, env: dict[str, str | None] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the CLI in its own process group, output to files (not pipes): after a
    SIGKILL, children such as Prefect's temporary server would hold pipes open."""
    import tempfile

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_FAULT")}
    full_env.update(env or {})
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None: drop the variable
    with tempfile.TemporaryFile("w+") as out:
        cmd = CliProcess(list(args), full_env, stdout=out, sigint=True)
        code = cmd.finish(timeout)  # and SIGKILL the orphans of a killed run
        out.seek(0)
        return subprocess.CompletedProcess(cmd.proc.args, code, out.read(), cmd.stderr())


def _table(run_dir: Path, table: str):
    con = connect(run_dir)
    t = query(con, f"SELECT * FROM {table} ORDER BY {TABLES[table]}")
    keep = [c for c in t.column_names if not c.endswith(TIMING) and c != "run_id"]
    nan_free = lambda v: None if isinstance(v, float) and v != v else v  # noqa: E731 (NaN != NaN)
    return [{k: nan_free(v) for k, v in row.items()} for row in t.select(keep).to_pylist()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ref") / "run"
    marker = d.parent / "fault-marker"
    r = _cli(
        "run",
        "tiny-cpu",
        "--run-dir",
        str(d),
        *micro_args(),
        # the user's first run: Prefect's temporary server (no PREFECT_API_URL), its console checked below
        env={"FP8RL_FAULT": "rollout@1=transient", "FP8RL_FAULT_MARKER": str(marker), "PREFECT_API_URL": None},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert marker.exists(), "the transient fault was never injected"
    (d.parent / "output.txt").write_text(r.stdout + "\n---stderr---\n" + r.stderr)
    return d


def test_a_normal_run_prints_progress_and_no_tracebacks(reference):
    out = (reference.parent / "output.txt").read_text()
    assert "Traceback" not in out and "database is locked" not in out
    assert "step    3/3" in out and "eval at step 0" in out and "fp8rl report" in out


def test_transient_rollout_failure_is_retried_and_recorded(reference):
    con = connect(reference)
    rows = query(
        con, "SELECT attempt, status FROM ledger WHERE step = 1 AND stage = 'rollout' ORDER BY attempt"
    ).to_pylist()
    assert rows == [{"attempt": 0, "status": "failed"}, {"attempt": 1, "status": "done"}]


def test_every_step_has_every_stage_once(reference):
    con = connect(reference)
    dup = query(con, "SELECT step, sample_id, count(*) AS n FROM rollouts GROUP BY ALL HAVING n > 1")
    assert dup.num_rows == 0
    steps = query(con, "SELECT step FROM steps ORDER BY step").column("step").to_pylist()
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("fault", ["train@2:mb1=kill", "rollout@3=kill"])
def test_sigkill_then_resume_equals_the_uninterrupted_run(reference, tmp_path, fault):
    d = tmp_path / "run"
    r = _cli("run", "tiny-cpu", "--run-dir", str(d), *micro_args(), env={"FP8RL_FAULT": fault})
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-3000:])
    r = _cli("resume", str(d))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for table in TABLES:
        assert _table(d, table) == _table(reference, table), f"{table} differs after resume ({fault})"
    ref_w, got_w = last_checkpoint_weights(reference), last_checkpoint_weights(d)
    assert ref_w.keys() == got_w.keys()
    for k in ref_w:
        assert (ref_w[k] == got_w[k]).all(), k


def test_resume_from_a_stage_sets_aside_later_outputs(reference, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(reference, d)
    r = _cli("resume", str(d), "--from", "calibrate", "--step", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert any((d / "superseded").rglob("*.parquet"))
    assert _table(d, "bounds") == _table(reference, "bounds")


def _one_line_exit_2(r, *needles: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout[-1500:], err[-3000:])
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    # one line says what happened (library warnings of a started run may precede it; no traceback)
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0] and "Traceback" not in err, err[-3000:]
    for n in needles:
        assert n in errors[0], (n, errors[0])


def _mount_tmpfs(where: Path, *opts: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", ",".join(("size=256m",) + opts), "tmpfs", str(where)], capture_output=True
        ).returncode
        == 0
    )


def test_fault_matrix_each_fault_is_one_line_then_a_clean_resume(reference, tmp_path):
    """Disk full, a path blocked by a file, a corrupt Parquet part, read-only storage, then a Ctrl-C —
    in turn on one run: each is one line (exit 2; the Ctrl-C exit 130) and loses nothing; the last
    resume equals the uninterrupted run, tables and weights.

    (SIGKILL at the existing fault points: test_sigkill_then_resume_equals_the_uninterrupted_run.)
    """
    mnt = tmp_path / "mnt"
    mounted = _mount_tmpfs(mnt)  # read-only storage needs a mount (root); skipped as a case otherwise
    d = mnt / "run"
    try:
        # disk full while writing token_stats of step 2 (ENOSPC, as a full disk raises it)
        fault = "train@2:write:token_stats=enospc"
        r = _cli("run", "tiny-cpu", "--run-dir", str(d), *micro_args(), env={"FP8RL_FAULT": fault})
        _one_line_exit_2(r, "no space left on device", f"fp8rl resume {d}")
        # a path the run needs is blocked by a file
        shutil.rmtree(d / "tmp")
        (d / "tmp").write_text("not a folder")
        _one_line_exit_2(_cli("resume", str(d)), str(d / "tmp"))
        (d / "tmp").unlink()
        # a corrupt Parquet part that resume must read (step 2's rollouts, for the train replay)
        part = next((d / "tables" / "rollouts").glob("run=*/step=2/*.parquet"))
        good = part.read_bytes()
        part.write_bytes(good[:4] + bytes(b ^ 0x5A for b in good[4:-8]) + good[-8:])
        _one_line_exit_2(_cli("resume", str(d)), str(part), "corrupt")
        part.write_bytes(good)  # restored from a copy
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            _one_line_exit_2(_cli("resume", str(d)), "read-only file system")
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        # Ctrl-C (SIGINT) in step 3's train: one line naming the command that resumes, exit 130
        r = _cli("resume", str(d), env={"FP8RL_FAULT": "train@3:mb1=sigint"})
        assert r.returncode == 130, (r.returncode, r.stderr[-3000:])
        assert (
            r.stderr.strip().splitlines()[-1]
            == f"interrupted (SIGINT); the run stays resumable: `fp8rl resume {d.resolve()}`"
        )
        assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
        r = _cli("resume", str(d))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        for table in TABLES:
            assert _table(d, table) == _table(reference, table), f"{table} differs after the faults and resume"
        ref_w, got_w = last_checkpoint_weights(reference), last_checkpoint_weights(d)
        assert ref_w.keys() == got_w.keys() and all((ref_w[k] == got_w[k]).all() for k in ref_w)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _dcp_shard(run_dir: Path, step: int) -> Path:
    return next((run_dir / "checkpoints" / ".dcp" / f"step_{step}").glob("*.distcp"))


def _set_aside_line(r, step: int) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"warning: checkpoint step_{step} ")]
    assert len(lines) == 1 and "set aside" in lines[0] and "restarts from the start" in lines[0], r.stderr[-3000:]


def test_fault_matrix_checkpoint_faults_end_in_the_uninterrupted_run(reference, tmp_path):
    """The checkpoint's own faults, in turn on one run (one process: DCP checkpoints too): SIGKILL in the
    middle of the sharded save (a half-written DCP folder), a full disk during it, then flipped bits and
    a truncation in a shard of the newest checkpoint. The save faults are a crash or one line; a damaged
    checkpoint is set aside with one line and resume falls back; the run ends equal to the uninterrupted one.
    """
    d = tmp_path / "run"
    r = _cli("run", "tiny-cpu", "--run-dir", str(d), *micro_args(), env={"FP8RL_FAULT": "checkpoint@2:write:dcp=kill"})
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-3000:])
    assert list((d / "checkpoints" / ".dcp").glob(".tmp-step_2-*")) and not (d / "checkpoints" / "step_2").exists()
    r = _cli("resume", str(d), env={"FP8RL_FAULT": "checkpoint@2:write:dcp=enospc"})
    _one_line_exit_2(r, "no space left on device", f"fp8rl resume {d}")
    assert not (d / "checkpoints" / "step_2").exists()
    r = _cli("resume", str(d), env={"FP8RL_FAULT": "train@3:mb1=kill"})  # step 2's checkpoint, then a crash
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-3000:])
    for damage in ("flip", "truncate"):
        shard = _dcp_shard(d, 2)
        data = bytearray(shard.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            del data[len(data) // 2 :]
        shard.write_bytes(bytes(data))
        if damage == "flip":
            assert _cli("doctor", str(d)).returncode == 0  # sizes agree: only hashes see flipped bits
        assert _cli("doctor", "--deep", str(d)).returncode == 1
        # the flip: resume sets step 2 aside, replays it (a new step 2 checkpoint) and is killed in step 3 again
        r = _cli("resume", str(d), env={"FP8RL_FAULT": "train@3:mb1=kill"} if damage == "flip" else None)
        _set_aside_line(r, 2)
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        assert r.returncode == (-signal.SIGKILL if damage == "flip" else 0), (r.returncode, r.stderr[-3000:])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    for table in TABLES:
        assert _table(d, table) == _table(reference, table), f"{table} differs after the checkpoint faults"
    ref_w, got_w = last_checkpoint_weights(reference), last_checkpoint_weights(d)
    assert ref_w.keys() == got_w.keys() and all((ref_w[k] == got_w[k]).all() for k in ref_w)
    assert _cli("doctor", "--deep", str(d)).returncode == 0
