"""A sweep setting chosen by a pilot under a rule fixed in the sweep file, and the code each cell ran on.

The campaign is the fake of ``tests/flows/sweep/test_sweep.py``, taught to score each correction
differently, so the rule has something to choose between.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from test_sweep import FakeCampaign
from typer.testing import CliRunner

from flows.campaign.configuration import ConfigError, load_config
from flows.commands.report import register
from flows.sweep.choice import ChoiceSpec, choice_path, pick, second_half
from flows.sweep.runner import run_sweep_file
from flows.sweep.spec import load_sweep

pytestmark = pytest.mark.timeout(600)

SWEEP = """\
name: decisive
base: tiny-cpu
overrides: {steps: 4, calibration.interval: 2, evaluation: {interval: 2}, algorithm.tis: true}
choose:
  strongest:
    rule: best-second-half-eval
    seeds: [100, 101]
    overrides: {calibration.mode: standard}
    candidates:
      token-tis: {algorithm.correction.mode: token-tis}
      icepop: {algorithm.correction.mode: icepop}
      seq-mis: {algorithm.correction.mode: seq-mis}
axes:
  setting:
    standard: {calibration.mode: standard}
    strongest: {calibration.mode: standard, choose: strongest}
    calibrated-strongest: {calibration.mode: calibrated, choose: strongest}
