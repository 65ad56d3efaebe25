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
| a model far too large for the machine            | one line, exit 2, no run folder            |
| torch.save's short write (a full disk)           | one line naming the path, exit 2           |
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import micro_config
from integrity_helpers import cli, mount_tmpfs, one_line_exit_2, run_with_rows

from storage.ledger.events import Ledger


@pytest.fixture
def no_flow(monkeypatch):
    """Resume up to the campaign flow, which is replaced: what resume checks and sets aside is the point."""
    import flows.commands.run as cc

    calls = []
    monkeypatch.setattr(cc, "_run_flow", lambda run_dir, resume, **kw: calls.append(run_dir) or {})
    return calls


@pytest.fixture
def read_only_mount(tmp_path: Path):
    """A read-only tmpfs (skips where the test cannot mount: not root, a container)."""
    import os
    import subprocess

    where = tmp_path / "ro"
    if os.geteuid() != 0 or not mount_tmpfs(where, "1m", "ro"):
        pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


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


# --------------------------------------------------------------------------- 4. writes never touch a run's files


def _live_part(run: Path, table: str, step: int) -> Path:
    return sorted((run / "tables" / table).rglob(f"step={step}/*.parquet"))[-1]


def test_query_out_refuses_every_path_inside_a_run(tmp_path: Path) -> None:
    run = run_with_rows(tmp_path / "runs", "A")
    part = _live_part(run, "steps", 2)
    link = tmp_path / "elsewhere"
    link.symlink_to(run / "tables")
    for out in [run / "run.json", part, link / "steps" / "x.csv", tmp_path / "runs" / "A" / "new.parquet"]:
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
        one_line_exit_2(cli("query", run, "SELECT 9 AS reward_mean", "--out", out), "inside the run directory")
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    r = cli("query", run, "SELECT step, reward_mean FROM steps ORDER BY step", "--out", tmp_path / "ok.csv")
    assert r.exit_code == 0 and (tmp_path / "ok.csv").read_text().count("\n") == 3, r.stderr


def test_report_out_refuses_a_run_folder_but_keeps_its_own(tmp_path: Path) -> None:
    from flows.commands.common import refuse_run_paths

    run = run_with_rows(tmp_path / "runs", "A")
    one_line_exit_2(cli("report", run, "--out", run / "tables"), "inside the run directory")
    refuse_run_paths(run / "report", own="report")  # the default place of a one-run report: no refusal


def test_query_out_on_a_read_only_file_system_is_one_line(tmp_path: Path, read_only_mount: Path) -> None:
    run = run_with_rows(tmp_path / "runs", "A")
    ro = read_only_mount
    one_line_exit_2(cli("query", run, "SELECT 1 AS x", "--out", ro / "x.parquet"), "read-only", str(ro))


