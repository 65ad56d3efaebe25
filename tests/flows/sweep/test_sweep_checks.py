"""What a sweep reads instead of running is checked every time it opens, and a sweep keeps the run's
protections (``flows.sweep.state``, ``flows.sweep.choice.check_record``, ``flows.sweep.lock``).

Each case builds the sweep directory by hand (run folders made by the storage API, markers and choice
records written as the sweep writes them) and opens it with ``fp8rl sweep --dry-run``, or runs the
command in-process with the flow replaced by the fake campaign of ``tests/flows/sweep/test_sweep.py``: a refusal
is one line and exit 2, and nothing runs. The signals case is a real ``fp8rl sweep`` process whose
first cell is a micro campaign, held at a known point and then sent the signal.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import MICRO_OVERRIDES, CliProcess, kill_session
from integrity_helpers import cli, one_line_exit_2

from flows.campaign.configuration import ConfigError, dump_config, load_config
from flows.sweep.spec import CELLS_DIR, load_sweep
from storage.run.layout import config_hash, create_run, read_run_info

# 'again' gives the config of 'standard': a twin, read from standard.s0's run and not run again
TWINS = """\
name: twins
base: tiny-cpu
overrides: {steps: 3, calibration.interval: 2, evaluation: {interval: 2}}
axes:
  clip:
    standard: {calibration.mode: standard}
    again: {calibration.mode: standard}
    calibrated: {calibration.mode: calibrated}
seeds: [0]
"""

CHOICE = """\
name: chosen
base: tiny-cpu
overrides: {steps: 3, calibration.interval: 2, evaluation: {interval: 2}, algorithm.tis: true}
choose:
  strongest:
    rule: best-second-half-eval
    seeds: [100]
    candidates:
      token-tis: {algorithm.correction.mode: token-tis}
      icepop: {algorithm.correction.mode: icepop}
axes:
  setting:
    strongest: {choose: strongest}
seeds: [0]
"""


def _sweep(tmp_path: Path, text: str) -> tuple[Path, Path]:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path, tmp_path / "out"


def _cells(path: Path, out: Path | None = None) -> dict:
    return {c.id: c for c in load_sweep(path, out)[1]}


def _finished(out: Path, cell) -> Path:
    """The cell's run folder and its marker, as a finished cell leaves them (no tables: a marker is trusted)."""
    run = create_run(out, cell.id, config=cell.config_text).root
    _marker(out, cell.id, config_hash(cell.config_text))
    return run


def _marker(out: Path, cell_id: str, hash_: str, **fields) -> None:
    (out / CELLS_DIR).mkdir(parents=True, exist_ok=True)
    body = {"cell": cell_id, "seconds": 0.0, "config_hash": hash_, **fields, "finished_at": "2026-12-06T00:00:00+00:00"}
    (out / CELLS_DIR / f"{cell_id}.json").write_text(json.dumps(body))


def _dry_run(path: Path, out: Path, *extra):
    return cli("sweep", path, "--out", out, "--dry-run", *extra)


def _twin_sweep(tmp_path: Path) -> tuple[Path, Path, dict]:
    """standard.s0 finished; again.s0, its twin, reads its run."""
    path, out = _sweep(tmp_path, TWINS)
    cells = _cells(path)
    _finished(out, cells["standard.s0"])
    _marker(out, "again.s0", config_hash(cells["again.s0"].config_text), same_as="standard.s0")
    res = _dry_run(path, out)
    assert res.exit_code == 0 and "again.s0" in res.stdout and "finished" in res.stdout, res.output
    return path, out, cells


def test_a_twin_whose_config_changed_in_the_sweep_file_is_refused(tmp_path: Path) -> None:
    path, out, _ = _twin_sweep(tmp_path)
    path.write_text(
        TWINS.replace("again: {calibration.mode: standard}", "again: {calibration.mode: standard, steps: 4}")
    )
    one_line_exit_2(
        _dry_run(path, out), "cell again.s0:", "reads run standard.s0", "another config", "delete the marker"
    )


def test_a_twin_whose_marker_names_another_cell_is_refused(tmp_path: Path) -> None:
    path, out, cells = _twin_sweep(tmp_path)
    _finished(out, cells["calibrated.s0"])
    _marker(out, "again.s0", config_hash(cells["again.s0"].config_text), same_as="calibrated.s0")
    one_line_exit_2(_dry_run(path, out), "cell again.s0:", "reads run calibrated.s0", "another config")
    _marker(out, "again.s0", config_hash(cells["again.s0"].config_text), same_as="../../etc")
    one_line_exit_2(_dry_run(path, out), "cell again.s0:", "has no such run")


