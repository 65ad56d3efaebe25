"""The guard: detectors against a slow loop; a tripped rollback on the micro campaign."""

from __future__ import annotations

import math
import statistics

import pytest

from fp8rl_core.config.pipeline import GuardConfig
from fp8rl_core.signals.guard import check, last_good_step, surge_start


def _surge_slow(xs, factor, window, persist, floor=0.0):
    for s in range(len(xs)):
        if s < window or s + persist > len(xs):
            continue
        ref = statistics.median(xs[s - window : s])
        if all(xs[j] > factor * ref and xs[j] > floor for j in range(s, s + persist)):
            return s
    return None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(6))
def test_surge_matches_slow_loop(seed):
    import random

    rng = random.Random(seed)
    xs = [0.1 + 0.02 * rng.random() for _ in range(30)]
    start = rng.randrange(5, 28)
    for j in range(start, min(start + rng.randrange(1, 5), 30)):
        xs[j] *= 1.4 + 0.3 * rng.random()
    for window, persist in ((10, 3), (3, 2), (5, 1)):
        assert surge_start(xs, factor=1.5, window=window, persist=persist) == _surge_slow(xs, 1.5, window, persist)


@pytest.mark.timeout(30)
def test_surge_definition_edges():
    base = [1.0] * 10
    assert surge_start(base + [1.6, 1.6], factor=1.5, window=10, persist=3) is None  # only 2 steps above
    assert surge_start(base + [1.6, 1.6, 1.6], factor=1.5, window=10, persist=3) == 10
    assert surge_start(base + [1.6, 1.5, 1.6], factor=1.5, window=10, persist=3) is None  # not strictly above
    assert surge_start([1.0] * 9 + [2, 2, 2], factor=1.5, window=10, persist=3) is None  # too little history
    # the floor: a zero garbled share rising to 0.02 is no surge at floor 0.05
    assert surge_start([0.0] * 10 + [0.02] * 3, factor=1.5, window=10, persist=3, floor=0.05) is None
    assert surge_start([0.5] * 10 + [0.2] * 3, factor=0.5, window=10, persist=3, below=True, ref_min=0.1) == 10


def _rows(**series):
    n = len(next(iter(series.values())))
    return [{"step": i + 1, **{k: v[i] for k, v in series.items()}} for i in range(n)]


@pytest.mark.timeout(30)
def test_check_kinds_and_order():
    cfg = GuardConfig()
    flat = [0.3] * 12
    rows = _rows(entropy_mean=flat + [0.5, 0.5, 0.5], reward_mean=[0.8] * 15, garbled_share=[0.0] * 15)
    trip = check(rows, cfg)
    assert (trip.kind, trip.first_bad_step, trip.detected_step) == ("entropy_surge", 13, 15)
    assert check(rows[:-1], cfg) is None
    assert check(rows, cfg, at_last=True).detected_step == 15
    longer = rows + [{"step": 16, "entropy_mean": 0.5, "reward_mean": 0.8, "garbled_share": 0.0}]
    assert check(longer, cfg).detected_step == 15 and check(longer, cfg, at_last=True) is None  # detected once
    rows = _rows(entropy_mean=[0.3] * 15, reward_mean=[0.8] * 12 + [0.3] * 3, garbled_share=[0.0] * 15)
    assert check(rows, cfg).kind == "reward_collapse"
    rows = _rows(entropy_mean=[0.3] * 15, reward_mean=[0.8] * 15, garbled_share=[0.0] * 12 + [0.2] * 3)
    assert check(rows, cfg).kind == "garbled_surge"
    rows = _rows(entropy_mean=[0.3, math.nan, 0.3], reward_mean=[0.8] * 3)
    assert check(rows, cfg).kind == "non_finite" and check(rows, cfg).first_bad_step == 2
    rows = _rows(entropy_mean=[0.3] * 3, skipped_updates=[0, 0, 1])
    assert check(rows, cfg).detected_step == 3
    # clean tiny-like entropy (falling, noisy, below the floor) never trips
    rows = _rows(entropy_mean=[0.13 * 0.97**i * (1 + 0.3 * (i % 2)) for i in range(40)], reward_mean=[0.5] * 40)
    assert check(rows, cfg) is None


def test_last_good_step():
    assert last_good_step(5, [2, 4, 6]) == 2
    assert last_good_step(6, [2, 4, 6]) == 4
    assert last_good_step(3, [2, 4]) is None


GUARD_SETS = (
    "steps=7",
    "checkpoint.interval=2",
    "checkpoint.keep_last=5",
    "calibration.interval=100",
    "evaluation.interval=100",
    "guard.window=3",
    "guard.persist=2",
    "guard.entropy_floor=0",
    "guard.remedy_steps=2",
    "evaluation.benchmarks=[{name: synthetic, k: 1, limit: 8, max_new_tokens: 12}]",
)


def _surging(real):
    """``run_train`` reporting a tripled entropy at steps 5-6 on their first attempt (the injected surge)."""

    def surging(env, state, step, **kw):
        out, state = real(env, state, step, **kw)
        if step in (5, 6) and kw.get("attempt", 0) == 0:
            out["metrics"]["entropy_mean"] *= 3.0
        return out, state

    return surging