def test_links_and_foreign_parts_are_skipped_by_query_with_a_warning(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from storage.run.layout import part_name

    run = run_with_rows(tmp_path / "runs", "A")
    other = run_with_rows(tmp_path / "other", "B")
    step2 = _live_part(run, "steps", 2).parent
    link1 = step2 / part_name("train", 1, "main").filename
    link1.symlink_to("/etc/passwd")  # a link out of the run: the sandbox would refuse every query of the run
    link2 = run / "tables" / "steps" / "run=A" / "step=1" / part_name("train", 1, "main").filename
    link2.symlink_to(_live_part(other, "steps", 1))
    forged = run / "tables" / "rollouts" / "run=A" / "step=2" / part_name("rollout", 1, "main").filename
    pq.write_table(pq.read_table(_live_part(run, "rollouts", 2)).replace_schema_metadata(None), forged)
    r = cli("query", run, "SELECT step, reward_mean FROM steps ORDER BY step", "--format", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines()[1:] == ["1,0.1", "2,0.2"], r.stdout + r.stderr
    assert f"warning: {link1}: a link" in r.stderr and f"warning: {link2}: a link" in r.stderr, r.stderr
    assert f"warning: {forged}: part without its run's uid" in r.stderr, r.stderr
    r = cli("doctor", run)
    assert r.exit_code == 1 and "carries no run uid" in r.stderr and f"{link1}: a link" in r.stdout, r.stdout


# --------------------------------------------------------------------------- 2. one run identity


def test_a_part_of_another_run_with_the_same_folder_name_is_skipped_by_uid(tmp_path: Path) -> None:
    from storage.run.layout import part_name

    a = run_with_rows(tmp_path / "A", "base")
    b = run_with_rows(tmp_path / "B", "base")
    theirs = _live_part(b, "steps", 2)
    dest = a / "tables" / "steps" / "run=base" / "step=2" / part_name("train", 1, "main").filename
    dest.write_bytes(theirs.read_bytes())  # a name the writer would use, and newer than A's own
    r = cli("query", a, "SELECT step, reward_mean FROM steps ORDER BY step", "--format", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines()[1:] == ["1,0.1", "2,0.2"], r.stdout + r.stderr
    assert f"warning: {dest}: part of another run (uid" in r.stderr, r.stderr
    r = cli("doctor", a)
    assert r.exit_code == 1 and "written by another run" in r.stderr, r.stdout + r.stderr


def test_the_uid_survives_a_copy_and_a_run_without_one_opens_with_one_warning(tmp_path: Path) -> None:
    import shutil

    a = run_with_rows(tmp_path / "A", "base")
    uid = json.loads((a / "run.json").read_text())["uid"]
    copy = tmp_path / "C" / "renamed"
    shutil.copytree(a, copy)
    assert json.loads((copy / "run.json").read_text())["uid"] == uid
    r = cli("query", copy, "SELECT count(*) AS n FROM steps", "--format", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines()[1:] == ["2"] and r.stderr == "", r.stdout + r.stderr
    old = run_with_rows(tmp_path / "old", "before")  # as written before uids: neither run.json nor parts carry one
    info = json.loads((old / "run.json").read_text())
    (old / "run.json").write_text(json.dumps({k: v for k, v in info.items() if k not in ("uid", "config")}))
    r = cli("query", old, "SELECT count(*) AS n FROM steps", "--format", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines()[1:] == ["2"], r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and "written before runs carried a uid" in r.stderr, r.stderr
    r = cli("doctor", old)
    assert r.exit_code == 0 and "1 warning" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------- 6. the ledger has one reading


def _damage_line(run: Path, index: int, new: bytes) -> int:
    """Replace ledger line ``index`` (0-based) with ``new``; returns its 1-based number."""
    lines = (run / "ledger.jsonl").read_bytes().split(b"\n")
    lines[index] = new
    (run / "ledger.jsonl").write_bytes(b"\n".join(lines))
    return index + 1


def test_a_damaged_ledger_line_in_the_middle_gets_one_verdict_everywhere(micro_run: Path, no_flow) -> None:
    # line 4 is the finish of step 1's train: damaged, query would show train as running and resume redo it
    n = _damage_line(micro_run, 3, b'{"event":"finish",\x00\x00 garbage}')
    where = f"{micro_run / 'ledger.jsonl'}:{n}"
    r = cli("doctor", micro_run)
    assert r.exit_code == 1 and f"error: {where}: unparseable record" in r.stderr, r.stdout + r.stderr
    r = cli("query", micro_run, "SELECT step, stage, status FROM ledger ORDER BY step, stage", "--format", "csv")
    assert r.exit_code == 0 and f"warning: {where}: unparseable record" in r.stderr, r.stdout + r.stderr
    one_line_exit_2(cli("resume", micro_run), where, "unparseable record", "restore the line")
    assert no_flow == []


def test_a_torn_last_record_is_harmless_to_all_three(micro_run: Path, no_flow) -> None:
    with open(micro_run / "ledger.jsonl", "ab") as f:
        f.write(b'{"event":"start","run_id":"micro","st')  # a crash while appending
    r = cli("doctor", micro_run)
    assert r.exit_code == 0 and "torn last record" in r.stdout, r.stdout + r.stderr
    r = cli("query", micro_run, "SELECT count(*) AS n FROM ledger", "--format", "csv")
    assert r.exit_code == 0 and r.stderr == "", r.stderr
    r = cli("resume", micro_run)
    assert r.exit_code == 0 and no_flow == [micro_run], r.stderr


# --------------------------------------------------------------------------- disk full, as torch reports it


def test_a_short_write_reported_by_torch_save_is_one_line_even_once_space_is_free(tmp_path: Path, capsys) -> None:
    import typer

    from flows.commands.common import io_errors

    run = run_with_rows(tmp_path / "runs", "A")
    with pytest.raises(typer.Exit) as exc, io_errors(run, resume_hint=run):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4480 vs 4374")
    assert exc.value.exit_code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no space left on device" in err and f"fp8rl resume {run}" in err, err


def test_a_model_far_too_large_for_the_machine_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    big = ["model.hidden_size=16384", "model.intermediate_size=65536", "model.num_layers=12", "device=cpu"]
    args = [a for s in big for a in ("--set", s)]
    one_line_exit_2(cli("run", "tiny-cpu", *args, "--run-dir", tmp_path / "run"), "GiB per rank", "--skip-memory-check")
    assert not (tmp_path / "run").exists()
    from flows.commands.run import check_memory_fit

    check_memory_fit(micro_config(), 1)  # the tiny model fits anywhere
