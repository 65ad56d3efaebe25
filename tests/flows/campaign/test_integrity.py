"""Nothing silently wrong in what a run stores: one test per defect, each failing on the code before it.

Copied runs, two writers, corrupt or foreign Parquet parts, damaged checkpoints, Prefect servers
orphaned by a killed parent, queries reaching outside the runs. Everything here is fast: runs are
made with the storage API (no campaign), the CLI runs in-process (typer's runner) except where a
second process is the point (the single-writer lock, SIGKILL of a parent). Bad input and failing
storage as one line: ``tests/flows/campaign/test_one_line_errors.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import kill_session, micro_config
from integrity_helpers import cli, one_line_exit_2, run_with_rows

from flows.campaign.configuration import dump_config
from storage.checkpoints.store import CheckpointState, save_checkpoint
from storage.errors import DuplicateRun, RunLocked
from storage.ledger.events import Ledger
from storage.parts.writer import TableWriter
from storage.queries.catalog import connect, problems, query
from storage.run.layout import create_run

ROOT = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- duplicate run ids


def test_a_copied_run_is_not_counted_twice(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    a = run_with_rows(root, "A")
    shutil.copytree(a, root / "A-backup")  # cp -a: same run id in run.json
    with pytest.raises(DuplicateRun, match=r"'A' is in two directories .*A-backup"):
        connect(root)
    r = cli("query", root, "SELECT count(*) FROM rollouts")
    one_line_exit_2(r, "would count twice")
    r = cli("doctor", root)
    assert r.exit_code == 1 and "A-backup" in r.stderr
    # a symlink is another name of the same run, not a copy: counted once
    shutil.rmtree(root / "A-backup")
    (root / "A-link").symlink_to(a, target_is_directory=True)
    assert query(connect(root), "SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 8}]


# --------------------------------------------------------------------------- one writer per run


_HOLD = (
    "import sys, time; from storage.run import lock; lock.acquire(sys.argv[1]); print('held', flush=True); "
    "time.sleep(120)"
)


def _holder(run_dir: Path) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_writer_is_refused_and_a_crashed_one_leaves_no_stuck_lock(micro_run: Path) -> None:
    from storage.run import lock

    holder = _holder(micro_run)
    try:
        with pytest.raises(RunLocked, match=f"pid {holder.pid}"):
            lock.acquire(micro_run)
        one_line_exit_2(cli("resume", micro_run), "is being written by", f"pid {holder.pid}")
        one_line_exit_2(cli("rerun", micro_run, "--stage", "score", "--steps", "1:2"), "is being written by")
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no clean-up at all
        holder.wait()
    lock.acquire(micro_run)  # the kernel dropped the dead holder's lock
    lock.acquire(micro_run)  # re-entrant in one process
    lock.release(micro_run)
    assert lock.is_locked(micro_run)
    lock.release(micro_run)
    assert not lock.is_locked(micro_run)


# --------------------------------------------------------------------------- a corrupt Parquet file


def _scramble(path: Path, start: int, stop: int) -> None:
    b = bytearray(path.read_bytes())
    for i in range(start, min(stop, len(b) - 8)):
        b[i] = (b[i] * 7 + 13) % 256
    path.write_bytes(bytes(b))


def test_a_corrupt_parquet_file_is_skipped_by_name_and_doctor_names_it(tmp_path: Path) -> None:
    run = run_with_rows(tmp_path / "runs", "A")
    bad = sorted((run / "tables" / "rollouts").rglob("*.parquet"))[-1]
    n = bad.stat().st_size
    _scramble(bad, n - 200, n)  # the footer: magic bytes intact, content not
    con = connect(run)
    assert [p for p, _ in problems(con)] == [str(bad)]
    assert query(con, "SELECT count(*) AS n FROM steps").to_pylist() == [{"n": 2}]  # other tables unaffected
    assert query(con, "SELECT count(*) AS n FROM rollouts").to_pylist() == [{"n": 4}]  # the good step
    r = cli("query", run, "SELECT count(*) FROM steps")
    assert r.exit_code == 0, r.stderr
    assert f"warning: {bad}: corrupt Parquet" in r.stderr
    r = cli("doctor", run)
    assert r.exit_code == 1 and str(bad) in r.stderr


def test_a_corrupt_data_page_found_while_querying_is_skipped_by_name(tmp_path: Path) -> None:
    run = create_run(tmp_path, "A").root
    w = TableWriter(run, durable=False)
    rng = np.random.default_rng(0)
    paths = [
        w.write(
            "rollouts",
            s,
            {
                "sample_id": np.arange(20000),
                "prompt_id": np.arange(20000),
                "response": [f"{x:.9f}" for x in rng.random(20000)],
            },
            stage="rollout",
        )
        for s in (1, 2)
    ]
    import struct

    size = paths[0].stat().st_size
    with open(paths[0], "rb") as f:
        f.seek(size - 8)
        footer = struct.unpack("<I", f.read(4))[0]
    _scramble(paths[0], 4, size - footer - 8)  # every data page; the footer still reads
    con = connect(run)
    assert problems(con) == []
    rows = query(con, "SELECT count(*) AS n, count(DISTINCT response) AS d FROM rollouts").to_pylist()
    assert rows == [{"n": 20000, "d": 20000}]
    assert [p for p, _ in problems(con)] == [str(paths[0])]


# --------------------------------------------------------------------------- doctor after retention


def test_doctor_knows_checkpoints_that_retention_pruned(tmp_path: Path) -> None:
    from storage.checkpoints.retention import apply_retention

    run = create_run(tmp_path, "A").root
    led = Ledger(run)
    for s in (2, 4, 6):
        with led.stage(s, "checkpoint") as rec:
            rec.outputs.append(str(save_checkpoint(run, s, rng_state=False, state=CheckpointState(metrics={}))))
        apply_retention(run, keep_last=1)
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_6"]
    r = cli("doctor", run)
    assert r.exit_code == 0, r.stdout + r.stderr
    (run / "checkpoints" / "step_6" / "manifest.json").unlink()  # a real loss is still an error
    assert cli("doctor", run).exit_code == 1


# --------------------------------------------------------------------------- orphaned Prefect servers


_FLOW = """
import sys, time
from flows.process import child_guard
child_guard.start()
from flows.orchestration.env import configure_prefect_env
configure_prefect_env()
from prefect import flow
@flow
def noop():
    return 1
