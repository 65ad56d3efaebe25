"""Schemas, the Parquet writer and the catalog: round trips, retries, variants, versions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from integrity_helpers import write_old_part

from storage.errors import NotARunDirectory, SchemaError, SchemaVersionError, UnknownRun
from storage.parts.writer import TableWriter, read_table, rows_to_table, steps_from
from storage.queries.catalog import connect, problems, query
from storage.run.layout import create_run, parse_part_name
from storage.tables.schemas import BOUNDS_HEADLINE, STORED_TABLES, TABLES
from storage.tables.spec import MAIN_VARIANT, SCHEMA_VERSION

# The column contract of docs/method.md: saved queries rely on these names.
CONTRACT = {
    "steps": [
        "run_id",
        "step",
        "reward_mean",
        "entropy_mean",
        "clipfrac",
        "clipfrac_lower",
        "clipfrac_upper",
        "lower_bound",
        "upper_bound",
        "ppo_kl",
        "step_seconds",
    ],
    "token_stats": [
        "run_id",
        "step",
        "sample_id",
        "position",
        "advantage",
        "logp_fp8",
        "old_logp_fp8",
        "logp_bf16",
        "old_logp_bf16",
        "ratio_fp8",
        "ratio_bf16",
        "entropy",
    ],
    "bounds": [
        "run_id",
        "step",
        "mode",
        "alpha",
        "raw_lower",
        "raw_upper",
        "lower",
        "upper",
        "target_balance",
        "balance_before",
        "balance_after",
    ],
    "eval_scores": ["run_id", "step", "benchmark", "metric", "k", "value"],
    "ledger": ["run_id", "step", "stage", "attempt", "status", "started_at", "finished_at"],
}


def sample_rows(table: str, n: int = 6) -> dict:
    """A few rows with every stored column set to a distinctive value."""
    rng = np.random.default_rng(len(table))
    if table == "rollouts":
        return {
            "sample_id": np.arange(n, dtype=np.int32),
            "prompt_id": [f"p{i // 2}" for i in range(n)],
            "sample_index": [i % 2 for i in range(n)],
            "prompt": ["1+1="] * n,
            "response": [f"{i}" for i in range(n)],
            "prompt_token_ids": [[1, 2, 3]] * n,
            "response_token_ids": [[4, 5]] * n,
            "rollout_logp": [[-0.5, -0.25]] * n,
            "response_length": [2] * n,
            "finish_reason": ["stop"] * n,
            "policy_version": [3] * n,
            "precision": ["fp8_per_tensor"] * n,
            "reference_answer": ["2"] * n,
        }
    if table == "scores":
        return {
            "sample_id": np.arange(n),
            "prompt_id": [f"p{i // 2}" for i in range(n)],
            "score": rng.random(n),
            "correct": rng.random(n) > 0.5,
            "reward": rng.random(n),
            "advantage": rng.normal(size=n),
            "kept": [True] * n,
        }
    if table == "token_stats":
        logp = -rng.exponential(1.0, n).astype(np.float32)
        return {
            "sample_id": np.repeat(np.arange(2), n // 2),
            "position": np.tile(np.arange(n // 2), 2),
            "advantage": np.repeat([-1.0, 1.0], n // 2),
            "logp_fp8": logp,
            "old_logp_fp8": logp + 0.1,
            "logp_bf16": logp,
            "old_logp_bf16": logp + 0.05,
            "entropy": rng.random(n),
            "lower_bound": 0.8,
            "upper_bound": 1.28,
            "standard_lower": 0.8,
            "standard_upper": 1.28,
        }
    if table == "steps":
        return {
            "reward_mean": 0.5,
            "entropy_mean": 1.2,
            "clipfrac": 0.1,
            "clipfrac_lower": 0.07,
            "clipfrac_upper": 0.03,
            "lower_bound": 0.8,
            "upper_bound": 1.28,
            "ppo_kl": 0.001,
            "step_seconds": 3.5,
        }
    if table == "bounds":
        return {
            "mode": "calibrated",
            "alpha": 0.02,
            "raw_lower": 0.7,
            "raw_upper": 1.3,
            "lower": 0.75,
            "upper": 1.3,
            "target_balance": 1.1,
            "balance_before": 0.9,
            "balance_after": 1.05,
            "tokens": 1000,
        }
    if table == "evals":
        return [
            {
                "benchmark": "aime24",
                "problem_id": str(i),
                "sample_index": 0,
                "correct": i % 2 == 0,
                "predicted_answer": "7",
                "response_length": 10,
            }
            for i in range(n)
        ]
    if table == "eval_scores":
        return [
            {"benchmark": b, "metric": "avg@k", "k": 4, "value": v, "n_problems": 30}
            for b, v in (("aime24", 0.25), ("math500", 0.5))
        ]
    raise KeyError(table)


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    return create_run(tmp_path / "runs", "r1", config={"seed": 0}).root


@pytest.mark.parametrize("table", STORED_TABLES)
def test_round_trip_every_table(run_dir: Path, table: str) -> None:
    rows = sample_rows(table)
    path = TableWriter(run_dir).write(table, 4, rows, stage="s1")
    assert path.parent == run_dir / "tables" / table / "run=r1" / "step=4"
    assert parse_part_name(path.name).stage == "s1"
    got = read_table(path)
    assert got.schema.metadata[b"fp8rl.schema_version"] == str(SCHEMA_VERSION).encode()
    con = connect(run_dir)
    view = query(con, f"SELECT * FROM {table} ORDER BY ALL")
    assert view.num_rows == rows_to_table(rows).num_rows
    assert set(view.column("run_id").to_pylist()) == {"r1"} and set(view.column("step").to_pylist()) == {4}
    assert set(view.column("variant").to_pylist()) == {MAIN_VARIANT}
    # every stored column is in the view with the schema's type
    assert con.sql(f"SELECT typeof(step) FROM {table} LIMIT 1").fetchall() == [("BIGINT",)]
    for f in TABLES[table].schema():
        assert f.name in view.column_names
    src = rows_to_table(rows)
    key = next(c for c in ("sample_id", "problem_id", "benchmark", "mode", "reward_mean") if c in src.column_names)
    for name in src.column_names:
        want = sorted(zip(src.column(key).to_pylist(), src.column(name).to_pylist()), key=lambda t: str(t))
        have = sorted(zip(view.column(key).to_pylist(), view.column(name).to_pylist()), key=lambda t: str(t))
        for (kw, w), (kh, h) in zip(want, have):
            if isinstance(w, float):
                assert h == pytest.approx(w, rel=1e-6), name
            else:
                assert h == w, name


def test_contract_columns_exist_even_without_data(tmp_path: Path) -> None:
    run = create_run(tmp_path, "empty").root
    con = connect(run)
    for table, cols in CONTRACT.items():
        have = [r[0] for r in con.sql(f"DESCRIBE {table}").fetchall()]
        assert set(cols) <= set(have), (table, set(cols) - set(have))
        assert con.sql(f"SELECT count(*) FROM {table}").fetchall() == [(0,)]
    assert set(BOUNDS_HEADLINE) <= set(CONTRACT["bounds"])  # the summaries show contract columns only
    types = dict((r[0], r[1]) for r in con.sql("DESCRIBE eval_scores").fetchall())
    assert types["step"] == "BIGINT" and types["value"] == "DOUBLE" and types["k"] == "INTEGER"


def test_token_stats_derived_ratios_and_clip_flags(run_dir: Path) -> None:
    w = TableWriter(run_dir)
    logp = np.array([-1.0, -1.0, -1.0, -1.0, -30.0], np.float32)
    old = np.array([-0.5, -1.2, -1.0, -0.7, 0.0], np.float32)
    w.write(
        "token_stats",
        1,
        {
            "sample_id": np.arange(5),
            "position": np.zeros(5),
            "advantage": np.array([-1, 1, 1, -1, -1], np.float32),
            "logp_fp8": logp,
            "old_logp_fp8": old,
            "logp_bf16": logp,
            "old_logp_bf16": logp,
            "lower_bound": 0.8,
            "upper_bound": 1.2,
            "standard_lower": 0.8,
            "standard_upper": 1.2,
            "ratio_fp8": np.full(5, 99.0),  # derived: dropped by the writer, recomputed by the view
        },
        stage="train",
    )
    got = (
        connect(run_dir)
        .sql(
            "SELECT ratio_fp8, ratio_bf16, clipped_lower, clipped_upper, overclipped, underclipped "
            "FROM token_stats ORDER BY sample_id"
        )
        .fetchall()
    )
    r8 = np.exp(np.clip(logp - old, -20, 20))  # docs/method.md
    assert [g[0] for g in got] == pytest.approx(r8.tolist(), rel=1e-6)
    assert [g[1] for g in got] == pytest.approx([1.0] * 5)
    # r8 = 0.61 (A<0: clipped low), 1.22 (A>0: clipped high), 1.0, 0.74 (A<0: clipped), exp(-20) (A<0: clipped)
    assert [g[2] for g in got] == [True, False, False, True, True]
    assert [g[3] for g in got] == [False, True, False, False, False]
    assert [g[4] for g in got] == [True, False, False, True, True]  # BF16 (r16 = 1) clips none
    assert [g[5] for g in got] == [False] * 5


def test_token_stats_without_shadow_pass_has_null_bf16(run_dir: Path) -> None:
    rows = sample_rows("token_stats")
    rows.pop("logp_bf16"), rows.pop("old_logp_bf16")
    TableWriter(run_dir).write("token_stats", 2, rows, stage="train")
    got = (
        connect(run_dir)
        .sql(
            "SELECT count(ratio_bf16), count(overclipped), count(bf16_clipped_lower), "
            "count(clipped_lower) FROM token_stats"
        )
        .fetchall()
    )
    assert got == [(0, 0, 0, 6)]


def test_steps_merge_across_stages_and_timings_are_a_declared_family(run_dir: Path) -> None:
    w = TableWriter(run_dir)
    w.write("steps", 0, {"reward_mean": 0.1, "rollout_seconds": 2, "accuracy": np.float32(0.5)}, stage="rollout")
    w.write("steps", 0, {"clipfrac": 0.2, "train_seconds": 5, "old_logp_s": True}, stage="train")
    w.write("steps", 1, {"reward_mean": [0.3]}, stage="train")  # dict of one-element columns works too
    con = connect(run_dir)
    rows = query(
        con,
        "SELECT step, reward_mean, clipfrac, rollout_seconds, train_seconds, accuracy, old_logp_s "
        "FROM steps ORDER BY step",
    ).to_pylist()
    assert rows[0] == {
        "step": 0,
        "reward_mean": 0.1,
        "clipfrac": 0.2,
        "rollout_seconds": 2.0,
        "train_seconds": 5.0,
        "accuracy": 0.5,
        "old_logp_s": 1.0,
    }
    assert rows[1]["reward_mean"] == 0.3 and rows[1]["clipfrac"] is None
    types = dict((r[0], r[1]) for r in con.sql("DESCRIBE steps").fetchall())
    assert types["rollout_seconds"] == "DOUBLE" and types["old_logp_s"] == "DOUBLE"
    with pytest.raises(SchemaError, match="only numbers"):
        w.write("steps", 2, {"bad_seconds": [[1, 2]]}, stage="train")


@pytest.mark.parametrize(
    "table,rows",
    [
        ("steps", {"reward_mean": 0.1, "reward_maen": 0.2}),  # a typo
        ("bounds", {"lower": [0.8], "upper": [1.2], "new_thing": [1.0]}),
        ("scores", {"sample_id": [0], "rewrad": [1.0]}),
    ],
)
def test_an_undeclared_column_is_an_error_naming_it(run_dir: Path, table: str, rows: dict) -> None:
    bad = next(k for k in rows if k not in ("reward_mean", "lower", "upper", "sample_id"))
    with pytest.raises(SchemaError, match=f"column '{bad}' is not declared"):
        TableWriter(run_dir).write(table, 1, rows, stage="x")
    assert not list((run_dir / "tables").rglob("*.parquet"))  # nothing written


def test_bad_rows_give_clear_errors(run_dir: Path) -> None:
    w = TableWriter(run_dir)
    with pytest.raises(SchemaError, match="required column 'sample_id' is missing"):
        w.write("scores", 0, {"reward": [1.0]}, stage="score")
    with pytest.raises(SchemaError, match=r"scores\.reward: cannot store string"):
        w.write("scores", 0, {"sample_id": [0], "reward": ["high"]}, stage="score")
    with pytest.raises(SchemaError, match="but this write is for run_id='r1'"):
        w.write("scores", 0, {"sample_id": [0], "run_id": ["other"]}, stage="score")
    with pytest.raises(SchemaError, match="bad stage"):
        w.write("scores", 0, {"sample_id": [0]}, stage="re-score")
    with pytest.raises(SchemaError, match="unknown table 'score'; tables: rollouts"):
        w.write("score", 0, {"sample_id": [0]}, stage="score")
    with pytest.raises(SchemaError, match="different lengths"):
        w.write("scores", 0, {"sample_id": [0, 1], "reward": [1.0]}, stage="score")
    with pytest.raises(SchemaError, match="ledger"):
        w.write("ledger", 0, {"stage": ["x"]}, stage="score")
    assert list((run_dir / "tables").rglob("*.parquet")) == []
    assert list((run_dir / "tmp").iterdir()) == []


def test_retried_stage_does_not_duplicate_rows(run_dir: Path) -> None:
    w = TableWriter(run_dir)
    first = w.write("scores", 3, sample_rows("scores"), stage="score", attempt=0)
    second = w.write("scores", 3, sample_rows("scores"), stage="score", attempt=1)
    other = w.write("rollouts", 3, sample_rows("rollouts"), stage="rollout")
    con = connect(run_dir)
    assert con.sql("SELECT count(*) FROM scores").fetchall() == [(6,)]
    assert not first.exists() and second.exists() and other.exists()
    aside = run_dir / "superseded" / first.relative_to(run_dir)
    assert aside.exists()  # set aside, not deleted
    # A crash between rename and set-aside leaves both: the newest alone is read.
    shutil.copy(aside, first)
    con = connect(run_dir)
    assert con.sql("SELECT count(*) FROM scores").fetchall() == [(6,)]
    assert w.live_files("scores") == [second]


def test_a_step_replayed_on_fewer_ranks_reads_each_row_once(run_dir: Path) -> None:
    """A 2-rank step (parts ``train`` + ``train_rank1``) replayed in 1 process: rank 1's old part
    used to stay live beside the new 1-process part, so its rows were read twice."""
    w = TableWriter(run_dir)
    rows = sample_rows("token_stats")  # sample ids 0, 1 (3 positions each)
    half = {k: (v[:3] if hasattr(v, "__len__") else v) for k, v in rows.items()}
    other = {k: (v[3:] if hasattr(v, "__len__") else v) for k, v in rows.items()}
    w.write("token_stats", 2, half, stage="train", attempt=0)
    rank1 = w.write("token_stats", 2, other, stage="train_rank1", attempt=0)
    count = "SELECT count(*) FROM token_stats"
    assert connect(run_dir).sql(count).fetchall() == [(6,)]
    w.write("token_stats", 2, rows, stage="train", attempt=1)  # the replay: one process, every row
    assert connect(run_dir).sql(count).fetchall() == [(9,)]  # the old behaviour: rank 1's 3 rows twice
    assert w.retire_absent_ranks("token_stats", 2, "train", 2) == []  # still 2 ranks: rank 1's part is its own
    moved = w.retire_absent_ranks("token_stats", 2, "train", 1)
    assert [p.name for p in moved] == [rank1.name] and "superseded" in moved[0].parts
    assert connect(run_dir).sql(count).fetchall() == [(6,)]
    # resume --from train: the stage's set-aside takes every rank's share
    w.write("token_stats", 3, half, stage="train", attempt=0)
    w.write("token_stats", 3, other, stage="train_rank1", attempt=0)
    assert len(w.supersede("token_stats", [3], stages=["train"])) == 2


def test_variants_sit_beside_main(run_dir: Path) -> None:
    w = TableWriter(run_dir)
    w.write("bounds", 5, sample_rows("bounds"), stage="calibrate")
    w.write("bounds", 5, {**sample_rows("bounds"), "lower": 0.6}, stage="calibrate", variant="whatif-delta0.1")
    con = connect(run_dir)
    assert con.sql("SELECT lower FROM bounds").fetchall() == [(0.75,)]
    got = con.sql(
        "SELECT v.lower - m.lower FROM bounds_variants v JOIN bounds m USING (run_id, step) "
        "WHERE v.variant = 'whatif-delta0.1'"
    ).fetchall()
    assert got[0][0] == pytest.approx(-0.15)
    # a re-run of the variant replaces the variant only
    w.write("bounds", 5, {**sample_rows("bounds"), "lower": 0.65}, stage="calibrate", variant="whatif-delta0.1")
    assert connect(run_dir).sql("SELECT variant, lower FROM bounds_variants ORDER BY 1").fetchall() == [
        ("main", 0.75),
        ("whatif-delta0.1", 0.65),
    ]


def test_supersede_sets_aside_from_a_step(run_dir: Path) -> None:
    w = TableWriter(run_dir)
    for step in range(4):
        w.write("steps", step, {"reward_mean": step}, stage="train")
        w.write("bounds", step, sample_rows("bounds"), stage="calibrate")
    moved = w.supersede(None, steps_from(2))
    assert len(moved) == 4 and all("superseded" in p.parts for p in moved)
    moved = w.supersede("bounds", [1], stages="calibrate")
    assert len(moved) == 1
    con = connect(run_dir)
    assert con.sql("SELECT step FROM steps ORDER BY step").fetchall() == [(0,), (1,)]
    assert con.sql("SELECT step FROM bounds ORDER BY step").fetchall() == [(0,)]


def test_multiple_runs_in_one_root_and_run_filter(tmp_path: Path) -> None:
    for rid, reward in (("a", 0.1), ("b", 0.2)):
        run = create_run(tmp_path, rid).root
        TableWriter(run).write("steps", 0, {"reward_mean": reward}, stage="train")
    con = connect(tmp_path)
    assert con.sql("SELECT run_id, reward_mean FROM steps ORDER BY 1").fetchall() == [("a", 0.1), ("b", 0.2)]
    assert connect(tmp_path, runs=["b"]).sql("SELECT run_id FROM steps").fetchall() == [("b",)]
    assert con.sql("SELECT count(*) FROM runs").fetchall() == [(2,)]
    with pytest.raises(UnknownRun, match=r"unknown run id 'c' under .*; runs there: a, b"):
        connect(tmp_path, runs=["c"])
    with pytest.raises(NotARunDirectory, match="not a run directory"):
        connect(tmp_path / "a" / "tables")
    with pytest.raises(NotARunDirectory, match="no such directory"):
        connect(tmp_path / "nope")


def test_newer_schema_version_fails_clearly(run_dir: Path) -> None:
    path = TableWriter(run_dir).write("steps", 0, {"reward_mean": 1.0}, stage="train")
    t = pq.read_table(path)
    pq.write_table(t.replace_schema_metadata({b"fp8rl.schema_version": b"99", b"fp8rl.table": b"steps"}), path)
    with pytest.raises(SchemaVersionError, match=r"schema version 99, newer than this fp8rl's 1; upgrade"):
        read_table(path)
    info = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**info, "schema_version": 99}))
    with pytest.raises(SchemaVersionError, match=r"run\.json: written with schema version 99"):
        connect(run_dir)


def test_create_run_guards_against_another_config(tmp_path: Path) -> None:
    create_run(tmp_path, "r", config={"lr": 1})
    assert create_run(tmp_path, "r", config={"lr": 1}, exist_ok=True).root == tmp_path / "r"
    with pytest.raises(NotARunDirectory, match="already exists"):
        create_run(tmp_path, "r", config={"lr": 1})
    with pytest.raises(NotARunDirectory, match="config hash"):
        create_run(tmp_path, "r", config={"lr": 2}, exist_ok=True)
    with pytest.raises(SchemaError, match="bad run id"):
        create_run(tmp_path, "../evil")


def test_token_stats_bytes_per_row_within_budget(run_dir: Path) -> None:
    """<= 20 bytes/row on realistic data (the benchmark checks it at 10M rows)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "storage_scale", Path(__file__).parents[2] / "benchmarks" / "storage_scale.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cols = bench.make_step(np.random.default_rng(0), 200_000, 3)
    path = TableWriter(run_dir).write("token_stats", 3, cols, stage="train")
    per_row = path.stat().st_size / len(cols["sample_id"])
    assert 5.0 < per_row <= 20.0, per_row  # budget 20; a write of (almost) nothing is no success either


