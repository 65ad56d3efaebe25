"""`fp8rl query` and `fp8rl doctor`: outputs, named queries, and one-line errors with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

from flows.commands.storage import register
from storage.ledger.events import Ledger
from storage.parts.writer import TableWriter
from storage.queries import get_query, list_queries
from storage.queries.catalog import connect, query
from storage.run.layout import create_run
from tests.conftest import app_with

NAMED = (
    "calibration-history",
    "clip-shares-by-sign",
    "overclip-origin",
    "entropy-bins",
    "eval-best-average",
    "paper-table",
    "failure-signals",
    "guard-events",
    "noise-sources",
    "bound-estimates",
    "behaviour-by-lag",
)


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    return app_with(register)


def invoke(app: typer.Typer, *args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def campaign(tmp_path_factory) -> Path:
    """Two small runs with every table the named queries read."""
    root = tmp_path_factory.mktemp("runs")
    rng = np.random.default_rng(0)
    for rid, gain in (("fp8", 0.10), ("bf16", 0.20)):
        run = create_run(root, rid).root
        w, led = TableWriter(run), Ledger(run)
        for step in range(4):
            n = 400
            logp = -rng.exponential(1.0, n).astype(np.float32)
            w.write(
                "token_stats",
                step,
                {
                    "sample_id": np.repeat(np.arange(8), n // 8),
                    "position": np.tile(np.arange(n // 8), 8),
                    "advantage": np.repeat(rng.normal(size=8), n // 8),
                    "logp_fp8": logp,
                    "old_logp_fp8": logp + rng.normal(0, 0.2, n),
                    "logp_bf16": logp + rng.normal(0, 0.01, n),
                    "old_logp_bf16": logp + rng.normal(0, 0.2, n),
                    "entropy": rng.exponential(1.0, n),
                    "lower_bound": 0.8,
                    "upper_bound": 1.28,
                    "standard_lower": 0.8,
                    "standard_upper": 1.28,
                },
                stage="train",
            )
            w.write(
                "rollouts",
                step,
                {
                    "sample_id": np.arange(8, dtype=np.int32),
                    "prompt_id": [f"p{i // 4}" for i in range(8)],
                    "rollout_logp": [list(logp[i * (n // 8) : (i + 1) * (n // 8)] + 0.05) for i in range(8)],
                    "train_logp": [list(logp[i * (n // 8) : (i + 1) * (n // 8)] + 0.03) for i in range(8)],
                    "policy_version": np.full(8, max(step - 2, 0)),  # rollout.max_staleness: 1
                },
                stage="rollout",
            )
            w.write(
                "steps",
                step,
                {
                    "reward_mean": step / 10,
                    "clipfrac": 0.1,
                    "ratio_noise_nmae": 0.004,
                    "tis_weight_nmae": 0.01,
                    "rollout_bf16_prob_nmae": 0.02,
                    "overclipped_share": 0.01 * step + (gain / 100) if step % 2 else None,  # shadow steps 1, 3
                },
                stage="train",
            )
            w.write(
                "bounds",
                step,
                {
                    "mode": "calibrated",
                    "alpha": 0.02,
                    "lower": 0.8 - step / 100,
                    "upper": 1.28,
                    "negative_tokens": 200,
                    "estimator": "harrell_davis",
                    "lower_ci_low": 0.7,
                    "lower_ci_high": 0.9 - step / 100,
                    "lower_clip_share_neg_before": 0.01 * (step + 1),
                    "lower_clip_share_neg_bf16": 0.02,
                },
                stage="calibrate",
            )
            w.write(
                "eval_scores",
                step,
                [
                    {"benchmark": b, "metric": "avg@k", "k": 4, "value": base + gain * (step == 2)}
                    for b, base in (("aime24", 0.1), ("math500", 0.5))
                ],
                stage="evaluate",
            )
            with led.stage(step, "train"):
                pass
        with led.stage(3, "guard") as rec:  # a guard rollback, as flows.campaign.guard records it
            rec.info.update(
                kind="entropy_surge",
                detected_step=3,
                first_bad_step=2,
                rollback_to=1,
                action="rollback",
                remedy="recalibrate_every_step",
                detail="test",
                set_aside_files=4,
            )
    return root


def test_list_shows_every_named_query(app) -> None:
    result = invoke(app, "query", "--list")
    assert result.exit_code == 0
    for name in NAMED:
        assert name in result.output
    assert "--param bin_width=0.25" in result.output
    assert {q.name for q in list_queries()} == set(NAMED)
    assert all(q.description for q in list_queries())


@pytest.mark.parametrize("name", NAMED)
def test_named_queries_run(app, campaign: Path, name: str) -> None:
    result = invoke(app, "query", campaign, "--named", name, "--format", "json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert rows and {"run_id"} <= set(rows[0])


def test_eval_best_average_values(app, campaign: Path) -> None:
    rows = json.loads(invoke(app, "query", campaign, "-n", "eval-best-average", "-f", "json").stdout)
    assert [(r["run_id"], r["best_step"]) for r in rows] == [("bf16", 2), ("fp8", 2)]
    assert rows[0]["gain"] == pytest.approx(0.20) and rows[1]["best_average"] == pytest.approx(0.40)
    assert rows[1]["initial_step"] == 0 and rows[1]["benchmarks"] == 2


def test_bound_estimates_pair_each_l_with_the_next_calibrations_shares(app, campaign: Path) -> None:
    rows = json.loads(invoke(app, "query", campaign, "-n", "bound-estimates", "-f", "json", "--run", "fp8").stdout)
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[0]["bf16_clipped"] == 4  # 0.02 x 200
    assert rows[1]["lower_ci_width"] == pytest.approx(0.19) and rows[1]["estimator"] == "harrell_davis"
    assert rows[1]["next_calibration"] == 2 and rows[1]["next_fp8_share"] == pytest.approx(0.03)
    assert rows[1]["next_share_error"] == pytest.approx(0.01)  # |0.03 - 0.02|, FP8 under step 1's L at step 2
    assert rows[3]["next_calibration"] is None and rows[3]["next_share_error"] is None


def test_clip_shares_match_the_definition(app, campaign: Path) -> None:
    rows = json.loads(invoke(app, "query", campaign, "-n", "clip-shares-by-sign", "-f", "json", "--run", "fp8").stdout)
    tbl = pq.read_table(
        next((campaign / "fp8" / "tables" / "token_stats" / "run=fp8" / "step=0").iterdir())
    ).to_pydict()
    a = np.array(tbl["advantage"])
    r8 = np.exp(np.clip(np.array(tbl["logp_fp8"]) - np.array(tbl["old_logp_fp8"]), -20, 20))
    assert rows[0]["step"] == 0 and len(rows) == 4
    assert rows[0]["lower_clip_share"] == pytest.approx(np.mean((a < 0) & (r8 < 0.8)))
    assert rows[0]["upper_clip_share"] == pytest.approx(np.mean((a > 0) & (r8 > 1.28)))


def test_params_and_output_formats(app, campaign: Path, tmp_path: Path) -> None:
    coarse = invoke(app, "query", campaign, "-n", "entropy-bins", "-p", "bin_width=1.0", "-f", "csv", "--run", "fp8")
    assert coarse.exit_code == 0 and coarse.stdout.startswith('"run_id","entropy_from"')
    fine = invoke(app, "query", campaign, "-n", "entropy-bins", "-f", "csv", "--run", "fp8")
    assert len(fine.stdout.splitlines()) > len(coarse.stdout.splitlines())
    table = invoke(app, "query", campaign, "SELECT run_id, step, reward_mean FROM steps ORDER BY 1, 2")
    assert table.exit_code == 0 and "(8 rows)" in table.stdout and "reward_mean" in table.stdout.splitlines()[0]
    short = invoke(app, "query", campaign, "SELECT * FROM steps", "--max-rows", "3")
    assert "first 3 shown" in short.stdout
    for suffix in ("parquet", "csv", "json"):
        out = tmp_path / f"ledger.{suffix}"
        res = invoke(app, "query", campaign, "SELECT * FROM ledger", "--out", out)
        assert res.exit_code == 0 and out.stat().st_size > 0
    assert pq.read_table(tmp_path / "ledger.parquet").num_rows == 10  # 2 runs x (4 train + 1 guard)
    assert len(json.loads((tmp_path / "ledger.json").read_text())) == 10


@pytest.mark.parametrize(
    "args, message",
    [
        (["{tmp}", "SELECT 1"], "not a run directory"),
        (["{tmp}/missing", "SELECT 1"], "no such directory"),
        (["{root}", "--run", "nope", "SELECT 1"], "unknown run id 'nope'"),
        (["{root}", "SELEC * FROM steps"], "SQL syntax error"),
        (["{root}", "SELECT * FROM stepz"], "stepz does not exist"),
        (["{root}", "SELECT no_such_column FROM steps"], "no_such_column"),
        (["{root}", "--named", "nope"], "unknown named query 'nope'; known: behaviour-by-lag, bound-estimates"),
        (["{root}", "-n", "entropy-bins", "-p", "bins=3"], "has no parameter 'bins'"),
        (["{root}", "SELECT 1", "--out", "x.txt"], "extension must be one of"),
        (["{root}"], "missing SQL"),
        ([], "missing ROOT"),
    ],
)
def test_user_errors_are_one_line_exit_2(app, campaign: Path, tmp_path: Path, args: list[str], message: str) -> None:
    args = [a.format(tmp=tmp_path, root=campaign) for a in args]
    result = invoke(app, "query", *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert "Traceback" not in result.output


def test_doctor_healthy_then_truncated_file_named(app, tmp_path: Path) -> None:
    run = create_run(tmp_path, "r").root
    w = TableWriter(run)
    w.write("steps", 0, {"reward_mean": 1.0}, stage="train")
    path = w.write("scores", 0, {"sample_id": np.arange(100), "reward": np.ones(100)}, stage="score")
    assert invoke(app, "doctor", run).exit_code == 0
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    result = invoke(app, "doctor", run)
    assert result.exit_code == 1
    assert str(path) in result.stderr and "unreadable Parquet" in result.stderr
    # an unrelated query still works, the broken table's query warns and skips the file
    ok = invoke(app, "query", run, "SELECT count(*) AS n FROM steps", "-f", "json")
    assert ok.exit_code == 0 and json.loads(ok.stdout) == [{"n": 1}]
    skipped = invoke(app, "query", run, "SELECT count(*) AS n FROM scores", "-f", "json")
    assert skipped.exit_code == 0 and json.loads(skipped.stdout) == [{"n": 0}]
    assert f"warning: {path}: truncated Parquet" in skipped.stderr


def test_doctor_errors(app, tmp_path: Path) -> None:
    result = invoke(app, "doctor", tmp_path / "nope")
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
    run = create_run(tmp_path, "r").root
    Ledger(run).finish(0, "train", outputs=["tables/steps/run=r/step=0/part-train-0-00-main.parquet"])
    (run / "checkpoints" / "step_3").mkdir()
    result = invoke(app, "doctor", tmp_path)
    assert result.exit_code == 1
    assert "output of train step 0 attempt 0 (main) is missing" in result.stderr
    assert "step_3" in result.stderr and "no manifest.json" in result.stderr


def test_shipped_query_headers_document_themselves() -> None:
    for name in NAMED:
        q = get_query(name)
        assert q.notes, name  # free-text explanation of the columns
        assert q.sql.lstrip().startswith("-- name: " + name)


def test_main_cli_app_has_the_commands() -> None:
    from flows.cli import app

    result = CliRunner().invoke(app, ["query", "--list"])
    assert result.exit_code == 0 and "calibration-history" in result.output
    result = CliRunner().invoke(app, ["doctor", "--help"])
    assert result.exit_code == 0


def test_behaviour_by_lag_equals_a_python_reference(app, campaign: Path) -> None:
    """The query's behaviour weight log(pi_old/mu) per lag and its two parts (lag, rollout mismatch),
    recomputed token by token from the two tables."""
    rows = json.loads(invoke(app, "query", campaign, "-n", "behaviour-by-lag", "-f", "json").stdout)
    want: dict[tuple[str, int], list[float]] = {}
    for run in ("bf16", "fp8"):
        tok = query(connect(campaign / run), "SELECT step, sample_id, position, old_logp_fp8 FROM token_stats")
        cols = "step, sample_id, rollout_logp, train_logp, policy_version"
        ro = query(connect(campaign / run), f"SELECT {cols} FROM rollouts")
        mu = {(r["step"], r["sample_id"]): r for r in ro.to_pylist()}
        for t in tok.to_pylist():
            r = mu[(t["step"], t["sample_id"])]
            behaviour = r["rollout_logp"][t["position"]]
            at_sampling = r["train_logp"][t["position"]]
            parts = (t["old_logp_fp8"] - behaviour, t["old_logp_fp8"] - at_sampling, at_sampling - behaviour)
            want.setdefault((run, t["step"] - 1 - r["policy_version"]), []).append(parts)
    assert [(r["run_id"], r["lag"]) for r in rows] == sorted(want)
    for r in rows:
        w, lag, mismatch = np.asarray(want[(r["run_id"], r["lag"])], dtype=np.float64).T
        assert r["tokens"] == r["split_tokens"] == len(w)
        assert r["mean_log_weight"] == pytest.approx(w.mean(), abs=1e-6)
        assert r["mean_abs_log_weight"] == pytest.approx(np.abs(w).mean(), abs=1e-6)
        assert r["weight_above_2"] == pytest.approx((w > np.log(2)).mean(), abs=1e-12)
        assert r["mean_lag_part"] == pytest.approx(lag.mean(), abs=1e-6)
        assert r["mean_mismatch_part"] == pytest.approx(mismatch.mean(), abs=1e-6)
        assert r["mean_abs_lag_part"] == pytest.approx(np.abs(lag).mean(), abs=1e-6)
        assert r["mean_abs_mismatch_part"] == pytest.approx(np.abs(mismatch).mean(), abs=1e-6)
        assert r["mean_lag_part"] + r["mean_mismatch_part"] == pytest.approx(r["mean_log_weight"], abs=1e-6)
    shadow: dict[tuple[str, int], list[float]] = {}
    for run in ("bf16", "fp8"):
        lags = {x["step"]: x["step"] - 1 - x["policy_version"] for x in
                query(connect(campaign / run), "SELECT step, policy_version FROM rollouts").to_pylist()}
        for x in query(connect(campaign / run), "SELECT step, overclipped_share FROM steps").to_pylist():
            if x["overclipped_share"] is not None:
                shadow.setdefault((run, lags[x["step"]]), []).append(x["overclipped_share"])
    assert shadow, "the fixture campaign has no shadow step: the over-clipped share goes unchecked"
    for r in rows:
        got = shadow.get((r["run_id"], r["lag"]), [])
        assert r["shadow_steps"] == len(got)
        assert r["overclipped_share"] == (pytest.approx(np.mean(got), abs=1e-12) if got else None)
