"""`fp8rl sweep`: the sweep file's schema, the cells, and resume after an interruption.

The campaign is injected: :class:`FakeCampaign` writes what a campaign leaves
in its run directory — ledger records for every stage of every step, one
``steps`` row and ``eval_scores`` per evaluation — in milliseconds, and can
stop dead in a chosen cell (a ``KeyboardInterrupt`` after some steps: the
sweep stops at once, as after Ctrl-C or a kill) or fail there.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from flows.campaign.configuration import ConfigError, load_config
from flows.commands.report import register
from flows.sweep.runner import run_sweep_file
from flows.sweep.spec import CELLS_DIR, load_sweep
from flows.sweep.state import FINISHED, NEW, PARTIAL, cell_state
from stages.context import is_calibration_step, is_checkpoint_step, is_eval_step
from storage.ledger.events import Ledger
from storage.parts.writer import TableWriter

# end to end on a shared 2-core machine: a module fixture's campaign counts in its first test
pytestmark = pytest.mark.timeout(900)

SWEEP = """\
name: mini
base: tiny-cpu
overrides: {steps: 3, calibration.interval: 2, evaluation: {interval: 2}}
axes:
  precision:
    bf16: {precision.train: bf16, precision.rollout: bf16}
    fp8: {precision.train: fp8_tensorwise}
  clip:
    standard: {calibration.mode: standard}
    calibrated: {calibration.mode: calibrated}
seeds: [0]
exclude:
  - {precision: bf16, clip: calibrated}