def test_a_cell_resumed_with_an_accepted_config_change_is_refused_and_so_is_its_twin(tmp_path: Path) -> None:
    from flows.campaign.run_checks import record_config_change
    from flows.sweep.state import cell_state

    path, out, cells = _twin_sweep(tmp_path)
    run = out / "standard.s0"
    changed = load_config(
        run / "config.yaml", ["calibration.max_delta=0.1"]
    )  # what `resume --accept-config-change` takes
    (run / "config.yaml").write_text(dump_config(changed))
    record_config_change(run, read_run_info(run), changed, ["calibration.max_delta (0.05 -> 0.1)"])
    one_line_exit_2(_dry_run(path, out), "cell standard.s0:", "config change", "calibration.max_delta")
    with pytest.raises(
        ConfigError, match=r"cell again\.s0: .* reads run standard\.s0, but run standard\.s0 took a config change"
    ):
        cell_state(out, cells["again.s0"])


def _choice_record(out: Path, winner: str, candidates: dict[str, dict]) -> Path:
    """``_choices/strongest.json`` as ``make_choice`` writes it."""
    path = out / "_choices" / "strongest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    figures = {
        c: {
            "runs": [f"pilot-strongest.{c}.s100"],
            "second_half_eval": {},
            "overclipped_share": {},
            "mean_second_half_eval": 50.0,
            "mean_overclipped_share": None,
        }
        for c in candidates
    }
    record = {
        "choice": "strongest",
        "winner": winner,
        "overrides": candidates[winner],
        "rule": "best-second-half-eval",
        "tie": 0.5,
        "seeds": [100],
        "candidates": figures,
        "code": {},
        "made_at": "2026-12-06T00:00:00+00:00",
    }
    path.write_text(json.dumps(record))
    return path


def test_a_choice_whose_candidates_changed_after_it_was_made_is_refused(tmp_path: Path) -> None:
    path, out = _sweep(tmp_path, CHOICE)
    _choice_record(
        out,
        "icepop",
        {"token-tis": {"algorithm.correction.mode": "token-tis"}, "icepop": {"algorithm.correction.mode": "icepop"}},
    )
    res = _dry_run(path, out)
    assert res.exit_code == 0 and "choice strongest: icepop" in res.stdout, res.output
    path.write_text(
        CHOICE.replace("icepop: {algorithm.correction.mode: icepop}", "seq-mis: {algorithm.correction.mode: seq-mis}")
    )
    one_line_exit_2(_dry_run(path, out), "choice strongest", "winner icepop is no longer a candidate", "seq-mis")


@pytest.mark.parametrize(
    "damage",
    ['{"choice": "strongest", "winner": "ice', "[]", '{"choice": "strongest"}', "\xff\xfe"],
    ids=["torn", "a-list", "no-winner", "not-utf8"],
)
def test_a_damaged_choice_record_is_one_line(tmp_path: Path, damage: str) -> None:
    path, out = _sweep(tmp_path, CHOICE)
    record = _choice_record(
        out,
        "icepop",
        {"token-tis": {"algorithm.correction.mode": "token-tis"}, "icepop": {"algorithm.correction.mode": "icepop"}},
    )
    record.write_bytes(damage.encode("latin-1"))
    one_line_exit_2(_dry_run(path, out), "strongest.json: damaged choice record")


def test_a_damaged_marker_is_one_line(tmp_path: Path) -> None:
    path, out, _ = _twin_sweep(tmp_path)
    (out / CELLS_DIR / "standard.s0.json").write_text('{"cell": "standard.s0", "config_ha')
    one_line_exit_2(_dry_run(path, out), "cell standard.s0:", "is damaged", "delete it")


BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 6))  # 10^5 items once expanded


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            TWINS.replace("    calibrated:", "    standard: {calibration.mode: calibrated}\n    calibrated:"),
            "key 'standard' appears twice in one mapping",
        ),
        (
            TWINS.replace(
                "axes:", "bomb:\n  l0: &l0 [x]\n" + "".join("  " + ln + "\n" for ln in BOMB.splitlines()) + "axes:"
            ),
            "anchors and aliases are not allowed",
        ),
    ],
    ids=["label-twice-in-an-axis", "alias-bomb"],
)
def test_sweep_files_are_read_by_the_strict_loader(tmp_path: Path, text: str, needle: str) -> None:
    path, out = _sweep(tmp_path, text)
    one_line_exit_2(_dry_run(path, out), str(path), "line ", needle)