seeds: [0]
"""
PILOT = [f"pilot-strongest.{c}.s{s}" for c in ("token-tis", "icepop", "seq-mis") for s in (100, 101)]
SCORE = {"token-tis": 0.0, "icepop": 0.08, "seq-mis": 0.02}  # added to the fake's accuracy


class ScoringFake(FakeCampaign):
    """The sweep test's fake, whose evaluations rise by ``SCORE`` of the cell's correction."""

    def __call__(self, run_dir: str, resume: bool) -> dict:
        from storage.parts.writer import TableWriter

        out = super().__call__(run_dir, resume)
        cfg = load_config(Path(run_dir) / "config.yaml")
        writer = TableWriter(run_dir, durable=False)
        for step in (2, 4):  # replaces the fake's own evaluation of the step
            acc = 0.3 + 0.05 * step + SCORE[cfg.algorithm.correction.mode]
            row = {"benchmark": "synthetic", "metric": "avg@k", "k": 1, "value": acc}
            writer.write("eval_scores", step, [row], stage="evaluate")
        return out


def _write(tmp_path: Path, text: str = SWEEP) -> Path:
    path = tmp_path / "decisive.yaml"
    path.write_text(text)
    return path


def test_the_rule_takes_the_best_second_half_and_breaks_ties_by_over_clipping():
    spec = ChoiceSpec(rule="best-second-half-eval", seeds=[1], candidates={"a": {}, "b": {}, "c": {}}, tie=0.5)

    def fig(acc, over):
        return {"mean_second_half_eval": acc, "mean_overclipped_share": over}

    assert pick(spec, {"a": fig(50.0, 0.01), "b": fig(52.0, 0.02), "c": fig(None, None)}) == "b"
    assert pick(spec, {"a": fig(51.8, 0.01), "b": fig(52.0, 0.02), "c": fig(40.0, 0.0)}) == "a"  # a tie: less clipping
    assert pick(spec, {"a": fig(52.0, None), "b": fig(52.0, None), "c": fig(52.0, None)}) == "a"  # then file order
    assert second_half({0: 0.1, 10: 0.4, 20: 0.6}) == pytest.approx(50.0)  # steps 10 and 20 of 0..20
    with pytest.raises(ValueError, match="no pilot cell has an evaluation"):
        pick(spec, {"a": fig(None, None), "b": fig(None, None), "c": fig(None, None)})


def test_cells_that_use_a_choice_wait_for_it_and_the_pilot_comes_first(tmp_path: Path):
    spec, cells = load_sweep(_write(tmp_path))
    assert [c.id for c in cells] == [*PILOT, "standard.s0"]
    assert all(c.config.calibration.mode == "standard" for c in cells[:6])
    assert [c.config.algorithm.correction.mode for c in cells[:6]] == [
        "token-tis", "token-tis", "icepop", "icepop", "seq-mis", "seq-mis"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "edit, message",
    [
        (("strongest}\nseeds", "strongest}\n    other: {choose: nope}\nseeds"), "unknown choice 'nope'"),
        (("rule: best-second-half-eval", "rule: best-looking"), "unknown rule 'best-looking'"),
        (("seeds: [100, 101]", "seeds: [100, 100]"), "seeds repeat"),
        (("icepop: {algorithm.correction.mode: icepop}", "icepop: {algorithm.correction.mode: nope}"), "nope"),
    ],
)
def test_a_bad_choice_is_refused_when_the_file_loads(tmp_path: Path, edit, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(_write(tmp_path, SWEEP.replace(*edit)))


def test_the_pilot_runs_first_the_choice_is_made_once_and_the_waiting_cells_take_it(tmp_path: Path):
    out, path = tmp_path / "s", _write(tmp_path)
    fake, lines = ScoringFake(), []
    summary = run_sweep_file(path, out, campaign=fake, report=False, echo=lines.append)
    ran = [c for c, _ in fake.calls]
    assert ran == [*PILOT, "standard.s0", "strongest.s0", "calibrated-strongest.s0"]  # the matrix in file order
    made = next(i for i, ln in enumerate(lines) if ln.startswith("choice strongest: "))
    assert made < next(i for i, ln in enumerate(lines) if "standard.s0: starting" in ln)  # chosen right after the pilot
    assert not summary["failed"] and "choice strongest: icepop (rule best-second-half-eval" in "\n".join(lines)

    record = json.loads(choice_path(out, "strongest").read_text())
    assert record["winner"] == "icepop" and record["overrides"] == {"algorithm.correction.mode": "icepop"}
    figures = record["candidates"]
    assert figures["icepop"]["mean_second_half_eval"] > figures["seq-mis"]["mean_second_half_eval"]
    assert sorted(figures["icepop"]["runs"]) == ["pilot-strongest.icepop.s100", "pilot-strongest.icepop.s101"]
    for cell, mode in (("strongest.s0", "standard"), ("calibrated-strongest.s0", "calibrated")):
        cfg = load_config(out / cell / "config.yaml")
        assert cfg.algorithm.correction.mode == "icepop" and cfg.calibration.mode == mode
    table = (out / "table.md").read_text()
    assert "### Pilot: strongest" in table and "| icepop **(chosen)** |" in table
    assert "pilot-strongest" not in (out / "table.csv").read_text()  # the comparison holds the matrix only

    # made once: a re-run reads the record, even when the pilot's figures would now say otherwise
    SCORE["seq-mis"] = 0.5
    try:
        again = ScoringFake()
        run_sweep_file(path, out, campaign=again, report=False, echo=lambda _l: None)
    finally:
        SCORE["seq-mis"] = 0.02
    assert again.calls == [] and json.loads(choice_path(out, "strongest").read_text()) == record


def test_each_cell_records_the_commit_and_the_numerics_it_ran_on(tmp_path: Path):
    out, path = tmp_path / "s", _write(tmp_path)
    run_sweep_file(path, out, campaign=ScoringFake(), report=False, echo=lambda _l: None, only=["standard.s0"])
    marker = json.loads((out / "_cells" / "standard.s0.json").read_text())
    starts = [json.loads(x) for x in (out / "_cells" / "standard.s0.starts.jsonl").read_text().splitlines()]
    head = starts[0]["commit"]
    assert len(starts) == 1 and marker["commits"] == [head] and (head is None or len(head) == 40)
    numerics = marker["numerics"]
    assert len(numerics["fingerprint"]) == 12 and numerics["versions"]["torch"].startswith("2.")


def test_dry_run_lists_the_waiting_cells(tmp_path: Path):
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        pass

    register(app)
    res = CliRunner().invoke(app, ["sweep", str(_write(tmp_path)), "--out", str(tmp_path / "s"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "sweep decisive: 9 cell(s)" in res.output
    assert "strongest.s0" in res.output and "waiting   for its pilot's choice" in res.output
    assert "pilot-strongest.icepop.s101" in res.output


def test_the_regime_sweep_fixes_its_rule_before_the_seeds_and_varies_only_what_it_compares():
    from flows.sweep.spec import waiting_cell_ids

    path = Path(__file__).resolve().parents[3] / "configs" / "sweeps" / "regime-seeds.yaml"
    spec, cells = load_sweep(path)
    preset = load_config(Path(__file__).resolve().parents[3] / "configs" / "regime-tiny-cpu.yaml")
    pilot = [c for c in cells if c.pilot]
    assert spec.choose["strongest"].rule == "best-second-half-eval" and len(pilot) == 12
    assert {c.config.algorithm.correction.mode for c in pilot} == {
        "token-tis", "seq-tis", "token-mis", "seq-mis", "icepop", "geo-mask"
    }  # fmt: skip
    # + the 2-seed screen of eight settings, seeds 2-6 of the three it chose (oracle, old-together, blockwise),
    # and fresh seeds 7-13 of bf16, fp8-standard and the oracle, the one that closed the gap on seeds 0-6
    assert len(waiting_cell_ids(spec, {})) == 14 and len(cells) == 12 + 21 + 8 * 2 + 3 * 5 + 3 * 7
    for c in cells:
        same = c.config.model_copy(
            update={"seed": preset.seed, "precision": preset.precision, "calibration": preset.calibration,
                    "algorithm": preset.algorithm}
        )  # fmt: skip
        assert same == preset, c.id  # model, task, bootstrap, steps, rollout, evaluation: the preset's
        batching = preset.algorithm.old_logp_micro_batch_size  # the screen also varies how pi_old is batched
        same = {"correction": preset.algorithm.correction, "old_logp_micro_batch_size": batching}
        assert c.config.algorithm.model_copy(update=same) == preset.algorithm


def test_a_choice_that_falls_on_what_a_setting_does_already_is_not_run_twice(tmp_path: Path):
    """The pilot picks token TIS, which the standard cells use already: ``strongest.s0`` is then the very
    config of ``standard.s0``. It is a twin: not run again, its marker names the run it reads, and the
    table gives it that run's figures."""
    from flows.sweep.state import cell_state, twins
    from flows.sweep.table import comparison_table

    out, path = tmp_path / "s", _write(tmp_path)
    SCORE["token-tis"] = 0.5
    try:
        fake, lines = ScoringFake(), []
        run_sweep_file(path, out, campaign=fake, report=False, echo=lines.append)
    finally:
        SCORE["token-tis"] = 0.0
    assert json.loads(choice_path(out, "strongest").read_text())["winner"] == "token-tis"
    spec, cells = load_sweep(path, out)
    by_id = {c.id: c for c in cells}
    assert twins(cells) == {"strongest.s0": "standard.s0"}
    assert [c for c, _ in fake.calls][len(PILOT):] == ["standard.s0", "calibrated-strongest.s0"]
    assert "strongest.s0: the same config as standard.s0, which has run it: not run again" in "\n".join(lines)
    assert not (out / "strongest.s0").exists() and cell_state(out, by_id["strongest.s0"]) == "finished"
    marker = json.loads((out / "_cells" / "strongest.s0.json").read_text())
    assert marker["same_as"] == "standard.s0" and marker["commits"]
    rows = {r["cell"]: r for r in comparison_table(out, spec, [c for c in cells if not c.pilot])}
    same = {k: v for k, v in rows["strongest.s0"].items() if k not in ("cell", "setting")}
    assert same == {k: v for k, v in rows["standard.s0"].items() if k not in ("cell", "setting")}
    assert rows["strongest.s0"]["status"] == "finished" and rows["strongest.s0"].get("best_eval_average") is not None

    again = ScoringFake()  # a re-run finds every cell finished
    run_sweep_file(path, out, campaign=again, report=False, echo=lambda _l: None)
    assert again.calls == []


