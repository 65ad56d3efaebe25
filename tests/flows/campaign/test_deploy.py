"""Scheduling: a deployed campaign runs on a work pool, from a Prefect server.

The slow tests share one real server — ``prefect server start`` on 127.0.0.1, a
free port, its own ``PREFECT_HOME`` — and drive it only through the commands a
user types: ``fp8rl deploy`` registers the micro campaign (2 steps) on a process
work pool it creates, ``prefect deployment run`` asks for a flow run, and
``prefect worker start --run-once`` executes it in a subprocess. Then the
server's record (deployment flow run and campaign subflow completed) and the
run directory's tables are checked, and ``prefect deploy`` from
``prefect.yaml`` must register the same deployment as ``fp8rl deploy``. Every
process runs in its own session; its process group is killed at the end.

The fast tests cover the run-directory rules of a flow run and the one-line
errors of ``fp8rl deploy`` without a server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import MICRO_OVERRIDES, kill_session, micro_config
from shared_prefect import free_port, healthy
from typer.testing import CliRunner

# end to end on a shared 2-core machine: a module fixture's campaign counts in its first test
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[3]
PREFECT = [sys.executable, "-m", "prefect"]
FP8RL = [sys.executable, "-m", "flows.cli"]
POOL = "fp8rl-test"

# The micro campaign, 2 steps, on a still smaller model: its bootstrap (not
# cached yet when this module runs alone) takes seconds rather than minutes.
CAMPAIGN = [
    *MICRO_OVERRIDES,
    "steps=2",
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "bootstrap.batch_size=8",
]

# Margins for a loaded 2-core machine; typical times are a tenth of these.
SERVER_START_S = 120  # typically ~15 s
COMMAND_S = 120  # deploy, deployment run: typically ~3 s
WORKER_S = 480  # the campaign: ~40 s with its bootstrap


# --------------------------------------------------------------------------- processes


def _kill_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM the process group, then SIGKILL what is left (children included)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # leader gone; still sweep its group
            kill_session(proc.pid)
        return


def _start(cmd: list[str], env: dict, log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    """Start ``cmd`` in a new session with output to ``log`` (files, not pipes: orphans can hold pipes open)."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _run(cmd: list[str], env: dict, log: Path, timeout: float = COMMAND_S, cwd: Path = ROOT) -> tuple[int, str]:
    """Run ``cmd`` to the end in its own session; return its exit code and output."""
    start = log.stat().st_size if log.exists() else 0
    proc = _start(cmd, env, log, cwd)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        _kill_group(proc, grace_s=5)
    out = log.read_text(errors="replace")[start:]
    assert code is not None, f"{' '.join(cmd[2:])} still running after {timeout} s:\n{out[-4000:]}"
    return code, out


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8RL_FAULT") and k != "PREFECT_API_URL"}
    env.update(extra)
    return env


