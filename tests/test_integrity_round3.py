"""Nothing silently wrong, round three: the fault-and-input matrix, one test per finding.

Each test fails on the code before its fix. Runs are made with the storage API
(no campaign); the CLI runs in-process (typer's runner), with the campaign flow
replaced where only what resume does before it matters.

| fault or input                                   | expected                                   |
|--------------------------------------------------|--------------------------------------------|
| config.yaml edited before resume                 | one line naming the keys, exit 2           |
| ... taken with --accept-config-change            | recorded in run.json, ledger, doctor, query |
| resume --step / --from the run does not have     | one line, exit 2, nothing set aside        |
| duplicate YAML keys, anchors, unknown tags       | one line, exit 2                           |
| values `config` accepts that `run` cannot run    | one line, exit 2, no run folder            |
| query/report --out into a run folder             | one line, exit 2, nothing written          |
| a link or a foreign part under a run             | skipped with a warning, rest queryable     |
| a part of another run with the same folder name  | skipped by uid                             |
| a damaged ledger line in the middle              | the same verdict from doctor/query/resume  |
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import micro_config
from test_integrity import _run_with_rows, cli, one_line_exit_2

from flows.configuration import dump_config
from storage.ledger import Ledger


@pytest.fixture
def micro_run(tmp_path: Path) -> Path:
    return _run_with_rows(tmp_path / "runs", "micro", config=dump_config(micro_config()))


@pytest.fixture
def no_flow(monkeypatch):
    """Resume up to the campaign flow, which is replaced: what resume checks and sets aside is the point."""
    import flows.cli_campaign as cc

    calls = []
    monkeypatch.setattr(cc, "_run_flow", lambda run_dir, resume, **kw: calls.append(run_dir) or {})
    return calls


def _edit_config(run: Path, old: str, new: str) -> None:
    p = run / "config.yaml"
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))


# --------------------------------------------------------------------------- 1. a resumed run is the run it claims


def test_an_edited_config_is_refused_at_resume_naming_the_key(micro_run: Path, no_flow) -> None:
    _edit_config(micro_run, "max_delta: 0.05", "max_delta: 0.1")
    one_line_exit_2(cli("resume", micro_run), "calibration.max_delta (0.05 -> 0.1)", "--accept-config-change")
    assert no_flow == []
    r = cli("doctor", micro_run)
    assert r.exit_code == 1 and "calibration.max_delta" in r.stderr, r.stderr


def test_a_config_rewritten_with_the_same_values_resumes(micro_run: Path, no_flow) -> None:
    import yaml

    p = micro_run / "config.yaml"
    p.write_text("# reformatted\n" + yaml.safe_dump(yaml.safe_load(p.read_text()), sort_keys=True))
    r = cli("resume", micro_run)
    assert r.exit_code == 0, r.stderr
    assert no_flow == [micro_run]


def test_an_accepted_config_change_is_recorded_where_doctor_and_query_see_it(micro_run: Path, no_flow) -> None:
    _edit_config(micro_run, "max_delta: 0.05", "max_delta: 0.1")
    r = cli("resume", micro_run, "--accept-config-change")
    assert r.exit_code == 0, r.stderr
    assert "calibration.max_delta (0.05 -> 0.1)" in r.stderr
    change = json.loads((micro_run / "run.json").read_text())["config_changes"][0]
    assert change["keys"] == ["calibration.max_delta (0.05 -> 0.1)"] and change["after_step"] == 2
    assert Ledger(micro_run).config_changes()[0]["keys"] == change["keys"]
    r = cli("doctor", micro_run)
    assert r.exit_code == 0 and "config changed at a resume after step 2" in r.stdout, r.stdout + r.stderr
    r = cli("query", micro_run, "SELECT config_changes FROM runs", "--format", "json")
    assert r.exit_code == 0 and "calibration.max_delta" in r.stdout, r.stdout + r.stderr
    r = cli("resume", micro_run)  # the change is now the run's config: a plain resume goes on
    assert r.exit_code == 0, r.stderr
    _edit_config(micro_run, "max_delta: 0.1", "max_delta: 0.2")  # and a second edit is refused again
    one_line_exit_2(cli("resume", micro_run), "calibration.max_delta (0.1 -> 0.2)")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--from", "train", "--step", "-1"], "the run has steps 0 to 3"),
        (["--from", "train", "--step", "99"], "the run has steps 0 to 3"),
        (["--from", "calibrate", "--step", "1"], "no calibrate at step 1 (recorded there: rollout, train)"),
        (["--from", "rollout", "--step", "3"], "no rollout at step 3 (recorded there: nothing yet)"),
    ],
)
def test_resume_arguments_the_run_does_not_have_are_refused_before_anything_is_set_aside(
    micro_run: Path, no_flow, args: list[str], needle: str
) -> None:
    before = (micro_run / "ledger.jsonl").read_bytes()
    one_line_exit_2(cli("resume", micro_run, *args), needle)
    assert not (micro_run / "superseded").exists() and no_flow == []
    assert (micro_run / "ledger.jsonl").read_bytes() == before


def test_resume_from_a_recorded_stage_still_sets_aside(micro_run: Path, no_flow) -> None:
    r = cli("resume", micro_run, "--from", "train", "--step", "2")
    assert r.exit_code == 0, r.stderr
    assert "set aside 1 table file(s)" in r.stdout and no_flow == [micro_run]