"""
CELLS = ["bf16.standard.s0", "fp8.standard.s0", "fp8.calibrated.s0"]


class FakeCampaign:
    """Stands in for ``campaign_flow``: records calls, writes ledger and metrics.

    ``interrupt_in`` / ``fail_in``: cell id where it stops after ``after_steps``
    steps with a KeyboardInterrupt (the sweep must stop) or a RuntimeError
    (the sweep must go on to the next cell).
    """

    def __init__(self, interrupt_in: str | None = None, fail_in: str | None = None, after_steps: int = 1) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.interrupt_in, self.fail_in, self.after_steps = interrupt_in, fail_in, after_steps

    def __call__(self, run_dir: str, resume: bool) -> dict:
        cell = Path(run_dir).name
        self.calls.append((cell, resume))
        cfg = load_config(Path(run_dir) / "config.yaml")
        ledger, writer = Ledger(run_dir), TableWriter(run_dir, durable=False)
        for step in range(cfg.steps + 1):
            if cell in (self.interrupt_in, self.fail_in) and step > self.after_steps:
                if cell == self.interrupt_in:
                    raise KeyboardInterrupt
                raise RuntimeError(f"injected failure at step {step}")
            done = ledger.done_stages(step)
            stages = [] if step == 0 else ["rollout", "score", "train"]
            stages += ["calibrate"] if is_calibration_step(cfg, step) else []
            stages += ["evaluate"] if is_eval_step(cfg, step) else []
            stages += ["checkpoint"] if is_checkpoint_step(cfg, step) else []
            for stage in stages:
                if stage in done:
                    continue
                with ledger.stage(step, stage):
                    if stage == "train":
                        row = {"entropy_mean": 0.5 + 0.1 * step, "response_length_mean": 10.0}
                        writer.write("steps", step, row, stage="train")
                    if stage == "evaluate":
                        acc = 0.3 + 0.05 * step + (0.1 if cfg.calibration.mode == "calibrated" else 0.0)
                        writer.write(
                            "eval_scores",
                            step,
                            [{"benchmark": "synthetic", "metric": "avg@k", "k": 1, "value": acc}],
                            stage="evaluate",
                        )
        return {"run_dir": run_dir, "last_step": cfg.steps, "final_metrics": {}, "last_eval": {}}


@pytest.fixture
def sweep_file(tmp_path: Path) -> Path:
    path = tmp_path / "mini.yaml"
    path.write_text(SWEEP)
    return path


def _run(sweep_file: Path, out: Path, campaign: FakeCampaign) -> dict:
    return run_sweep_file(sweep_file, out, campaign=campaign, report=False, echo=lambda _line: None)


def test_cells_are_the_product_minus_excluded(sweep_file: Path) -> None:
    spec, cells = load_sweep(sweep_file)
    assert [c.id for c in cells] == CELLS
    fp8_cal = cells[2].config
    assert (fp8_cal.precision.train, fp8_cal.precision.rollout, fp8_cal.calibration.mode) == (
        "fp8_tensorwise",
        "fp8_per_tensor",
        "calibrated",
    )
    assert cells[0].config.precision.rollout == "bf16"
    # common overrides, dotted and nested, merge into the preset rather than replace sections
    assert fp8_cal.steps == 3 and fp8_cal.evaluation.interval == 2 and fp8_cal.evaluation.benchmarks
    from flows.campaign.configuration import load_config

    assert fp8_cal.calibration.interval == 2
    assert fp8_cal.rollout.max_new_tokens == load_config("tiny-cpu").rollout.max_new_tokens  # untouched preset value


def test_interrupted_sweep_resumes_and_skips_finished_cells(sweep_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    first = FakeCampaign(interrupt_in="fp8.standard.s0", after_steps=1)
    with pytest.raises(KeyboardInterrupt):
        _run(sweep_file, out, first)
    assert first.calls == [("bf16.standard.s0", False), ("fp8.standard.s0", False)]
    _, cells = load_sweep(sweep_file)
    assert [cell_state(out, c) for c in cells] == [FINISHED, PARTIAL, NEW]
    assert (out / CELLS_DIR / "bf16.standard.s0.json").is_file()
    assert not (out / CELLS_DIR / "fp8.standard.s0.json").exists()

    second = FakeCampaign()
    summary = _run(sweep_file, out, second)
    assert second.calls == [("fp8.standard.s0", True), ("fp8.calibrated.s0", False)]  # finished cell not re-run
    assert summary["cells"] == {"bf16.standard.s0": "skipped", "fp8.standard.s0": "done", "fp8.calibrated.s0": "done"}
    assert summary["failed"] == [] and summary["unfinished"] == []
    # the interrupted cell resumed from its ledger: steps 0-1 were not redone
    train_records = [r for r in Ledger(out / "fp8.standard.s0").records() if r.stage == "train"]
    assert sorted(r.step for r in train_records) == [1, 2, 3]

    third = FakeCampaign()
    assert set(_run(sweep_file, out, third)["cells"].values()) == {"skipped"} and third.calls == []

    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [r["cell"] for r in rows] == CELLS and {r["status"] for r in rows} == {"finished"}
    assert {r["precision"] for r in rows} == {"bf16", "fp8"} and rows[2]["clip"] == "calibrated"
    assert float(rows[2]["best_eval_average"]) == pytest.approx(0.3 + 0.05 * 3 + 0.1)
    assert float(rows[0]["final_entropy"]) == pytest.approx(0.8) and float(rows[0]["peak_entropy"]) == pytest.approx(
        0.8
    )
    md = (out / "table.md").read_text()
    assert "| precision | clip | best eval %" in md and "| fp8 | calibrated | 55.0 |" in md


def test_a_sweep_runs_in_parts_into_one_directory(sweep_file: Path, tmp_path: Path) -> None:
    """``--cells`` globs: each part runs only its cells; the table lists every cell with its state."""
    from flows.campaign.configuration import ConfigError

    out = tmp_path / "sweep"
    first = FakeCampaign()
    summary = run_sweep_file(sweep_file, out, campaign=first, report=False, echo=lambda _l: None, only=["bf16.*"])
    assert first.calls == [("bf16.standard.s0", False)] and summary["cells"] == {"bf16.standard.s0": "done"}
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [(r["cell"], r["status"]) for r in rows] == [(CELLS[0], "finished"), (CELLS[1], "new"), (CELLS[2], "new")]
    second = FakeCampaign()
    run_sweep_file(
        sweep_file, out, campaign=second, report=False, echo=lambda _l: None, only=["*.calibrated.*", "fp8.*"]
    )
    assert second.calls == [("fp8.standard.s0", False), ("fp8.calibrated.s0", False)]  # file order, each once
    assert {r["status"] for r in csv.DictReader((out / "table.csv").open())} == {"finished"}
    with pytest.raises(ConfigError, match=r"--cells 'fp4\.\*' matches no cell; the cells are bf16.standard.s0"):
        run_sweep_file(sweep_file, out, campaign=FakeCampaign(), report=False, echo=lambda _l: None, only=["fp4.*"])


def test_finished_by_ledger_when_the_marker_is_missing(sweep_file: Path, tmp_path: Path) -> None:
    """Killed between the campaign's end and the marker: the ledger says finished, nothing re-runs."""
    out = tmp_path / "sweep"
    _run(sweep_file, out, FakeCampaign())
    marker = out / CELLS_DIR / "fp8.calibrated.s0.json"
    marker.unlink()
    again = FakeCampaign()
    assert _run(sweep_file, out, again)["cells"]["fp8.calibrated.s0"] == "skipped"
    assert again.calls == [] and marker.is_file()


