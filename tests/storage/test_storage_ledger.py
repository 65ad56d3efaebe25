"""The stage ledger: folding events, resume questions, torn lines, set-aside, the SQL view."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from storage.ledger.events import Ledger
from storage.ledger.records import DONE, FAILED, RUNNING
from storage.parts.writer import TableWriter, set_aside_from
from storage.queries.catalog import connect
from storage.run.layout import create_run


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    return create_run(tmp_path, "r1").root


def _complete(led: Ledger, step: int, stages: list[str]) -> None:
    for s in stages:
        led.start(step, s)
        led.finish(step, s)


def test_fold_start_finish_fail_and_retries(run_dir: Path) -> None:
    led = Ledger(run_dir)
    led.start(0, "rollout")
    led.finish(0, "rollout", outputs=[run_dir / "tables" / "x.parquet"], info={"rows": 8})
    led.start(0, "score")
    led.fail(0, "score", error=RuntimeError("verifier timed out\nsecond line"))
    led.start(0, "score", attempt=1)
    recs = {(r.stage, r.attempt): r for r in led.records()}
    assert recs[("rollout", 0)].status == DONE and recs[("rollout", 0)].outputs == ["tables/x.parquet"]
    assert recs[("rollout", 0)].seconds >= 0 and recs[("rollout", 0)].info == {"rows": 8}
    assert recs[("score", 0)].status == FAILED and recs[("score", 0)].error == "RuntimeError: verifier timed out"
    assert recs[("score", 1)].status == RUNNING and recs[("score", 1)].finished_at is None
    assert led.status(0, "score") == RUNNING  # the current attempt
    assert led.done_stages(0) == {"rollout"}
    assert led.next_attempt(0, "score") == 2 and led.next_attempt(0, "train") == 0
    led.finish(0, "score", attempt=1)
    assert led.done_stages(0) == {"rollout", "score"}


def test_stage_context_manager_records_failure_and_reraises(run_dir: Path) -> None:
    led = Ledger(run_dir)
    with led.stage(2, "train") as rec:
        rec.outputs.append("tables/steps/a.parquet")
    with pytest.raises(ValueError, match="boom"):
        with led.stage(2, "calibrate"):
            raise ValueError("boom")
    assert led.status(2, "train") == DONE and led.status(2, "calibrate") == FAILED
    assert led.current()[(2, "train")].outputs == ["tables/steps/a.parquet"]


def test_last_finished_and_last_complete_step(run_dir: Path) -> None:
    led = Ledger(run_dir)
    assert led.last_finished() is None and led.last_complete_step({"train"}) is None
    required = lambda step: {"rollout", "score", "train"} | ({"calibrate"} if step % 2 == 0 else set())  # noqa: E731
    _complete(led, 0, ["rollout", "score", "train", "calibrate"])
    _complete(led, 1, ["rollout", "score", "train"])
    _complete(led, 2, ["rollout", "score", "train"])  # calibrate of step 2 missing
    _complete(led, 3, ["rollout"])
    assert led.last_complete_step(required) == 1
    assert led.last_complete_step({"rollout", "score", "train"}) == 2
    assert led.last_finished() == (3, "rollout")


def test_torn_last_line_is_skipped_then_quarantined_by_the_next_append(run_dir: Path) -> None:
    led = Ledger(run_dir)
    _complete(led, 0, ["rollout"])
    whole = led.path.stat().st_size
    torn = b'{"event": "finish", "run_id": "r1", "st'
    with open(led.path, "ab") as f:
        f.write(torn)  # crash mid-append
    events, bad = led.events()
    assert len(events) == 2 and bad == [3]
    assert led.done_stages(0) == {"rollout"}
    _complete(led, 1, ["rollout"])
    events, bad = led.events()
    assert len(events) == 4 and bad == []  # truncated to its last whole record, then appended
    assert led.done_stages(1) == {"rollout"}
    [rec] = led.repairs()
    assert rec["offset"] == whole and rec["length"] == len(torn) and rec["bytes"] == torn.decode()


def test_set_aside_hides_records_from_a_point(run_dir: Path) -> None:
    led = Ledger(run_dir)
    for step in range(3):
        _complete(led, step, ["rollout", "score", "train"])
    assert led.set_aside(from_step=1, stages=["train"]) == 4  # train of step 1 + the 3 stages of step 2
    assert led.done_stages(1) == {"rollout", "score"}
    assert led.done_stages(2) == set()
    assert led.done_stages(0) == {"rollout", "score", "train"}
    assert led.next_attempt(1, "train") == 1  # set-aside attempts still count
    _complete(led, 1, ["train"])  # records after the marker are live again
    assert led.done_stages(1) == {"rollout", "score", "train"}
    hidden = [r for r in led.records(include_set_aside=True) if r.step == 2]
    assert len(hidden) == 3


def test_set_aside_from_moves_tables_checkpoints_and_ledger(run_dir: Path) -> None:
    led, w = Ledger(run_dir), TableWriter(run_dir)
    for step in range(3):
        w.write("steps", step, {"reward_mean": step}, stage="train")
        w.write("bounds", step, {"mode": "calibrated"}, stage="calibrate")
        _complete(led, step, ["train", "calibrate", "checkpoint"])
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
    result = set_aside_from(run_dir, step=1, stages_at_step=["calibrate", "checkpoint"])
    assert len(result.files) == 3  # bounds of step 1; steps and bounds of step 2
    assert [p.name for p in result.checkpoints] == ["step_1", "step_2"]
    assert all((run_dir / "superseded" / "checkpoints" / p.name).is_dir() for p in result.checkpoints)
    assert led.done_stages(1) == {"train"}
    con = connect(run_dir)
    assert con.sql("SELECT step FROM steps ORDER BY 1").fetchall() == [(0,), (1,)]
    assert con.sql("SELECT step FROM bounds ORDER BY 1").fetchall() == [(0,)]


def test_ledger_view_has_contract_columns_and_variants(run_dir: Path) -> None:
    led = Ledger(run_dir)
    _complete(led, 0, ["rollout"])
    led.start(0, "calibrate", variant="whatif")
    led.fail(0, "calibrate", variant="whatif", error="nope")
    con = connect(run_dir)
    rows = con.sql(
        "SELECT run_id, step, stage, attempt, status, started_at IS NOT NULL, finished_at IS NOT NULL FROM ledger"
    ).fetchall()
    assert rows == [("r1", 0, "rollout", 0, "done", True, True)]
    assert con.sql("SELECT variant, status, error FROM ledger_variants WHERE stage = 'calibrate'").fetchall() == [
        ("whatif", "failed", "nope")
    ]
    types = dict((r[0], r[1]) for r in con.sql("DESCRIBE ledger").fetchall())
    assert types["step"] == "BIGINT" and types["started_at"] == "TIMESTAMP WITH TIME ZONE"


def test_bad_names_are_rejected(run_dir: Path) -> None:
    led = Ledger(run_dir)
    with pytest.raises(ValueError, match="bad stage"):
        led.start(0, "two words")
    with pytest.raises(ValueError, match="step and attempt"):
        led.start(-1, "train")


def test_doctor_accepts_a_repaired_torn_record_old_style_and_new(run_dir: Path) -> None:
    from storage.doctor import ERROR, WARNING, check_run

    led = Ledger(run_dir)
    _complete(led, 0, ["rollout"])
    with open(led.path, "ab") as f:
        f.write(b'{"event":"finish","run_id":"r1","st')  # crash mid-append
    _complete(led, 1, ["rollout"])  # a resume appends: the torn tail is quarantined
    assert [p for p in check_run(run_dir) if p.severity == ERROR] == []
    # a run written before the quarantine: the torn record stays, the next one starts a fresh line
    with open(led.path, "ab") as f:
        f.write(b'{"event":"start","run_id":"r1","step":2,"sta\n')
    _complete(led, 2, ["rollout"])
    found = check_run(run_dir)
    assert [p for p in found if p.severity == ERROR] == [], found
    assert any(p.severity == WARNING and "repaired" in p.message for p in found)
    # a garbled line that is not a torn record is still an error
    with open(led.path, "ab") as f:
        f.write(b'{"event":"start",\x00\x00garbage}\n')
    _complete(led, 3, ["rollout"])
    assert any(p.severity == ERROR and "unparseable" in p.message for p in check_run(run_dir))


def _per_step_reads(led: Ledger, step: int) -> tuple[int, float]:
    """The ledger calls of one campaign step: (ledger bytes its queries read, seconds they took)."""
    import time

    before, seconds = led.bytes_read, 0.0
    for stage in ("rollout", "score", "train", "checkpoint"):
        t0 = time.perf_counter()
        led.done_stages(step)
        attempt = led.next_attempt(step, stage)
        seconds += time.perf_counter() - t0
        with led.stage(step, stage, attempt=attempt):  # appends (fsync): not timed
            pass
        t0 = time.perf_counter()
        led.current_record(step, stage)
        seconds += time.perf_counter() - t0
    return led.bytes_read - before, seconds


def _synthetic_ledger(run_dir: Path, records: int) -> None:
    import json

    lines = []
    for i in range(records // 2):
        ev = {
            "run_id": "r1",
            "step": i // 4,
            "stage": ("rollout", "score", "train", "evaluate")[i % 4],
            "attempt": 0,
            "variant": "main",
            "at": "2026-12-02T00:00:00+00:00",
        }
        lines += [json.dumps({"event": "start", **ev}), json.dumps({"event": "finish", **ev, "outputs": []})]
    (run_dir / "ledger.jsonl").write_text("\n".join(lines) + "\n")


def test_ledger_reads_per_step_do_not_grow_with_its_length(tmp_path: Path) -> None:
    cost = {}
    for n in (100, 10_000):
        run_dir = create_run(tmp_path / f"n{n}", "r1").root  # one run id: records of the same length
        _synthetic_ledger(run_dir, n)
        led = Ledger(run_dir)
        assert led.next_attempt(0, "rollout") == 1  # the first query folds the whole file once
        steps = range(100_000, 100_030)
        reads = [_per_step_reads(led, step) for step in steps]
        assert led.done_stages(steps[-1]) == {"rollout", "score", "train", "checkpoint"}
        cost[n] = (max(b for b, _ in reads), sorted(t for _, t in reads)[len(reads) // 2])
    # every step reads only what it appended: the same bytes however long the ledger is
    assert cost[10_000][0] == cost[100][0] < 4096, cost
    assert cost[10_000][1] < 3 * cost[100][1] + 0.001, cost  # median seconds of a step's queries


def test_a_ledger_rewritten_or_replaced_is_folded_afresh(run_dir: Path) -> None:
    led = Ledger(run_dir)
    _complete(led, 0, ["rollout", "score"])
    assert led.done_stages(0) == {"rollout", "score"}
    text = led.path.read_text()
    led.path.write_text(text.replace('"step":0', '"step":7') * 2)  # in place (same inode), longer
    assert led.done_stages(0) == set() and led.done_stages(7) == {"rollout", "score"}
    tmp = led.path.with_name("new.jsonl")
    tmp.write_text(text.replace('"stage":"score"', '"stage":"train"'))
    os.replace(tmp, led.path)  # another file
    assert led.done_stages(0) == {"rollout", "train"} and led.done_stages(7) == set()
