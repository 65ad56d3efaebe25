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


# --------------------------------------------------------------------------- 3. configs mean one thing


def _yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text, needle",
    [
        ("steps: 3\nsteps: 5\n", "key 'steps' appears twice in one mapping (first on line 1)"),
        (
            "rollout:\n  prompts_per_step: 16\nsteps: 3\nrollout:\n  max_new_tokens: 8\n",
            "line 4: key 'rollout' appears twice",
        ),
        ("a: &x [1, 2]\nb: *x\n", "anchors and aliases are not allowed"),
        # the shape of a few lines that expand to 10^9 strings (here 10^4): refused at the first anchor
        (
            'a: &a ["x","x","x","x","x","x","x","x","x","x"]\n'
            + "".join(f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abc", "bcd")),
            "anchors and aliases are not allowed",
        ),
        ("steps: !!float 3\n", "explicit YAML tags are not allowed"),
        ("steps: !custom 3\n", "explicit YAML tags are not allowed"),
        ("<<: {steps: 3}\n", "merge key <<"),
        ("calibration:\n  interval: 1:30\n", "calibration.interval"),
    ],
)
def test_yaml_that_resolves_silently_is_refused_in_one_line(tmp_path: Path, text: str, needle: str) -> None:
    cfg = _yaml(tmp_path, text)
    one_line_exit_2(cli("config", cfg), needle, str(cfg))
    one_line_exit_2(cli("run", cfg, "--run-dir", tmp_path / "run"), needle)
    assert not (tmp_path / "run").exists()


def test_set_values_are_read_the_same_way() -> None:
    one_line_exit_2(cli("config", "--set", "evaluation.benchmarks=[&a {name: synthetic}, *a]"), "anchor")
    r = cli("config", "--set", "seed=010")  # YAML 1.1 would read 8
    assert r.exit_code == 0 and "seed: 10\n" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["model.hidden_size=1000000000000000000"], "model.hidden_size"),
        (["algorithm.betas=[2,3]"], "AdamW betas must each be in [0, 1)"),
        (["device=gpu"], "expected auto, cpu, cuda or cuda:N"),
        (["name=" + "n" * 230], "name: String should have at most 200 characters"),
    ],
)
def test_values_config_accepted_but_run_could_not_run_are_refused_by_both(tmp_path: Path, sets, needle) -> None:
    args = [a for s in sets for a in ("--set", s)]
    one_line_exit_2(cli("config", *args), needle)
    one_line_exit_2(cli("run", "tiny-cpu", *args, "--run-dir", tmp_path / "run"), needle)
    assert not (tmp_path / "run").exists()


def test_a_cuda_device_the_machine_lacks_is_refused_before_the_run_folder(tmp_path: Path) -> None:
    import torch

    device = f"cuda:{torch.cuda.device_count()}"  # one past the last device (cuda:0 on a machine without CUDA)
    one_line_exit_2(cli("run", "tiny-cpu", "--set", f"device={device}", "--run-dir", tmp_path / "run"), device)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "name, needle", [("r" * 252, "this file system holds names of at most"), ("a b", "is the run id")]
)
def test_a_run_directory_the_file_system_cannot_hold_is_refused_before_anything_is_written(
    tmp_path: Path, name: str, needle: str
) -> None:
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", tmp_path / name), needle)
    assert list(tmp_path.iterdir()) == []