def test_catalog_flags_unreadable_file_without_failing_other_tables(run_dir: Path) -> None:
    w = TableWriter(run_dir)
    good = w.write("steps", 0, {"reward_mean": 1.0}, stage="train")
    bad = w.write("token_stats", 0, sample_rows("token_stats"), stage="train")
    w.write("token_stats", 1, sample_rows("token_stats"), stage="train")
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) // 2])
    con = connect(run_dir)
    assert con.sql("SELECT count(*) FROM steps").fetchall() == [(1,)]
    assert con.sql("SELECT count(*) FROM token_stats").fetchall() == [(6,)]  # step 1 only
    assert [p for p, _ in problems(con)] == [str(bad)]
    assert "truncated" in problems(con)[0][1]
    assert good.exists()


def test_file_from_an_older_schema_reads_with_nulls_for_new_columns(run_dir: Path) -> None:
    """Additive schema changes: a part lacking today's columns reads, the new columns are NULL."""
    w = TableWriter(run_dir)
    w.write("scores", 0, sample_rows("scores"), stage="score")
    old = pa.table(
        {
            "run_id": ["r1"],
            "step": pa.array([1], pa.int64()),
            "variant": ["main"],
            "sample_id": pa.array([0], pa.int32()),
            "reward": pa.array([1.0], pa.float32()),
        }
    )
    write_old_part(run_dir, "scores", "score", old)
    rows = connect(run_dir).sql("SELECT step, reward, advantage, kept FROM scores WHERE step = 1").fetchall()
    assert rows == [(1, 1.0, None, None)]


def test_live_rows_of_one_step_read_only_that_steps_files(run_dir: Path, monkeypatch) -> None:
    """Publishing a step's row after every step (flows.orchestration.ui.publish_step, the trackers) read every
    earlier step's file: O(steps) reads per step, 1.2 s a step by step 150. Now: the files in range."""
    import flows.orchestration.ui as ui

    w = TableWriter(run_dir)
    for s in range(30):
        w.write("steps", s, {"reward_mean": s / 100}, stage="train")
        w.write("steps", s, {"reward_mean": 0.9}, stage="train", variant="rerun")  # another variant, same step
    read = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda p, *a, **k: read.append(Path(p)) or real(p, *a, **k))
    rows = ui.live_rows(run_dir, "steps", from_step=17, to_step=17)
    assert rows.column("step").to_pylist() == [17] and rows.column("reward_mean").to_pylist() == [0.17]
    assert len(read) == 1 and "step=17" in str(read[0])
    read.clear()
    assert ui.live_rows(run_dir, "steps", from_step=25).column("step").to_pylist() == [25, 26, 27, 28, 29]
    assert len(read) == 5  # main-variant files of steps 25-29 only