@pytest.fixture
def fake_flow(monkeypatch):
    """``fp8rl sweep`` in-process with the fake campaign and without Prefect (whose start and shutdown
    path the signals case covers): the cells it ran."""
    from test_sweep import FakeCampaign

    import flows.campaign.launch
    import flows.orchestration.env
    import flows.sweep.runner
    from flows.sweep.runner import run_sweep_file

    fake = FakeCampaign()
    monkeypatch.setattr(flows.campaign.launch, "until_signal", lambda body, resume: body(lambda: None))
    monkeypatch.setattr(flows.orchestration.env, "quiet_console_failures", lambda: None)

    def flow(sweep_file, out, fail_fast=False, report=True, only=None, **check_memory):
        return run_sweep_file(
            sweep_file, out, campaign=fake, report=False, echo=lambda _l: None, only=only, **check_memory
        )

    monkeypatch.setattr(flows.sweep.runner, "_FLOW", flow)
    return fake


def test_a_second_sweep_on_a_cell_another_sweep_runs_is_refused_and_other_parts_run(tmp_path: Path, fake_flow) -> None:
    path, out = _sweep(tmp_path, TWINS)
    lock = out / CELLS_DIR / "standard.s0.lock"
    lock.parent.mkdir(parents=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as the first sweep holds it while it runs the cell
        os.write(fd, json.dumps({"pid": 4242, "host": "here", "since": "2026-12-06T00:00:00+00:00"}).encode())
        one_line_exit_2(
            cli("sweep", path, "--out", out, "--no-report"), "cell standard.s0", "another fp8rl sweep", "pid 4242"
        )
        assert fake_flow.calls == [] and not (out / "standard.s0").exists()
        res = cli("sweep", path, "--out", out, "--no-report", "--cells", "calibrated.*")  # a part of its own
        assert res.exit_code == 0, res.output
        assert fake_flow.calls == [("calibrated.s0", False)]
    finally:
        os.close(fd)


def test_a_cell_too_large_for_the_machine_is_refused_before_anything_is_written(tmp_path: Path, fake_flow) -> None:
    big = "model: {hidden_size: 16384, intermediate_size: 65536, num_layers: 12}, device: cpu, "
    path, out = _sweep(tmp_path, TWINS.replace("overrides: {", "overrides: {" + big))
    one_line_exit_2(
        cli("sweep", path, "--out", out, "--no-report"), "cell standard.s0:", "GiB per rank", "--skip-memory-check"
    )
    assert fake_flow.calls == [] and not out.exists()


# --------------------------------------------------------------------------- signals


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except (OSError, IndexError):
        return None
    return None if stat[0] in ("Z", "X") else stat[19]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_ends_a_sweep_in_one_line_and_starts_no_later_cell(tmp_path: Path) -> None:
    from shared_prefect import without_server

    from flows.process.shutdown import descendants

    sets = ", ".join(f"{k}: {v}" for k, v in (o.split("=", 1) for o in MICRO_OVERRIDES))
    path, out = _sweep(
        tmp_path,
        TWINS.replace(
            "overrides: {steps: 3, calibration.interval: 2, evaluation: {interval: 2}}", "overrides: {" + sets + "}"
        ),
    )
    marker = tmp_path / "held"
    env = {k: v for k, v in without_server(os.environ).items() if not k.startswith("FP8RL_FAULT")}
    env.update(FP8RL_FAULT="evaluate@0=wait", FP8RL_FAULT_MARKER=str(marker), OMP_NUM_THREADS="1")
    cmd = CliProcess(["sweep", str(path), "--out", str(out)], env, sigint=True)
    proc = cmd.proc
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, f"ended ({proc.returncode}) before the fault point"
            assert time.monotonic() < deadline, "the fault point was never reached"
            time.sleep(0.1)
        below = {p: _start_time(p) for p in descendants(proc.pid)}  # the watcher and the server at least
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)  # to the command alone, as `kill` or a batch scheduler sends it
        code = proc.wait(timeout=60)
        took = time.monotonic() - t0
        time.sleep(1.0)
        left = [p for p, t in below.items() if t is not None and _start_time(p) == t]
    finally:
        kill_session(proc.pid)  # nothing should be left; never leave it to the suite
    lines = cmd.stderr().strip().splitlines()
    assert code == 143, lines[-20:]
    assert lines == [f"interrupted (SIGTERM); the run stays resumable: `fp8rl sweep {path} --out {out}`"], lines[-20:]
    assert took < 10, f"{took:.1f} s from the signal to the end"
    assert not (out / "calibrated.s0").exists() and not (out / CELLS_DIR / "again.s0.json").exists()  # no later cell
    assert len(below) >= 2 and left == [], (below, left)
