"""Which steps calibrate has one answer: ``steps.shadow``, as the train stage recorded it.

``fp8rl rerun --stage calibrate`` recalibrates exactly the steps whose train
stage ran the BF16 shadow passes, whatever decided it (fixed K, the drift
schedule, a guard's remedy), and refuses a range it cannot serve with one line
and exit 2. The runs are made with the storage API (no campaign): a few steps
of synthetic ``token_stats``, with BF16 log-probs on the shadow steps only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
from conftest import micro_config
from typer.testing import CliRunner

from flows.campaign.configuration import dump_config
from flows.cli import app
from stages.runtime.io import RunTables, read_step, shadow_steps
from storage.ledger.events import Ledger
from storage.parts.writer import TableWriter
from storage.run.layout import create_run


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _token_stats(step: int, shadow: bool) -> dict:
    g = np.random.default_rng(step)
    n_seq, n_pos = 8, 6
    sid, pos = np.repeat(np.arange(n_seq), n_pos), np.tile(np.arange(n_pos), n_seq)
    adv = np.repeat(g.choice([-1.0, 1.0], n_seq), n_pos).astype(np.float32)
    old8 = -g.random(sid.size).astype(np.float32)
    new8 = old8 + 0.05 * g.standard_normal(sid.size).astype(np.float32)
    noise = 0.01 * g.standard_normal(sid.size).astype(np.float32)
    blank = pa.nulls(sid.size, pa.float32())  # as the train stage writes a step without shadow passes
    return {
        "sample_id": sid,
        "position": pos,
        "advantage": adv,
        "logp_fp8": new8,
        "old_logp_fp8": old8,
        "logp_bf16": new8 + noise if shadow else blank,
        "old_logp_bf16": old8 if shadow else blank,
    }


def _run(root: Path, shadow: list[int], steps: int, extra: tuple[str, ...] = ()) -> Path:
    """A run of ``steps`` trained steps whose train stage ran the shadow passes on ``shadow``."""
    run = create_run(root, "r", config=dump_config(micro_config(f"steps={steps}", *extra))).root
    w, led = TableWriter(run, durable=False), Ledger(run)
    for s in range(1, steps + 1):
        for stage in ("rollout", "score"):
            with led.stage(s, stage):
                pass
        with led.stage(s, "train") as rec:
            rec.outputs.append(str(w.write("token_stats", s, _token_stats(s, s in shadow), stage="train")))
            rec.outputs.append(str(w.write("steps", s, {"shadow": [float(s in shadow)]}, stage="train")))
    return run


def _recalibrated(run: Path, variant: str) -> list[int]:
    ctx = RunTables.open(run, variant)
    out = []
    for s in range(1, 20):
        try:
            read_step(ctx, "bounds", s)
        except FileNotFoundError:
            continue
        out.append(s)
    return out


def one_line_exit_2(r, *needles: str) -> None:
    err = r.stderr.strip()
    assert r.exit_code == 2, (r.exit_code, err, r.exception)
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert all(n in err for n in needles), err


def test_the_record_of_shadow_steps_is_what_train_wrote(tmp_path: Path) -> None:
    run = _run(tmp_path, shadow=[1, 4], steps=5)
    assert shadow_steps(RunTables.open(run), range(1, 9)) == [1, 4]


def test_rerun_calibrate_on_a_drift_scheduled_run_recalibrates_its_shadow_steps(tmp_path: Path) -> None:
    # drift shadowed step 1 only; the fixed-K rule (interval 2) would have named steps 1, 3 and 5
    run = _run(tmp_path, shadow=[1], steps=6, extra=("calibration.schedule=drift",))
    r = cli(
        "rerun",
        run,
        "--stage",
        "calibrate",
        "--steps",
        "1:6",
        "--set",
        "calibration.max_delta=0.1",
        "--variant",
        "what-if",
    )
    assert r.exit_code == 0, (r.stdout, r.stderr, r.exception)
    assert "1 step(s) of calibrate" in r.stdout
    assert _recalibrated(run, "what-if") == [1]


def test_rerun_calibrate_includes_a_guard_forced_shadow_step(tmp_path: Path) -> None:
    # fixed K = 2 shadows steps 1 and 3; a guard remedy forced step 4 as well
    run = _run(tmp_path, shadow=[1, 3, 4], steps=4)
    r = cli("rerun", run, "--stage", "calibrate", "--steps", "2:4", "--variant", "what-if")
    assert r.exit_code == 0, (r.stdout, r.stderr, r.exception)
    assert _recalibrated(run, "what-if") == [3, 4]


def test_rerun_calibrate_refuses_a_range_beyond_the_run_or_without_shadow_steps(tmp_path: Path) -> None:
    run = _run(tmp_path, shadow=[1], steps=3, extra=("calibration.schedule=drift",))
    one_line_exit_2(cli("rerun", run, "--stage", "calibrate", "--steps", "100:200"), "beyond the run", "3")
    one_line_exit_2(cli("rerun", run, "--stage", "calibrate", "--steps", "2:5"), "beyond the run")
    one_line_exit_2(cli("rerun", run, "--stage", "calibrate", "--steps", "2:3"), "no step ran the BF16 shadow", "1")
    assert _recalibrated(run, "what-if") == []
