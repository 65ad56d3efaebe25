"""What the integrity, storage and one-line-error tests share: the CLI run in-process, the one-line check, a
run directory with a few rows made by the storage API (no campaign), a part as an older writer left it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from flows.cli import app
from storage.ledger.events import Ledger
from storage.parts.writer import TableWriter
from storage.run.layout import create_run


def cli(*args) -> "object":
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_exit_2(r, *needles: str) -> str:
    """The result failed with exit 2 and exactly one line on stderr holding every needle."""
    err = r.stderr.strip()
    assert r.exit_code == 2, (r.exit_code, r.stdout[-1500:], err[-1500:], r.exception)
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    for n in needles:
        assert n in err, (n, err)
    return err


def run_with_rows(root: Path, run_id: str, steps: int = 2, config: str | None = None) -> Path:
    run = create_run(root, run_id, config=config).root
    w, led = TableWriter(run, durable=False), Ledger(run)
    for s in range(1, steps + 1):
        with led.stage(s, "rollout") as rec:
            rec.outputs.append(
                str(w.write("rollouts", s, {"sample_id": np.arange(4), "prompt_id": np.arange(4)}, stage="rollout"))
            )
        with led.stage(s, "train") as rec:
            rec.outputs.append(str(w.write("steps", s, {"reward_mean": 0.1 * s}, stage="train")))
    return run


def write_old_part(run_dir: Path, table: str, stage: str, old: pa.Table) -> Path:
    """Write ``old`` as step 1's part of ``table`` in run ``r1`` of ``run_dir``, as a writer of schema version 1
    (before today's columns) left it: a part of this run, stamped with its uid."""
    uid = json.loads((run_dir / "run.json").read_text())["uid"]
    old = old.replace_schema_metadata(
        {b"fp8rl.schema_version": b"1", b"fp8rl.table": table.encode(), b"fp8rl.run_uid": uid.encode()}
    )
    dest = run_dir / "tables" / table / "run=r1" / "step=1" / f"part-{stage}-0-00000000000000000000-main.parquet"
    dest.parent.mkdir(parents=True)
    pq.write_table(old, dest)
    return dest


def mount_tmpfs(where: Path, size: str, *extra: str) -> bool:
    """Mount a tmpfs of ``size`` at ``where``; False where this process may not (not root, a container)."""
    where.mkdir(parents=True, exist_ok=True)
    opts = ",".join((f"size={size}",) + extra)
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True).returncode == 0
    )