def test_a_twin_whose_counterpart_failed_runs_itself(tmp_path: Path):
    out, path = tmp_path / "s", _write(tmp_path)
    SCORE["token-tis"] = 0.5
    try:
        fake, lines = ScoringFake(fail_in="standard.s0"), []
        run_sweep_file(path, out, campaign=fake, report=False, echo=lines.append)
    finally:
        SCORE["token-tis"] = 0.0
    assert [c for c, _ in fake.calls][len(PILOT):] == ["standard.s0", "strongest.s0", "calibrated-strongest.s0"]
    assert "[2/3] strongest.s0: starting" in lines and (out / "strongest.s0").is_dir()
    assert "same_as" not in json.loads((out / "_cells" / "strongest.s0.json").read_text())


def _parts(reason: str, cpu: str, kernels: str, *, kind: str = "portable", threads: int = 2) -> dict:
    """The numerics parts a cell's marker records (``run.json``'s), as two CPUs wrote them on 2026-12-07."""
    return {
        "cpu_numerics": {
            "bf16_gemm": {"setting": "auto", "kind": kind, "reason": reason},
            "exact_gemm_kernels": kernels, "cpu": cpu, "torch": "2.13.0+cpu", "aten_cpu_capability": "AVX2",
            "env": {"ATEN_CPU_CAPABILITY": "avx2"}, "threads": threads,
        },
        "layer_precision": {
            "mode": "fp8_tensorwise", "backend": "fp8rl-emulated", "fp8_linears": 14,
            "compile": {"setting": "auto", "enabled": False, "reason": "cpu: eager is the default off CUDA"},
        },
        "versions": {"torch": "2.13.0+cpu", "transformers": "5.25.0", "torchao": "0.18.0"},
    }  # fmt: skip