# --------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class Server:
    api_url: str
    env: dict  # environment of client commands: PREFECT_API_URL and a client home
    logs: Path

    def get(self, path: str):
        with urllib.request.urlopen(f"{self.api_url}{path}", timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict):
        req = urllib.request.Request(
            f"{self.api_url}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Server:
    logs = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = _clean_env(
        PREFECT_HOME=str(logs / "server-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_UI_ENABLED="false",
        DO_NOT_TRACK="1",
    )
    proc = _start([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, logs / "server.log")
    try:
        deadline = time.monotonic() + SERVER_START_S
        while not healthy(api_url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (logs / "server.log").read_text(errors="replace")[-1500:]
                pytest.skip(
                    f"prefect server did not start on 127.0.0.1:{port} within {SERVER_START_S} s "
                    f"(exit code {proc.poll()}): {tail}"
                )
            time.sleep(1)
        yield Server(api_url, _clean_env(PREFECT_API_URL=api_url, PREFECT_HOME=str(logs / "client-home")), logs)
    finally:
        _kill_group(proc)


# --------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_a_deployed_campaign_runs_through_a_process_worker(server, tmp_path):
    runs_root = tmp_path / "runs"
    sets = [a for o in [*CAMPAIGN, f"storage.runs_root={runs_root}"] for a in ("--set", o)]
    log = server.logs / "e2e.log"

    code, out = _run([*FP8RL, "deploy", "tiny-cpu", "--pool", POOL, "--name", "micro", *sets], server.env, log)
    assert code == 0, out[-3000:]
    assert f"created work pool {POOL!r} (type process)" in out and "deployed fp8rl/micro" in out
    dep = server.get("/deployments/name/fp8rl/micro")
    assert dep["entrypoint"] == "flows/campaign/deploy.py:deployed_campaign" and dep["work_pool_name"] == POOL
    assert dep["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]

    code, out = _run([*PREFECT, "deployment", "run", "fp8rl/micro"], server.env, log)
    assert code == 0, out[-3000:]
    code, out = _run([*PREFECT, "worker", "start", "--pool", POOL, "--run-once"], server.env, log, timeout=WORKER_S)
    assert code == 0, out[-5000:]

    runs = server.post("/flow_runs/filter", {"sort": "EXPECTED_START_TIME_ASC"})
    parents = [r for r in runs if r["deployment_id"] == dep["id"]]
    subflows = [r for r in runs if r["parent_task_run_id"] is not None]
    assert len(parents) == 1 and len(subflows) == 1, [(r["name"], r["state_type"]) for r in runs]
    assert parents[0]["state_type"] == "COMPLETED", out[-5000:]
    assert subflows[0]["state_type"] == "COMPLETED", out[-5000:]

    # one new run directory, named after the flow run, holding the 2-step campaign
    from storage.queries.catalog import connect, query

    [run_dir] = list(runs_root.iterdir())
    assert run_dir.name.startswith("tiny-cpu-") and run_dir.name.endswith(parents[0]["name"])
    con = connect(run_dir)
    assert query(con, "SELECT step FROM steps ORDER BY step").column("step").to_pylist() == [1, 2]
    assert query(con, "SELECT DISTINCT step FROM eval_scores ORDER BY step").column("step").to_pylist() == [0, 2]
    assert (run_dir / "checkpoints" / "step_2").is_dir()
    assert "step    2/2" in out


@pytest.mark.slow
def test_prefect_yaml_registers_the_same_deployment_as_fp8rl_deploy(server):
    log = server.logs / "yaml.log"
    # fp8rl deploy of the default preset also creates the pool prefect.yaml names ("fp8rl")
    code, out = _run([*FP8RL, "deploy", "--name", "from-cli"], server.env, log)
    assert code == 0, out[-3000:]
    code, out = _run([*PREFECT, "--no-prompt", "deploy", "--name", "tiny-cpu"], server.env, log)
    assert code == 0, out[-3000:]
    keys = ("entrypoint", "parameters", "pull_steps", "work_pool_name")
    from_yaml = server.get("/deployments/name/fp8rl/tiny-cpu")
    from_cli = server.get("/deployments/name/fp8rl/from-cli")
    assert {k: from_yaml[k] for k in keys} == {k: from_cli[k] for k in keys}
    assert from_yaml["parameters"] == {"config": "tiny-cpu", "overrides": [], "run_dir": None, "resume": False}
    assert from_yaml["work_pool_name"] == "fp8rl"


@pytest.mark.slow
def test_a_cron_schedule_is_recorded(server):
    code, out = _run(
        [
            *FP8RL,
            "deploy",
            "--name",
            "nightly",
            "--pool",
            "fp8rl-cron",
            "--cron",
            "0 2 * * *",
            "--timezone",
            "Europe/Paris",
        ],
        server.env,
        server.logs / "cron.log",
    )
    assert code == 0, out[-3000:]
    [sched] = server.get("/deployments/name/fp8rl/nightly")["schedules"]
    assert sched["schedule"]["cron"] == "0 2 * * *" and sched["schedule"]["timezone"] == "Europe/Paris"
    assert sched["active"]


# --------------------------------------------------------------------------- fast checks


def _deploy_cli(*args: str):
    from flows.cli import app

    return CliRunner().invoke(app, ["deploy", *args])


def test_deploy_without_a_server_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    res = _deploy_cli()
    assert res.exit_code == 2
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: PREFECT_API_URL is not set")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "calibration.intervl=3"], "calibration.intervl: unknown key"),
        (["--cron", "61 * * *"], "--cron '61 * * *': Invalid cron string"),
        (["--resume"], "--resume needs --run-dir"),
    ],
)
def test_bad_deploy_arguments_are_one_line_and_exit_2(monkeypatch, args, message):
    import prefect.context  # noqa: F401  (Prefect reads its settings at import: not with this URL)

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # never reached: the checks come first
    res = _deploy_cli(*args)
    assert res.exit_code == 2 and res.stderr.count("\n") == 1 and message in res.stderr, res.stderr


def test_run_dir_rules_of_a_flow_run(tmp_path):
    from flows.campaign.deploy import DeploymentInputError, prepare_run_dir

    cfg = micro_config(f"storage.runs_root={tmp_path / 'runs'}")
    new, resuming = prepare_run_dir(cfg, None, False, run_name="brave-otter")
    assert not resuming and (new / "run.json").exists() and (new / "config.yaml").exists()
    assert new.parent == tmp_path / "runs" and new.name.startswith("tiny-cpu-") and new.name.endswith("-brave-otter")

    fixed = tmp_path / "fixed"
    assert prepare_run_dir(cfg, str(fixed), True, run_name="x") == (fixed, False)  # absent: start there
    assert prepare_run_dir(cfg, str(fixed), True, run_name="x") == (fixed, True)  # present: resume
    with pytest.raises(DeploymentInputError, match="already holds a run; run with resume=true"):
        prepare_run_dir(cfg, str(fixed), False, run_name="x")
    with pytest.raises(DeploymentInputError, match="resume=true needs run_dir"):
        prepare_run_dir(cfg, None, True, run_name="x")
    other = micro_config("steps=5")
    with pytest.raises(DeploymentInputError, match="config hash"):
        prepare_run_dir(other, str(fixed), True, run_name="x")
