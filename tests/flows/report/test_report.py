"""`fp8rl report`: figures with data, the SQL behind each, files that exist, a page Chromium renders.

The runs are fabricated through the real storage layer (``create_run`` +
``TableWriter``) with values shaped like a tiny campaign's — a full-FP8 run
with standard clipping whose entropy surges and a calibrated one — so the
report code is tested without training a model. :func:`fabricate_run` is also
used by ``test_sweep.py``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from datetime import datetime, timedelta, timezone
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import typer
from typer.testing import CliRunner

from flows.commands.report import register
from flows.report.figures import FIGURES
from flows.report.page import build_report
from storage.parts.writer import TableWriter, read_table
from storage.queries import get_query
from storage.queries.catalog import connect, query, set_params
from storage.run.layout import create_run
from tests.conftest import app_with

# end to end on a shared 2-core machine: a module fixture's campaign counts in its first test
pytestmark = pytest.mark.timeout(900)

STAGE_SECONDS = {"rollout": 2.0, "score": 0.2, "train": 3.0, "calibrate": 0.3, "evaluate": 4.0, "checkpoint": 0.5}


def _ledger_events(run_id: str, steps: int, *, calib_every: int, eval_every: int) -> list[dict]:
    """start/finish events with realistic durations (the ledger's JSON-lines format)."""
    t = datetime(2026, 1, 1, tzinfo=timezone.utc)
    events = []
    for step in range(steps + 1):
        stages = [] if step == 0 else ["rollout", "score", "train"]
        if step >= 1 and (step - 1) % calib_every == 0:
            stages.append("calibrate")
        if step % eval_every == 0 or step == steps:
            stages.append("evaluate")
        if step == steps:
            stages.append("checkpoint")
        for stage in stages:
            key = {"run_id": run_id, "step": step, "stage": stage, "attempt": 0, "variant": "main"}
            events.append({"event": "start", **key, "at": t.isoformat()})
            t += timedelta(seconds=STAGE_SECONDS[stage] * (1 + 0.05 * (step % 3)))
            events.append({"event": "finish", **key, "at": t.isoformat(), "outputs": [], "info": {}})
    return events


def _guard_events(run_id: str, steps: int) -> list[dict]:
    """One guard rollback in the middle of a run (it takes no time, so wall_seconds is unchanged)."""
    t = datetime(2026, 1, 1, tzinfo=timezone.utc).isoformat()
    key = {"run_id": run_id, "step": steps // 2 - 2, "stage": "guard", "attempt": 0, "variant": "main"}
    info = {
        "kind": "entropy_surge",
        "detected_step": steps // 2,
        "first_bad_step": steps // 2 - 1,
        "rollback_to": steps // 2 - 2,
        "action": "rollback",
        "remedy": "recalibrate_now",
    }
    return [{"event": "start", **key, "at": t}, {"event": "finish", **key, "at": t, "outputs": [], "info": info}]


def fabricate_run(
    root: Path,
    run_id: str,
    *,
    calibrated: bool,
    steps: int = 10,
    calib_every: int = 3,
    eval_every: int = 5,
    seed: int = 0,
) -> Path:
    """A finished fake run under ``root``; returns its directory."""
    rng = np.random.default_rng(seed)
    run = create_run(root, run_id, config={"name": run_id, "calibrated": calibrated}).root
    w = TableWriter(run, durable=False)
    lower, upper = 0.8, 1.28
    for step in range(steps + 1):
        if step >= 1:
            shadow = (step - 1) % calib_every == 0
            surge = 0.0 if calibrated else max(0.0, step - steps / 2) * 0.15
            n_tok = 600 if shadow else 30  # shadow steps keep every token, others a 5% sample
            sid = np.repeat(np.arange(n_tok // 10), 10)
            adv = np.repeat(rng.normal(size=n_tok // 10), 10).astype(np.float32)
            logp16 = -rng.exponential(0.6 + surge, n_tok).astype(np.float32)
            old16 = logp16 + rng.normal(0, 0.1, n_tok).astype(np.float32)
            noise = 0.05 if calibrated else 0.08
            logp8 = logp16 + rng.normal(0, noise, n_tok).astype(np.float32)
            old8 = old16 + rng.normal(0, noise, n_tok).astype(np.float32)
            w.write(
                "token_stats",
                step,
                {
                    "sample_id": sid.astype(np.int32),
                    "position": np.tile(np.arange(10), n_tok // 10).astype(np.int32),
                    "advantage": adv,
                    "logp_fp8": logp8,
                    "old_logp_fp8": old8,
                    "logp_bf16": logp16 if shadow else None,
                    "old_logp_bf16": old16 if shadow else None,
                    "entropy": rng.exponential(0.8 + surge, n_tok).astype(np.float32),
                    "lower_bound": lower,
                    "upper_bound": upper,
                    "standard_lower": 0.8,
                    "standard_upper": 1.28,
                },
                stage="train",
            )
            row = {
                "reward_mean": 0.3 + 0.04 * step - (2 * surge if not calibrated else 0.0),
                "accuracy": 0.3 + 0.035 * step - (2 * surge if not calibrated else 0.0),
                "entropy_mean": 0.8 + surge + rng.normal(0, 0.01),
                "clipfrac_lower": 0.02 + (0.0 if calibrated else 0.01 * step),
                "clipfrac_upper": 0.01,
                "clipfrac": 0.03,
                "dualclip_frac": 0.001,
                "ppo_kl": 1e-3,
                "lower_bound": lower,
                "upper_bound": upper,
                "response_length_mean": 12 + step * 0.3 + 20 * surge,
                "garbled_share": min(1.0, surge / 2),
                "kept_share": 1.0,
                "shadow": float(shadow),
                "rollout_seconds": 2.0,
                "score_seconds": 0.2,
                "train_seconds": 3.0,
                "step_seconds": 5.2,
                "drift_signal": 0.0 if shadow else 0.05 + 0.01 * (step % 3),
            }
            if shadow:
                prob = 0.010 if calibrated else 0.012
                row.update(
                    {
                        "prob_nmae": prob,
                        "old_prob_nmae": prob,
                        "ratio_nmae": prob * 2.2,
                        "amplification": 2.2,
                        "overclipped_share": 0.002 if calibrated else 0.02 + 0.002 * step,
                        "underclipped_share": 0.002,
                        "lower_clip_share_neg_fp8": 0.05 if calibrated else 0.2,
                        "lower_clip_share_neg_bf16": 0.05,
                        "ratio_noise_nmae": prob * 2.2,
                        "tis_weight_nmae": prob * 1.1,
                        "rollout_bf16_prob_nmae": 0.03,
                        "rollout_bf16_tis_nmae": 0.03,
                        "rollout_fp8_prob_nmae": 0.031,
                        **{f"clipfrac_lower_entropy_bin{i}": 0.01 * (i + 1) for i in range(5)},
                        **{f"clipfrac_upper_entropy_bin{i}": 0.005 * (i + 1) for i in range(5)},
                    }
                )
            w.write("steps", step, row, stage="train")
            if shadow:
                raw_lower = 0.8 - (0.08 if calibrated else 0.0)
                new_lower = max(raw_lower, lower - 0.05) if calibrated else lower
                w.write(
                    "bounds",
                    step,
                    {
                        "mode": "calibrated" if calibrated else "standard",
                        "alpha": 0.05,
                        "raw_lower": raw_lower,
                        "raw_upper": 1.3 if calibrated else 1.28,
                        "lower": new_lower,
                        "upper": 1.29 if calibrated else 1.28,
                        "target_balance": 1.1,
                        "balance_before": 1.3,
                        "balance_after": 1.12,
                        "tokens": n_tok,
                        "negative_tokens": n_tok // 2,
                    },
                    stage="calibrate",
                )
                lower = new_lower
        if step % eval_every == 0 or step == steps:
            acc = 0.30 + (0.02 * step if calibrated else 0.02 * min(step, 5) - 0.01 * max(0, step - 5))
            w.write(
                "eval_scores",
                step,
                [{"benchmark": "synthetic", "metric": "avg@k", "k": 1, "value": acc, "n_problems": 1000}],
                stage="evaluate",
            )
    events = _ledger_events(run.name, steps, calib_every=calib_every, eval_every=eval_every) + _guard_events(
        run.name, steps
    )
    (run / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    fabricate_run(root, "fp8-standard", calibrated=False, seed=0)
    fabricate_run(root, "fp8-calibrated", calibrated=True, seed=1)
    return root


@pytest.fixture(scope="module")
def report(runs_root: Path, tmp_path_factory):
    return build_report([runs_root], tmp_path_factory.mktemp("report") / "out")


class _Refs(HTMLParser):
    """Every src/href of a page, and the <img> sources."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.images: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.refs.append(value)
                if tag == "img":
                    self.images.append(value)


def _refs(index: Path) -> _Refs:
    parser = _Refs()
    parser.feed(index.read_text(encoding="utf-8"))
    return parser


# --------------------------------------------------------------------------- the report


def test_every_figure_is_drawn(report) -> None:
    assert [f.figure.name for f in report.figures] == [f.name for f in FIGURES]
    for f in report.figures:  # these runs have every table: every figure must be drawn
        assert f.png is not None, f"{f.figure.name}: {f.note}"
        assert f.rows > 0 and f.panels, f.figure.name
        for p in f.panels:  # not empty axes: one line per run, with points
            assert p.lines >= 2 and p.points >= p.lines, (f.figure.name, p)
        assert (report.out_dir / f.png).stat().st_size > 5000


def test_runs_are_overlaid_one_line_per_run(report) -> None:
    reward = next(f for f in report.figures if f.figure.name == "reward")
    assert [(p.title, p.lines, p.points) for p in reward.panels] == [
        ("mean reward", 2, 20),
        ("training accuracy", 2, 20),
    ]
    bounds = next(f for f in report.figures if f.figure.name == "bounds")
    assert bounds.rows == 8 and bounds.panels[0].lines == 4  # raw and smoothed L, two runs, 4 calibrations each
    timings = next(f for f in report.figures if f.figure.name == "timings")
    assert {p.title for p in timings.panels} == set(STAGE_SECONDS) | {"guard"}  # the fabricated guard rollback


def test_html_references_only_files_that_exist(report) -> None:
    refs = _refs(report.index)
    assert sorted(refs.images) == sorted(f.png for f in report.figures)
    for ref in refs.refs:
        if ref.startswith("#"):
            assert f'id="{ref[1:]}"' in report.index.read_text()
            continue
        assert not re.match(r"^[a-z]+:", ref), f"external reference {ref}"
        assert (report.out_dir / ref).is_file(), ref


def test_each_figure_shows_the_sql_that_produced_it(report, runs_root: Path) -> None:
    page = report.index.read_text(encoding="utf-8")
    con = connect(runs_root)
    for f in report.figures:
        shown = (report.out_dir / f"{f.figure.name}.sql").read_text()
        assert shown.rstrip().rstrip(";") == f.figure.sql
        assert (
            f.figure.sql.replace("&", "&amp;")
            .replace("<", "&lt;")
            .replace(">", "&gt;")
            .replace('"', "&quot;")
            .replace("'", "&#x27;")
            in page
        )
        assert query(con, shown).num_rows == f.rows  # the SQL, re-run as shown, gives the plotted rows


def test_comparison_table_is_the_paper_table_query(report, runs_root: Path) -> None:
    rows = {r["run_id"]: r for r in report.table.to_pylist()}
    assert set(rows) == {"fp8-standard", "fp8-calibrated"}
    assert (report.out_dir / "table.csv").read_text().splitlines()[0].startswith('"run_id","clip_mode"')
    std, cal = rows["fp8-standard"], rows["fp8-calibrated"]
    # hand-computed from the fabricated evaluations: standard peaks at step 5, calibrated at the end
    assert (std["best_eval_step"], std["best_eval_average"]) == (5, pytest.approx(0.40))
    assert (cal["best_eval_step"], cal["best_eval_average"]) == (10, pytest.approx(0.50))
    assert std["initial_eval_average"] == pytest.approx(0.30)
    assert std["amplification"] == pytest.approx(2.2) and std["prob_nmae"] == pytest.approx(0.012)
    assert (
        std["peak_entropy"] == pytest.approx(std["final_entropy"]) and std["peak_entropy"] > cal["peak_entropy"] + 0.5
    )
    assert std["lower_clip_vs_bf16"] > cal["lower_clip_vs_bf16"]


def test_paper_table_matches_the_definitions(runs_root: Path) -> None:
    """Lower-clip shares and over-clipping recomputed from the Parquet files with numpy (docs/method.md)."""
    named = get_query("paper-table")
    con = connect(runs_root)
    set_params(con, {k: d for k, (d, _) in named.params.items()})
    row = next(r for r in query(con, named.sql).to_pylist() if r["run_id"] == "fp8-standard")
    files = TableWriter(runs_root / "fp8-standard").live_files("token_stats")
    t = pa.concat_tables([read_table(f) for f in files]).to_pydict()
    shadow = np.array([v is not None for v in t["logp_bf16"]])
    a = np.array(t["advantage"])[shadow]
    ratio = lambda lp, old: np.exp(np.clip(np.array(lp, float)[shadow] - np.array(old, float)[shadow], -20, 20))  # noqa: E731
    r8, r16 = ratio(t["logp_fp8"], t["old_logp_fp8"]), ratio(t["logp_bf16"], t["old_logp_bf16"])
    lower = np.array(t["lower_bound"])[shadow]
    fp8 = np.sum((a < 0) & (r8 < lower)) / np.sum(a < 0)
    bf16 = np.sum((a < 0) & (r16 < 0.8)) / np.sum(a < 0)
    assert row["lower_clip_neg_fp8"] == pytest.approx(fp8, rel=1e-6)
    assert row["lower_clip_neg_bf16"] == pytest.approx(bf16, rel=1e-6)
    assert row["lower_clip_vs_bf16"] == pytest.approx(fp8 / bf16, rel=1e-6)
    assert row["overclipped_share"] == pytest.approx(np.mean((a < 0) & (r16 >= 0.8) & (r8 < lower)), rel=1e-6)
    assert row["wall_seconds"] == pytest.approx(
        sum(
            STAGE_SECONDS[s] * (1 + 0.05 * (step % 3))
            for step, s in _stages_of_fake_run(10, calib_every=3, eval_every=5)
        )
    )


def test_paper_table_reads_metrics_with_k_filled_in(tmp_path: Path) -> None:
    """'avg@k' selects the metric whether stored as 'avg@k' (with k beside it) or as 'avg@4'."""
    run = create_run(tmp_path, "k4").root
    w = TableWriter(run, durable=False)
    for step, acc in ((0, 0.2), (5, 0.6)):
        w.write(
            "eval_scores",
            step,
            [{"benchmark": "synthetic", "metric": m, "k": 4, "value": v} for m, v in (("avg@4", acc), ("pass@4", 0.9))],
            stage="evaluate",
        )
    named = get_query("paper-table")
    con = connect(run)
    set_params(con, {"metric": "avg@k"})
    row = query(con, named.sql).to_pylist()[0]
    assert (row["best_eval_step"], row["best_eval_average"], row["initial_eval_average"]) == (5, 0.6, 0.2)
    set_params(con, {"metric": "pass@k"})
    assert query(con, named.sql).to_pylist()[0]["best_eval_average"] == 0.9


def _stages_of_fake_run(steps: int, *, calib_every: int, eval_every: int):
    for e in _ledger_events("x", steps, calib_every=calib_every, eval_every=eval_every):
        if e["event"] == "finish":
            yield e["step"], e["stage"]


def test_figures_without_data_say_so(tmp_path: Path) -> None:
    """A run with no shadow steps, calibrations or evaluations: those figures are a sentence, not empty axes."""
    run = create_run(tmp_path / "runs", "no-shadow").root
    w = TableWriter(run, durable=False)
    for step in range(1, 5):
        w.write(
            "steps", step, {"reward_mean": 0.1 * step, "entropy_mean": 0.8, "response_length_mean": 12.0}, stage="train"
        )
    rep = build_report([run], tmp_path / "out")
    drawn = {f.figure.name for f in rep.figures if f.png}
    assert drawn == {"reward", "entropy", "response_length"}  # clip shares: contract columns, all NULL here
    page = rep.index.read_text()
    for f in rep.figures:
        if f.png is None:
            assert f.panels == [] and not (rep.out_dir / f"{f.figure.name}.png").exists()
            assert f"No data: {f.note}" in page.replace("&#x27;", "'").replace("&quot;", '"')
    noise = next(f for f in rep.figures if f.figure.name == "noise")
    assert "no BF16 shadow steps" in noise.note
    garbled = next(f for f in rep.figures if f.figure.name == "garbled")
    assert "garbled_share" in garbled.note  # a column the run never wrote: named, not a crash
    reward = next(f for f in rep.figures if f.figure.name == "reward")
    assert [p.title for p in reward.panels] == ["mean reward"] and "training accuracy" in reward.note
    assert sorted(_refs(rep.index).images) == sorted(f.png for f in rep.figures if f.png)


def test_several_roots_and_clashing_run_ids(tmp_path: Path) -> None:
    a = fabricate_run(tmp_path / "a", "same", calibrated=False, steps=4, seed=2)
    b = fabricate_run(tmp_path / "b", "same", calibrated=True, steps=4, seed=3)
    entropy_only = tuple(f for f in FIGURES if f.name == "entropy")
    rep = build_report([a, b], tmp_path / "out", figures=entropy_only)
    assert [label for label, _ in rep.runs] == ["same@a", "same@b"]
    entropy = next(f for f in rep.figures if f.figure.name == "entropy")
    assert entropy.panels[0].lines == 2
    assert sorted(r["run_id"] for r in rep.table.to_pylist()) == ["same@a", "same@b"]


# --------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    return app_with(register)


def test_cli_report(app, tmp_path: Path) -> None:
    run = create_run(tmp_path / "runs", "r1").root
    TableWriter(run, durable=False).write("steps", 1, {"reward_mean": 0.5, "entropy_mean": 0.7}, stage="train")
    res = CliRunner().invoke(app, ["report", str(run)])
    assert res.exit_code == 0, res.output
    assert "1 run(s), 2 figure(s) with data; no data: evaluation, response_length," in res.output
    assert (run / "report" / "index.html").is_file()  # default --out: ROOT/report
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and bad.output.startswith("error: ") and "no such directory" in bad.output
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------- headless Chromium

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)

# Injected first in <head>: records console.error/warn calls, script errors and failed
# resource loads; after 'load' (every image fetched and decoded) writes a verdict into
# the DOM, which --dump-dom prints. The report itself carries no script.
_PROBE = """<script>
(function () {
  var errors = [];
  ['error', 'warn'].forEach(function (level) {
    var orig = console[level];
    console[level] = function () {
      errors.push(level + ': ' + Array.prototype.join.call(arguments, ' '));
      orig.apply(console, arguments);
    };
  });
  window.addEventListener('error', function (e) {
    errors.push('load error: ' + (e.message || (e.target && (e.target.src || e.target.href)) || 'unknown'));
  }, true);
  window.addEventListener('unhandledrejection', function (e) { errors.push('rejection: ' + e.reason); });
  window.addEventListener('load', function () {
    var imgs = Array.prototype.slice.call(document.images);
    var broken = imgs.filter(function (i) { return !(i.complete && i.naturalWidth > 0); })
                     .map(function (i) { return i.getAttribute('src'); });
    var out = document.createElement('pre');
    out.id = 'fp8rl-probe';
    out.textContent = JSON.stringify({images: imgs.length, broken: broken, errors: errors});
    document.body.appendChild(out);
  });
})();
</script>"""


def _chromium_check(page: Path, tmp_path: Path) -> tuple[dict, list[str]]:
    """Load ``page`` (with the probe injected) in headless Chromium: (probe verdict, console lines)."""
    probed = page.with_name("_probed_" + page.name)
    probed.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + _PROBE, 1), encoding="utf-8")
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=10000",
        "--dump-dom",
        probed.as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="fp8rl-probe">(.*?)</pre>', proc.stdout, re.S)
    assert m, f"probe verdict missing (rc {proc.returncode}): {proc.stderr[-2000:]}"
    verdict = json.loads(
        m.group(1).replace("&quot;", '"').replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    )
    console = [ln for ln in proc.stderr.splitlines() if ":CONSOLE" in ln and "file://" in ln]
    return verdict, console


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian: apt-get install -y chromium)")
def test_page_renders_in_headless_chromium(report, tmp_path: Path) -> None:
    verdict, console = _chromium_check(report.index, tmp_path)
    assert verdict["images"] == len(report.figures) and verdict["broken"] == []
    assert verdict["errors"] == [] and console == []


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian: apt-get install -y chromium)")
def test_chromium_check_catches_broken_pages(tmp_path: Path) -> None:
    """The check above can fail: a missing image and a console error are both caught."""
    page = tmp_path / "bad.html"
    page.write_text(
        '<!DOCTYPE html><html><head></head><body><img src="missing.png">'
        "<script>console.error('boom')</script></body></html>"
    )
    verdict, console = _chromium_check(page, tmp_path)
    assert verdict["broken"] == ["missing.png"]
    assert "error: boom" in verdict["errors"] and any("missing.png" in e for e in verdict["errors"])
    assert any("boom" in ln for ln in console)


def test_paper_table_late_and_final_evaluations(tmp_path: Path) -> None:
    """late_eval_average: the mean of the evaluations at or after half the last evaluated step;
    final_eval_average: the last one. Best-of-N is kept beside them (it rewards evaluation noise)."""
    run = create_run(tmp_path, "late").root
    w = TableWriter(run, durable=False)
    for step, acc in ((0, 0.2), (25, 0.9), (50, 0.5), (75, 0.6), (100, 0.7)):
        w.write(
            "eval_scores", step, [{"benchmark": "synthetic", "metric": "avg@k", "k": 1, "value": acc}], stage="evaluate"
        )
    named = get_query("paper-table")
    con = connect(run)
    set_params(con, {"metric": "avg@k"})
    row = query(con, named.sql).to_pylist()[0]
    assert row["late_eval_average"] == pytest.approx((0.5 + 0.6 + 0.7) / 3)  # steps 50, 75, 100
    assert row["final_eval_average"] == pytest.approx(0.7)
    assert (row["best_eval_step"], row["best_eval_average"]) == (25, 0.9)