def test_the_numerics_fingerprint_is_the_same_on_two_cpus_for_the_portable_gemms_and_differs_where_bits_can():
    """One config's cells ran on an AVX512-BF16 CPU and on an AVX2-only one with the same portable numbers,
    but the auto choice's reason named each CPU's instructions: the fingerprints must still agree."""
    from flows.sweep.runner import fingerprint_of

    zen4 = _parts("AVX512-BF16, but hidden size 128 < 256: the CPU-independent exact GEMMs", "AMD EPYC", "compiled")
    zen3 = _parts("no AMX-BF16/AVX512-BF16: the CPU-independent exact GEMMs", "AMD EPYC", "compiled")
    xeon = _parts("AMX-BF16, but hidden size 128 < 256: the CPU-independent exact GEMMs", "Intel Xeon", "tensor path")
    assert fingerprint_of(zen4) == fingerprint_of(zen3) == fingerprint_of(xeon)
    # what changes bits still changes the fingerprint: the thread count, the GEMM kind, and for a CPU-chosen
    # kind the CPU itself
    assert fingerprint_of(_parts("x", "AMD EPYC", "compiled", threads=1)) != fingerprint_of(zen3)
    native_amd = _parts("AVX512-BF16", "AMD EPYC", "compiled", kind="native")
    native_intel = _parts("AVX512-BF16", "Intel Xeon", "compiled", kind="native")
    assert len({fingerprint_of(native_amd), fingerprint_of(native_intel), fingerprint_of(zen3)}) == 3


def test_two_runs_of_one_config_on_two_cpus_share_the_fingerprint_their_markers_record(tmp_path: Path):
    """Through the marker's own path: ``run.json`` as each CPU wrote it, read by ``numerics_fingerprint``."""
    from flows.sweep.runner import numerics_fingerprint
    from storage.run.layout import RUN_FILE

    prints = []
    for name, reason in (("zen4", "AVX512-BF16, but hidden size 128 < 256"), ("zen3", "no AMX-BF16/AVX512-BF16")):
        parts = _parts(reason, "AMD EPYC", "compiled")
        (tmp_path / name).mkdir()
        (tmp_path / name / RUN_FILE).write_text(json.dumps({k: parts[k] for k in ("cpu_numerics", "layer_precision")}))
        prints.append(numerics_fingerprint(tmp_path / name))
    assert prints[0]["fingerprint"] == prints[1]["fingerprint"]
    assert prints[0]["cpu_numerics"]["bf16_gemm"]["reason"] != prints[1]["cpu_numerics"]["bf16_gemm"]["reason"]
