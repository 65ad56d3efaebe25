"""Bad input and failing storage are one clear line and lose nothing.

A full disk, a read-only mount, a run directory under a file, a config the ranks cannot train,
values that are not numbers: each ends with exit status 2 and one line naming what to fix, before
anything is written. Everything runs in-process (typer's runner) or on a small tmpfs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import micro_config
from integrity_helpers import cli, mount_tmpfs, one_line_exit_2
from typer.testing import CliRunner

from flows.cli import app
from storage.checkpoints.store import CheckpointState, save_checkpoint
from storage.parts.writer import TableWriter
from storage.queries.catalog import connect, query
from storage.run.layout import create_run

ROOT = Path(__file__).resolve().parents[3]
# --------------------------------------------------------------------------- I/O failures are one line


@pytest.fixture
def mount(tmp_path: Path):
    """mount(size, *opts) -> a fresh tmpfs (skips where the test cannot mount: not root, a container)."""
    mounted: list[Path] = []

    def make(size: str = "4m", *opts: str) -> Path:
        where = tmp_path / f"mnt{len(mounted)}"
        if os.geteuid() != 0 or not mount_tmpfs(where, size, *opts):
            pytest.skip("cannot mount a tmpfs here (needs root and mount rights)")
        mounted.append(where)
        return where

    yield make
    for m in reversed(mounted):
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def test_disk_full_is_one_line_naming_the_path_and_no_space_left(mount) -> None:
    import typer

    from flows.commands.common import io_errors

    m = mount("256k")
    run = create_run(m, "A").root
    w = TableWriter(run, durable=False)
    with pytest.raises(typer.Exit) as exc, io_errors(run, resume_hint=run):
        for s in range(1, 100):
            w.write(
                "rollouts",
                s,
                {
                    "sample_id": np.arange(20000),
                    "prompt_id": np.arange(20000),
                    "response": [os.urandom(8).hex() for _ in range(20000)],
                },
                stage="rollout",
            )
    assert exc.value.exit_code == 2
    assert not list(run.joinpath("tmp").iterdir())  # no half-written file left
    # the live files all read: nothing torn
    assert query(connect(run), "SELECT count(*) AS n FROM rollouts").to_pylist()[0]["n"] % 20000 == 0


def test_disk_full_message(mount, capsys) -> None:
    import typer

    from flows.commands.common import io_errors

    m = mount("64k")
    run = create_run(m, "A").root
    with pytest.raises(typer.Exit), io_errors(run, resume_hint=run):
        (run / "big").write_bytes(b"x" * 200_000)
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no space left on device" in err and str(run) in err
    assert f"fp8rl resume {run}" in err and len(err.splitlines()) == 1


def test_torch_save_on_a_full_disk_says_no_space_left(mount, capsys) -> None:
    """torch reports ENOSPC as 'enforce fail at inline_container.cc'; the CLI says what it is."""
    import torch
    import typer

    from flows.commands.common import io_errors

    m = mount("64k")
    with pytest.raises(typer.Exit), io_errors(m):
        torch.save(torch.zeros(100_000), m / "x.pt")
    err = capsys.readouterr().err.strip()
    assert "no space left on device" in err and len(err.splitlines()) == 1, err


def test_run_dir_on_a_read_only_mount(mount) -> None:
    m = mount("1m", "ro")
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", m / "r", "--set", "steps=1"), "read-only file system")


def test_resume_of_a_run_on_read_only_storage(mount, micro_run: Path) -> None:
    m = mount("8m")
    shutil.copytree(micro_run, m / "run")
    subprocess.run(["mount", "-o", "remount,ro", str(m)], check=True)
    one_line_exit_2(cli("resume", m / "run"), "read-only file system")


def test_run_dir_under_a_file_or_under_proc(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", f / "sub" / "r"), str(f), "is a file")
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", "/proc/fp8rl-test"), "/proc")


def test_rerun_variant_main_or_a_path_is_refused(micro_run: Path) -> None:
    one_line_exit_2(cli("rerun", micro_run, "--stage", "score", "--steps", "1:2", "--variant", "main"), "'main'")
    one_line_exit_2(
        cli("rerun", micro_run, "--stage", "score", "--steps", "1:2", "--variant", "../../evil"), "../../evil"
    )
    assert not (micro_run.parent.parent / "evil").exists()


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("value", ["true", "yes", "false"])
def test_a_boolean_is_not_a_number(value: str) -> None:
    one_line_exit_2(cli("config", "tiny-cpu", "--set", f"steps={value}"), "steps", "boolean")


def test_an_empty_config_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty.yaml").write_text("\n# nothing\n")
    one_line_exit_2(cli("config", tmp_path / "empty.yaml"), "empty")


def test_rerun_steps_must_be_a_range(micro_run: Path) -> None:
    one_line_exit_2(cli("rerun", micro_run, "--stage", "score", "--steps", "9:2"), "9:2")


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["algorithm.ppo_epochs=2", "algorithm.micro_batch_size=128"], "ppo_epochs=2 is not supported on 2 ranks"),
        (["algorithm.ppo_mini_batch_size=256", "algorithm.micro_batch_size=256"], "must be a multiple of world size 2"),
    ],
)
def test_a_config_the_ranks_cannot_train_is_refused_before_launch(tmp_path: Path, sets: list[str], needle: str) -> None:
    """Several PPO epochs on several ranks used to train on rows without their π_old (a silent wrong
    row); a mini-batch that does not split over the ranks failed only inside the train stage."""
    args = [x for s in sets for x in ("--set", s)]
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", tmp_path / "r", "--nproc-per-node", "2", *args), needle)
    assert not (tmp_path / "r").exists()  # nothing written


def test_run_dir_that_holds_other_files_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "photos"
    d.mkdir()
    (d / "holiday.jpg").write_bytes(b"\xff\xd8")
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", d), "not empty")
    assert sorted(p.name for p in d.iterdir()) == ["holiday.jpg"]


def test_a_run_name_cannot_leave_the_runs_root(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "runs"
    one_line_exit_2(cli("run", "tiny-cpu", "--set", "name=../../etc", "--set", f"storage.runs_root={root}"), "name")
    assert not (tmp_path / "a" / "etc").exists() and not list(tmp_path.rglob("run.json"))


# --------------------------------------------------------------------------- the CLI, caches, checkpoints, queries


def test_usage_errors_are_one_line() -> None:
    for args in (
        ["run", "--bogus"],
        ["nosuch"],
        ["resume", "x", "--from", "nowhere"],
        ["query", "x", "SELECT 1", "--format", "xml"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert r.stderr.startswith("error: ") and "--help" in r.stderr


def test_choices_are_listed_in_help() -> None:
    import re

    def text(*args: str) -> str:
        return re.sub(r"\s", "", CliRunner().invoke(app, list(args), env={"COLUMNS": "250"}).stdout)

    assert "rollout|score|train|calibrate|evaluate|checkpoint" in text("resume", "--help")
    assert "table|csv|json" in text("query", "--help")
    assert "score|calibrate|evaluate" in text("rerun", "--help")


def test_bootstrap_cache_is_per_user_not_beside_the_run(tmp_path: Path, monkeypatch) -> None:
    import stages.bootstrap.math as boot
    from stages.context import base_model_dir

    seen = {}
    monkeypatch.delenv("FP8RL_BOOTSTRAP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(
        boot,
        "bootstrap",
        lambda *a, **k: (
            seen.setdefault("cache", a[3] if len(a) > 3 else k.get("cache_root")) or boot.default_cache_root()
        ),
    )
    base_model_dir(micro_config(), tmp_path / "elsewhere")
    assert (seen["cache"] or boot.default_cache_root()) == tmp_path / "cache" / "fp8rl" / "bootstrap"


def test_resume_says_when_it_passes_over_a_broken_checkpoint(micro_run: Path, monkeypatch) -> None:
    import flows.commands.run as cc

    save_checkpoint(micro_run, 2, rng_state=False, state=CheckpointState(metrics={}))
    save_checkpoint(micro_run, 4, rng_state=False, state=CheckpointState(metrics={}))
    (micro_run / "checkpoints" / "step_4" / "state.json").write_text("{}")  # damaged
    monkeypatch.setattr(cc, "_run_flow", lambda run_dir, resume, **kw: {})
    r = cli("resume", micro_run)
    assert r.exit_code == 0, r.stderr
    assert "step_4" in r.stderr and "restarts from step_2" in r.stderr


# --------------------------------------------------------------------------- one error path


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["algorithm.lr=.inf"], "algorithm.lr: Input should be a finite number"),
        (["algorithm.eps_high=nan"], "algorithm.eps_high: Input should be a finite number"),
        (["calibration.initial_lower=1.5", "calibration.initial_upper=1.2"], "0 < lower <= upper"),
    ],
)
def test_non_finite_and_inverted_values_are_refused_before_anything_is_written(tmp_path: Path, sets, needle) -> None:
    d = tmp_path / "run"
    args = [x for s in sets for x in ("--set", s)]
    one_line_exit_2(cli("run", "tiny-cpu", "--run-dir", d, *args), needle)
    assert not d.exists()


@pytest.mark.parametrize("text", ["{}\n", "# nothing\n{}\n"])
def test_a_config_with_no_settings_is_refused_like_an_empty_one(tmp_path: Path, text: str) -> None:
    (tmp_path / "c.yaml").write_text(text)
    one_line_exit_2(cli("run", tmp_path / "c.yaml", "--run-dir", tmp_path / "run"), "empty")
    assert not (tmp_path / "run").exists()


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_bytes(b"steps: 3\nname: caf\xe9\n")
    one_line_exit_2(cli("config", tmp_path / "c.yaml"), "not UTF-8")


def test_report_out_below_a_file_is_one_line(micro_run: Path, tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    one_line_exit_2(cli("report", micro_run, "--out", tmp_path / "afile" / "report"), str(tmp_path / "afile"))