def test_a_failed_cell_does_not_stop_the_others(sweep_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    summary = _run(sweep_file, out, FakeCampaign(fail_in="bf16.standard.s0", after_steps=2))
    assert summary["failed"] == ["bf16.standard.s0"]
    assert summary["cells"]["fp8.calibrated.s0"] == "done"
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert rows[0]["status"] == "failed" and "| status |" in (out / "table.md").read_text()
    retry = FakeCampaign()
    assert not _run(sweep_file, out, retry)["failed"] and retry.calls == [("bf16.standard.s0", True)]


def test_fail_fast_stops_at_the_first_failure(sweep_file: Path, tmp_path: Path) -> None:
    fake = FakeCampaign(fail_in="bf16.standard.s0")
    summary = run_sweep_file(
        sweep_file, tmp_path / "s", campaign=fake, fail_fast=True, report=False, echo=lambda _l: None
    )
    assert fake.calls == [("bf16.standard.s0", False)]
    assert summary["unfinished"] == ["fp8.standard.s0", "fp8.calibrated.s0"]


def test_a_changed_sweep_file_does_not_mix_configs(sweep_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    _run(sweep_file, out, FakeCampaign())
    sweep_file.write_text(SWEEP.replace("steps: 3", "steps: 4"))
    fake = FakeCampaign()
    with pytest.raises(ConfigError, match=r"cell bf16\.standard\.s0: .* another config"):
        _run(sweep_file, out, fake)
    assert fake.calls == []  # checked before any cell runs


def test_a_cell_made_before_a_new_setting_existed_still_resumes(sweep_file: Path, tmp_path: Path) -> None:
    """A release that adds a setting at its default changes every cell's config text, not its campaign."""
    import yaml

    from storage.run.layout import config_hash

    def rewrite(run: Path, text: str) -> None:  # the config and its hash, as a run made with it records them
        (run / "config.yaml").write_text(text)
        info = json.loads((run / "run.json").read_text())
        (run / "run.json").write_text(json.dumps({**info, "config_hash": config_hash(text)}))

    out = tmp_path / "sweep"
    fake = FakeCampaign(interrupt_in="fp8.standard.s0", after_steps=1)
    with pytest.raises(KeyboardInterrupt):
        _run(sweep_file, out, fake)
    run = out / "fp8.standard.s0"
    older = yaml.safe_load((run / "config.yaml").read_text())
    del older["algorithm"]["old_logp_micro_batch_size"]  # as written before that setting existed (default None)
    rewrite(run, yaml.safe_dump(older, sort_keys=False))
    again = FakeCampaign()
    _run(sweep_file, out, again)
    assert ("fp8.standard.s0", True) in again.calls  # resumed, not refused
    older["algorithm"]["eps_low"] = 0.3  # a value that differs is another campaign
    rewrite(run, yaml.safe_dump(older, sort_keys=False))
    with pytest.raises(ConfigError, match=r"cell fp8\.standard\.s0: .* another config"):
        _run(sweep_file, out, FakeCampaign())


def test_seeds_multiply_cells_and_average(tmp_path: Path) -> None:
    path = tmp_path / "seeds.yaml"
    path.write_text(SWEEP.replace("seeds: [0]", "seeds: [0, 1]"))
    out = tmp_path / "sweep"
    _run(path, out, FakeCampaign())
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [r["cell"] for r in rows][:2] == ["bf16.standard.s0", "bf16.standard.s1"] and len(rows) == 6
    assert load_config(out / "bf16.standard.s1" / "config.yaml").seed == 1
    md = (out / "table.md").read_text()
    assert "### Mean over seeds" in md
    # the failure signals per cell and over seeds: the fake's entropy rises by 0.1 a step for
    # 3 steps, under the 10-step history a surge needs, so no seed has one
    assert "### Failure signals\n" in md and "### Failure signals, mean over seeds" in md
    assert "| fp8 | calibrated | 2 | 0/2 |" in md
    assert {r["accuracy_last10"] for r in rows} == {""} and "garbled_last10" in rows[0]


@pytest.mark.parametrize(
    "text, message",
    [
        (SWEEP + "axis: {}\n", r"mini\.yaml: axis: unknown key"),
        (
            SWEEP.replace("calibration.mode: calibrated", "calibration.mod: calibrated"),
            r"cell fp8\.calibrated\.s0: calibration\.mod: unknown key",
        ),
        (
            SWEEP.replace("precision.train: bf16,", "precision.train: bf8,"),
            r"cell bf16\.standard\.s0: precision\.train: unknown training precision mode 'bf8'; valid: bf16, ",
        ),
        (
            SWEEP.replace("{precision: bf16, clip: calibrated}", "{precision: bf16, clip: calibratd}"),
            r"exclude\.0\.clip: unknown label 'calibratd'; labels: standard, calibrated",
        ),
        (
            SWEEP.replace("{precision: bf16, clip: calibrated}", "{precison: bf16}"),
            r"exclude\.0\.precison: unknown axis",
        ),
        (SWEEP.replace("  precision:\n", "  prec.ision:\n"), r"axes: axis name 'prec\.ision' must match"),
        (SWEEP.replace("seeds: [0]", "seeds: [1, 1]"), r"seeds: seeds repeat"),
        (SWEEP.replace("base: tiny-cpu", "base: no-such-preset"), r"config not found: no-such-preset"),
    ],
)
def test_bad_sweep_files_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "mini.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_sweep(path)


def test_paper_tiny_sweep() -> None:
    spec, cells = load_sweep(Path(__file__).resolve().parents[3] / "configs" / "sweeps" / "paper-tiny.yaml")
    got = {(c.config.precision.train, c.config.precision.rollout, c.config.calibration.mode) for c in cells}
    assert len(cells) == len(got) == 10
    assert got == {
        ("bf16", "bf16", "standard"),
        ("bf16", "fp8_per_tensor", "standard"),
        *{
            (t, r, m)
            for t, r in (
                ("fp8_tensorwise", "fp8_per_tensor"),
                ("fp8_rowwise", "fp8_per_tensor"),
                ("fp8_blockwise", "fp8_per_block"),
            )
            for m in ("standard", "calibrated")
        },
        ("fp8_tensorwise", "fp8_per_tensor", "relaxed_lower"),
        ("fp8_tensorwise", "fp8_per_tensor", "bapo"),
    }


def test_cli_dry_run_lists_cells_and_runs_nothing(sweep_file: Path, tmp_path: Path) -> None:
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        """test app"""

    register(app)
    out = tmp_path / "sweep"
    res = CliRunner().invoke(app, ["sweep", str(sweep_file), "--out", str(out), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert all(c in res.output for c in CELLS) and "clip=calibrated" in res.output and not out.exists()
    res = CliRunner().invoke(app, ["sweep", str(sweep_file), "--out", str(out), "--dry-run", "--cells", "fp8.*"])
    assert res.exit_code == 0 and "(2 selected)" in res.output and CELLS[0] not in res.output, res.output
    res = CliRunner().invoke(app, ["sweep", str(sweep_file), "--dry-run", "--cells", "nope"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "matches no cell" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(SWEEP + "axis: {}\n")
    res = CliRunner().invoke(app, ["sweep", str(bad), "--dry-run"])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "axis: unknown key" in res.output


def test_paper_ablations_sweep_cells() -> None:
    spec, cells = load_sweep(Path(__file__).resolve().parents[3] / "configs" / "sweeps" / "paper-ablations.yaml")
    assert spec.seeds == [0, 1] and len(cells) == 26 and all(c.config.steps == 40 for c in cells)
    got = {
        (
            c.config.precision.train,
            c.config.calibration.mode,
            c.config.algorithm.loss,
            c.config.calibration.relaxed_eps_low,
            c.config.calibration.interval,
            c.config.calibration.initial_lower,
        )
        for c in cells
        if c.seed == 0
    }
    fp8 = "fp8_tensorwise"
    assert got == {
        ("bf16", "standard", "ppo", 0.3, 5, None),
        ("bf16", "bapo", "ppo", 0.3, 5, None),
        ("bf16", "standard", "cispo", 0.3, 5, None),
        (fp8, "standard", "ppo", 0.3, 5, None),
        (fp8, "calibrated", "ppo", 0.3, 5, None),
        (fp8, "relaxed_lower", "ppo", 0.3, 5, None),
        (fp8, "relaxed_lower", "ppo", 0.4, 5, None),
        (fp8, "calibrated_lower_only", "ppo", 0.3, 5, None),
        (fp8, "bapo", "ppo", 0.3, 5, None),
        (fp8, "standard", "cispo", 0.3, 5, None),
        (fp8, "calibrated", "ppo", 0.3, 10, None),
        (fp8, "calibrated", "ppo", 0.3, 20, None),
        (fp8, "calibrated", "ppo", 0.3, 5, 0.7),
    }


def test_mean_over_seeds_shows_the_spread() -> None:
    from flows.sweep.spec import SweepSpec
    from flows.sweep.table import _mean_over_seeds

    spec = SweepSpec(name="x", axes={"clip": {"a": {}}}, seeds=[0, 1, 2])
    rows = [
        {"clip": "a", "status": "finished", "best_eval_average": v, "lower_clip_vs_bf16": x}
        for v, x in ((0.90, 1.2), (0.94, 1.4), (0.92, 1.3))
    ]
    (row,) = _mean_over_seeds(spec, rows)
    assert row["best_eval_average"] == pytest.approx(0.92) and row["seeds"] == 3
    assert row["best eval % min–max (sd)"] == "90.0–94.0 (2.0)"
    assert row["lower-clip vs BF16 min–max (sd)"] == "1.20–1.40 (0.10)"


def test_cli_ctrl_c_names_the_command_that_continues(sweep_file: Path, tmp_path: Path, monkeypatch) -> None:
    """A KeyboardInterrupt in a cell (Ctrl-C) is one line naming the command that continues, exit 130."""
    import flows.orchestration.server
    import flows.process.child_guard
    import flows.sweep.runner

    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def _root() -> None:
        """test app"""

    register(app)
    out = tmp_path / "sweep"
    fake = FakeCampaign(interrupt_in="fp8.standard.s0", after_steps=1)
    monkeypatch.setattr(flows.process.child_guard, "start", lambda: None)
    monkeypatch.setattr(flows.orchestration.server, "start", lambda *_a: None)
    monkeypatch.setattr(
        flows.sweep.runner,
        "_FLOW",
        lambda f, o, fail_fast, report, only, check_memory: run_sweep_file(
            f, o, campaign=fake, report=False, echo=lambda _line: None, only=only
        ),
    )
    res = CliRunner().invoke(app, ["sweep", str(sweep_file), "--out", str(out), "--cells", "*.standard.*"])
    assert res.exit_code == 130, res.output
    last = res.output.strip().splitlines()[-1]
    assert last == (
        f"interrupted; `fp8rl sweep {sweep_file} --out {out} --cells '*.standard.*'` "
        "continues the sweep (finished cells are skipped)"
    ), res.output
    assert "Traceback" not in res.output
    assert cell_state(out, load_sweep(sweep_file)[1][0]) == FINISHED  # bf16.standard.s0 ran before the interrupt