def _guard_run(tmp_path):
    from conftest import micro_config

    from flows.campaign.configuration import dump_config
    from storage.run.layout import create_run

    create_run(tmp_path, "r", config=dump_config(micro_config(*GUARD_SETS)))
    return tmp_path / "r"


def _assert_one_rollback(run_dir) -> dict:
    """Exactly one trip at the injected surge, one superseded stretch, the remedy on the replayed steps."""
    import json

    from storage.queries.catalog import connect, query

    con = connect(run_dir)
    g = query(con, "SELECT step, status, info FROM ledger WHERE stage = 'guard'").to_pylist()
    assert len(g) == 1 and g[0]["status"] == "done"  # tripped exactly once
    info = json.loads(g[0]["info"])
    assert (info["kind"], info["first_bad_step"], info["detected_step"], info["rollback_to"]) == (
        "entropy_surge",
        5,
        6,
        2,
    )
    assert g[0]["step"] == 2
    steps = query(con, "SELECT step, shadow FROM steps ORDER BY step").to_pylist()
    assert [r["step"] for r in steps] == list(range(1, 8))  # one live row per step
    assert [r["shadow"] for r in steps] == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]  # remedy: steps 3-4 calibrate
    # exactly one superseded stretch: the first attempts of steps 3..6
    sup = sorted(
        {
            int(p.parent.name.split("=")[1])
            for p in (run_dir / "superseded").rglob("*.parquet")
            if "step=" in p.parent.name
        }
    )
    assert sup == [3, 4, 5, 6]
    rep = query(con, "SELECT * FROM ledger WHERE stage = 'train' ORDER BY step").to_pylist()
    assert [r["step"] for r in rep] == list(range(1, 8)) and all(
        r["attempt"] == (1 if 3 <= r["step"] <= 6 else 0) for r in rep
    )
    return info


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_guard_trips_once_rolls_back_and_finishes(tmp_path, monkeypatch):
    """Micro campaign, in process: steps 5-6 report a tripled entropy on their first attempt.

    The micro model is barely bootstrapped (entropy at its maximum, reward 0), so
    no learning-rate surge can raise its entropy: the surge is injected in the
    train stage's reported metrics, and everything after it -- detection,
    ledger record, set-aside, restore, remedy, replay -- is the real path.
    """
    import stages.train as train_mod

    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")
    run_dir = _guard_run(tmp_path)
    monkeypatch.setattr(train_mod, "run_train", _surging(train_mod.run_train))
    from flows.campaign.flow import campaign_flow

    result = campaign_flow(str(run_dir))
    assert result["last_step"] == 7
    assert "recovered" not in _assert_one_rollback(run_dir)


_CHILD = """
import sys
sys.path[:0] = [{here!r}, {tests!r}]
from flows.process import child_guard
child_guard.start()  # Prefect's temporary server dies with this process, even on SIGKILL
import stages.train as train_mod
from test_guard import _surging
train_mod.run_train = _surging(train_mod.run_train)
from flows.campaign.flow import campaign_flow
campaign_flow(sys.argv[1], resume=sys.argv[2] == "resume")
"""


def _child(run_dir, mode: str, env: dict) -> int:
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from conftest import kill_session

    here, tests = str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])
    full = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_FAULT")} | env
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD.format(here=here, tests=tests), str(run_dir), mode],
            cwd=str(Path(tests).parent),
            env=full,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # files, not pipes: orphans of a SIGKILL keep pipes open
        try:
            code = proc.wait(timeout=600)
        finally:
            kill_session(proc.pid)
        out.seek(0)
        assert code in (0, -signal.SIGKILL), out.read()[-3000:]
        return code


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_inside_the_rollback_then_resume_finishes_it(tmp_path):
    """SIGKILL after the rollback's set-aside, before its ledger record finishes; ``resume``
    completes the rollback (the decision is in the record's start event) and the run ends
    exactly as an uninterrupted one: one trip, one superseded stretch, the remedy applied."""
    import signal

    from storage.ledger.events import Ledger

    run_dir = _guard_run(tmp_path)
    assert _child(run_dir, "run", {"FP8RL_FAULT": "guard@2:set_aside=kill"}) == -signal.SIGKILL
    pending = [r for r in Ledger(run_dir).records() if r.stage == "guard"]
    assert [(r.step, r.status, r.info.get("action")) for r in pending] == [(2, "running", "rollback")]
    assert _child(run_dir, "resume", {}) == 0
    assert _assert_one_rollback(run_dir)["recovered"] is True


def test_retention_keeps_every_checkpoint_while_fewer_than_keep_last(tmp_path):
    """The guard needs the checkpoint before a surge; keep_last=5 with 3 checkpoints deleted the oldest
    (``complete[len - keep_last:]`` with a negative start)."""
    from storage.checkpoints.retention import apply_retention
    from storage.checkpoints.store import CheckpointState, save_checkpoint
    from storage.checkpoints.verify import list_checkpoints
    from storage.run.layout import create_run

    run = create_run(tmp_path, "r", config={"name": "r"}).root
    for step in (2, 4, 6):
        save_checkpoint(run, step, rng_state=False, state=CheckpointState(calibrator_state={"step": step}))
        apply_retention(run, keep_last=5)
    assert [s for s, _ in list_checkpoints(run)] == [2, 4, 6]
    apply_retention(run, keep_last=2)
    assert [s for s, _ in list_checkpoints(run)] == [4, 6]
