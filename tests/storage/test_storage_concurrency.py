"""Crashes and concurrent readers: a killed writer leaves nothing visible, readers never see duplicates."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow.parquet as pq

from storage.doctor import ERROR, check_run
from storage.ledger.events import Ledger
from storage.parts.checks import quick_parquet_check
from storage.queries.catalog import connect, query
from storage.run.layout import create_run

REPO = Path(__file__).resolve().parents[2]
ROWS = 20_000


def _spawn(code: str) -> subprocess.Popen:
    prelude = f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
    return subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


TOKEN_ROWS = f"""
import numpy as np
def rows(seed):
    rng = np.random.default_rng(seed)
    n = {ROWS}
    return {{"sample_id": np.repeat(np.arange(n // 100), 100), "position": np.tile(np.arange(100), n // 100),
            "advantage": rng.normal(size=n), "logp_fp8": -rng.random(n), "old_logp_fp8": -rng.random(n),
            "entropy": rng.random(n)}}
"""


def test_writer_killed_between_write_and_rename_leaves_nothing_visible(tmp_path: Path) -> None:
    run = create_run(tmp_path, "r").root
    proc = _spawn(
        TOKEN_ROWS
        + f"""
import os, time
from storage.parts.writer import TableWriter
def stuck(src, dst):
    print("READY", flush=True)
    time.sleep(120)
os.replace = stuck   # the writer's rename: hang there until killed
TableWriter({str(run)!r}).write("token_stats", 0, rows(0), stage="train")
"""
    )
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert list((run / "tables").rglob("*.parquet")) == []
    leftovers = list((run / "tmp").iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".parquet.tmp")
    assert connect(run).sql("SELECT count(*) FROM token_stats").fetchall() == [(0,)]
    found = check_run(run)
    assert [p.severity for p in found] == ["warning"] and "leftover temporary file" in found[0].message


def test_writer_killed_at_a_random_moment_leaves_only_complete_files(tmp_path: Path) -> None:
    run = create_run(tmp_path, "r").root
    proc = _spawn(
        TOKEN_ROWS
        + f"""
from storage.parts.writer import TableWriter
w = TableWriter({str(run)!r})
print("READY", flush=True)
for step in range(10_000):
    w.write("token_stats", step % 7, rows(step), stage="train", attempt=step)
"""
    )
    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
        deadline = time.monotonic() + 60  # a busy machine may take long for the first file
        while time.monotonic() < deadline and not any((run / "tables").rglob("*.parquet")):
            time.sleep(0.05)
        time.sleep(0.5)  # then kill at some moment of a later write
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    files = list((run / "tables").rglob("*.parquet"))
    assert files, "the writer wrote nothing before being killed; lengthen the sleep"
    for f in files:
        assert quick_parquet_check(f) is None
        assert pq.read_table(f).num_rows == ROWS
    counts = connect(run).sql("SELECT step, count(*) FROM token_stats GROUP BY step").fetchall()
    assert all(n == ROWS for _, n in counts)  # one live file per step, never two
    assert not [p for p in check_run(run) if p.severity == ERROR]


def test_queries_while_another_process_writes_and_retries(tmp_path: Path) -> None:
    run = create_run(tmp_path, "r").root
    steps = 12
    proc = _spawn(
        TOKEN_ROWS
        + f"""
from storage.parts.writer import TableWriter
w = TableWriter({str(run)!r})
for step in range({steps}):
    for attempt in range(3):   # every stage retried twice: older files move to superseded/
        w.write("token_stats", step, rows(step), stage="train", attempt=attempt)
    w.write("steps", step, {{"reward_mean": step}}, stage="train")
"""
    )
    seen = 0
    try:
        while proc.poll() is None or seen == 0:
            con = connect(run)
            by_step = query(con, "SELECT step, count(*) AS n FROM token_stats GROUP BY step").to_pylist()
            assert all(r["n"] == ROWS for r in by_step), by_step
            seen += 1
    finally:
        proc.wait(timeout=120)
    assert proc.returncode == 0, proc.stderr.read()
    assert seen > 1
    assert connect(run).sql("SELECT count(*), count(DISTINCT step) FROM token_stats").fetchall() == [
        (steps * ROWS, steps)
    ]


def test_concurrent_ledger_appends_all_survive(tmp_path: Path) -> None:
    run = create_run(tmp_path, "r").root
    code = f"""
from storage.ledger.events import Ledger
led = Ledger({str(run)!r})
for step in range(150):
    led.start(step, "stage{{}}", attempt=0)
    led.finish(step, "stage{{}}", attempt=0)
"""
    procs = [_spawn(code.replace("{}", str(i))) for i in range(2)]
    for p in procs:
        p.wait(timeout=120)
        assert p.returncode == 0, p.stderr.read()
    events, bad = Ledger(run).events()
    assert bad == [] and len(events) == 600
    assert Ledger(run).done_stages(149) == {"stage0", "stage1"}