noop()
print("ready", flush=True)
time.sleep(300)
"""


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and /proc are Linux")
def test_prefect_temporary_server_dies_with_a_sigkilled_parent(tmp_path: Path) -> None:
    from flows.process.child_guard import SERVER_MARK, _is_server
    from flows.process.shutdown import children

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(tmp_path / "prefect"))
    p = subprocess.Popen(
        [sys.executable, "-c", _FLOW],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        servers = [c for c in children(p.pid) if _is_server(c)]
        assert servers, f"no child running {SERVER_MARK}"
        os.kill(p.pid, signal.SIGKILL)  # as the OOM killer does: the parent alone
        p.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(Path(f"/proc/{s}").exists() and _is_server(s) for s in servers):
            time.sleep(0.2)
        alive = [s for s in servers if Path(f"/proc/{s}").exists() and _is_server(s)]
        assert not alive, f"orphaned Prefect server(s) {alive}"
    finally:
        kill_session(p.pid)


# --------------------------------------------------------------------------- a Parquet part proves what it is


def test_a_part_of_another_table_in_a_partition_is_skipped_by_name(tmp_path: Path) -> None:
    from storage.run.layout import part_name

    run = run_with_rows(tmp_path / "runs", "A")
    stray = sorted((run / "tables" / "steps").rglob("step=2/*.parquet"))[-1]
    dest = run / "tables" / "rollouts" / "run=A" / "step=2" / part_name("rollout", 1, "main").filename  # newer write
    shutil.copy(stray, dest)
    con = connect(run)
    assert [p for p, _ in problems(con)] == [str(dest)]
    assert "misplaced part" in problems(con)[0][1] and "'steps'" in problems(con)[0][1]
    rows = query(con, "SELECT step, count(*) AS n, count(prompt_id) AS p FROM rollouts GROUP BY step ORDER BY step")
    assert rows.to_pylist() == [{"step": 1, "n": 4, "p": 4}, {"step": 2, "n": 4, "p": 4}]  # step 2 not replaced
    assert "reward_mean" not in query(con, "SELECT * FROM rollouts LIMIT 0").column_names  # no leaked columns
    r = cli("query", run, "SELECT count(*) FROM rollouts")
    assert r.exit_code == 0 and f"warning: {dest}: misplaced part" in r.stderr, r.stderr


def test_a_part_of_another_run_copied_into_a_partition_is_skipped_by_name(tmp_path: Path) -> None:
    b = run_with_rows(tmp_path / "runs", "B", steps=1)
    a = run_with_rows(tmp_path / "runs", "A")  # later: its part's write id is newer than B's
    theirs = next((a / "tables" / "rollouts").rglob("step=1/*.parquet"))
    dest = b / "tables" / "rollouts" / "run=B" / "step=1" / theirs.name
    shutil.copy(theirs, dest)  # (A's run_id column says so too: the footer says it without reading a page)
    con = connect(tmp_path / "runs")
    assert [p for p, _ in problems(con)] == [str(dest)] and "run_id 'A'" in problems(con)[0][1]
    counts = query(con, "SELECT run_id, count(*) AS n FROM rollouts GROUP BY ALL ORDER BY run_id").to_pylist()
    assert counts == [{"run_id": "A", "n": 8}, {"run_id": "B", "n": 4}]


# --------------------------------------------------------------------------- a checkpoint is verified first


def _flip(path: Path, at: int) -> None:
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


@pytest.fixture
def two_checkpoints(tmp_path: Path):
    """A run (micro config, untrained policy) with checkpoints of steps 1 and 2; yields (env, state, weights of 1)."""
    import torch

    from stages.checkpoint import run_checkpoint
    from stages.context import open_run

    cfg = micro_config()
    run = create_run(tmp_path, "ck", config=dump_config(cfg)).root
    env, state = open_run(cfg, run)
    try:
        run_checkpoint(env, state, 1)
        weights = {k: v.clone() for k, v in state.policy.state_dict().items()}
        with torch.no_grad():
            for p in state.policy.parameters():
                p.add_(1.0)
        run_checkpoint(env, state, 2)
        yield env, state, weights
    finally:
        env.close()


def _dcp_shard(run: Path, step: int) -> Path:
    return next((run / "checkpoints" / ".dcp" / f"step_{step}").glob("*.distcp"))


@pytest.mark.parametrize("damage", ["flipped bits", "truncated"])
def test_a_damaged_dcp_shard_is_set_aside_and_resume_falls_back(two_checkpoints, damage: str) -> None:
    import torch

    from stages.checkpoint import restore
    from storage.checkpoints.verify import latest_complete, set_aside_broken, verify_checkpoint
    from storage.doctor import check_run

    env, state, weights = two_checkpoints
    run, shard = env.run_dir, _dcp_shard(env.run_dir, 2)
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:
        _flip(shard, shard.stat().st_size // 2)
    assert verify_checkpoint(run / "checkpoints" / "step_2") != []
    assert latest_complete(run) == run / "checkpoints" / "step_1"
    found = [str(p) for p in check_run(run, deep=True)]
    assert any(str(shard) in p for p in found), found
    assert any(str(shard) in p for p in map(str, check_run(run))) == (damage == "truncated")  # sizes only
    moved = set_aside_broken(run)
    assert [(p.name, a) for p, _, a in moved] == [("step_2", run / "superseded" / "checkpoints" / "step_2")]
    assert not (run / "checkpoints" / ".dcp" / "step_2").exists()
    step, restored = restore(env, state, latest_complete(run))
    assert step == 1 and all(torch.equal(v, weights[k]) for k, v in restored.policy.state_dict().items())


def test_a_dcp_save_that_fails_midway_leaves_the_previous_checkpoint_whole(two_checkpoints, monkeypatch) -> None:
    import torch

    from stages.checkpoint import restore, run_checkpoint
    from storage import faults
    from storage.checkpoints.verify import latest_complete, verify_checkpoint

    env, state, _ = two_checkpoints
    run = env.run_dir
    want = {k: v.clone() for k, v in state.policy.state_dict().items()}
    monkeypatch.setenv(faults.ENV, "checkpoint@2:write:dcp=enospc")
    with torch.no_grad():
        for p in state.policy.parameters():
            p.add_(1.0)
    with faults.stage_scope("checkpoint", 2), pytest.raises(OSError, match="No space left"):
        run_checkpoint(env, state, 2)  # re-checkpointing step 2 on a full disk: the cause, not a DCP traceback
    assert verify_checkpoint(run / "checkpoints" / "step_2") == []  # the old one, shards and all
    assert not list((run / "checkpoints" / ".dcp").glob(".tmp-*"))  # the half-written folder is gone
    assert latest_complete(run) == run / "checkpoints" / "step_2"
    monkeypatch.delenv(faults.ENV)
    step, restored = restore(env, state, run / "checkpoints" / "step_2")
    assert step == 2 and all(torch.equal(v, want[k]) for k, v in restored.policy.state_dict().items())


def test_the_manifest_lists_every_file_resume_reads(two_checkpoints) -> None:
    import json

    env, _, _ = two_checkpoints
    ck = env.run_dir / "checkpoints" / "step_2"
    manifest = json.loads((ck / "manifest.json").read_text())
    dcp = ck.parent / manifest["dcp"]["dir"]
    assert set(manifest["dcp"]["files"]) == {p.name for p in dcp.iterdir()} >= {".metadata"}
    assert {"state.json", "rng.json"} <= set(manifest["files"])  # scheduler, sampler, calibrator: in state.json
    state = json.loads((ck / "state.json").read_text())
    assert state["sampler_state"] is not None and state["calibrator_state"] is not None
    assert "scheduler" in state["extra"]


# ---------------------------------------------------------------- fp8rl query writes nothing, sees only runs


WRITES = "read-only"
OUTSIDE = "queries read the run directories"


@pytest.mark.parametrize(
    "sql, needle",
    [
        ("COPY (SELECT 1) TO '{out}'", WRITES),
        ("CREATE TABLE t AS SELECT 1", WRITES),
        ("ATTACH '{out}' AS x", WRITES),
        ("SELECT 1; COPY steps TO '{out}'", WRITES),
        ("SELECT * FROM read_csv('/etc/passwd')", OUTSIDE),
        ("SELECT * FROM read_text('/etc/hostname')", OUTSIDE),
        ("SELECT * FROM glob('/root/**')", OUTSIDE),
        ("SELECT * FROM read_parquet('{outside}')", OUTSIDE),
        ("SELECT * FROM read_json('https://example.com/x.json')", OUTSIDE),
    ],
)
def test_query_writes_nothing_and_reads_nothing_but_the_runs(tmp_path: Path, sql: str, needle: str) -> None:
    import duckdb

    run = run_with_rows(tmp_path / "runs", "A")
    out, outside = tmp_path / "leak.csv", tmp_path / "outside.parquet"
    duckdb.sql(f"COPY (SELECT 1 AS x) TO '{outside}'")
    one_line_exit_2(cli("query", run, sql.format(out=out, outside=outside)), needle)
    assert not out.exists()


def test_query_still_reads_symlinked_runs_and_its_own_views(tmp_path: Path) -> None:
    import duckdb

    real = run_with_rows(tmp_path / "elsewhere", "B")
    run_with_rows(tmp_path / "runs", "A")
    (tmp_path / "runs" / "B").symlink_to(real)
    con = connect(tmp_path / "runs")
    rows = query(con, "SELECT run_id, count(*) AS n FROM rollouts GROUP BY ALL ORDER BY run_id").to_pylist()
    assert rows == [{"run_id": "A", "n": 8}, {"run_id": "B", "n": 8}]
    assert query(con, "SELECT count(*) AS n FROM ledger").to_pylist() == [{"n": 8}]  # a registered Arrow table
    part = next((real / "tables" / "steps").rglob("*.parquet"))
    assert query(con, f"SELECT count(*) AS n FROM read_parquet('{part}')").to_pylist() == [{"n": 1}]
    with pytest.raises(duckdb.PermissionException):
        query(con, "SELECT * FROM read_csv('/etc/passwd')")
    with pytest.raises(duckdb.Error):
        con.execute("SET enable_external_access = true")  # locked


def test_resume_hashes_the_newest_checkpoint_once_and_again_after_any_change(two_checkpoints, monkeypatch) -> None:
    """``resume`` sets broken checkpoints aside (hashing the newest complete one), then the flow restores it:
    the second look checks sizes only, unless a file changed since the first."""
    import storage.checkpoints.verify as ck

    monkeypatch.setenv(ck.VERIFIED_ENV, "")  # restored on teardown
    env, _, _ = two_checkpoints
    run = env.run_dir
    hashed = []
    real = ck.sha256_file
    monkeypatch.setattr(ck, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert ck.set_aside_broken(run) == []
    first = len(hashed)
    assert first > 0 and len(set(hashed)) == first  # every file of step_2 once
    assert ck.latest_complete(run) == run / "checkpoints" / "step_2"
    assert len(hashed) == first  # the restore's look: sizes only
    shard = _dcp_shard(run, 2)
    _flip(shard, shard.stat().st_size // 2)  # same size, new bytes: the fingerprint moves with the write
    assert ck.latest_complete(run) == run / "checkpoints" / "step_1"
    assert len(hashed) > first
