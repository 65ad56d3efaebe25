"""Experiment trackers fed from the Parquet rows ( part 1), and the campaign in Prefect's UI (part 4).

One micro campaign runs in-process with all three sinks (TensorBoard, MLflow on
its default SQLite store, W&B offline), is resumed from the train stage of its
last step (train and calibrate replay and rewrite that step), and each sink is
read back with the tool's own reader: the same steps and values as the tables,
no duplicate step after the replay, the same tracker run continued.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import micro_config

pytestmark = pytest.mark.slow
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # in-process flows on a busy machine

TRACKED = ["tensorboard", "mlflow", "wandb"]
STEP_METRICS = {
    "train/reward_mean": "reward_mean",
    "train/entropy_mean": "entropy_mean",
    "clip/clipfrac": "clipfrac",
    "clip/lower_bound": "lower_bound",
    "train/ppo_kl": "ppo_kl",
}


def _new_run(tmp: Path, cfg) -> Path:
    from flows.campaign.configuration import dump_config
    from storage.run.layout import create_run

    create_run(tmp, "run", config=dump_config(cfg))
    return tmp / "run"


def _campaign(run_dir: Path, **kw) -> dict:
    from flows.campaign.flow import campaign_flow

    return campaign_flow(str(run_dir), **kw)


def _steps_table(run_dir: Path) -> dict[str, dict[int, float]]:
    from storage.queries.catalog import connect, query

    rows = query(connect(run_dir), "SELECT * FROM steps ORDER BY step").to_pylist()
    return {col: {r["step"]: r[col] for r in rows} for col in STEP_METRICS.values()}


def _sql(run_dir: Path, sql: str) -> list[dict]:
    from storage.queries.catalog import connect, query

    return query(connect(run_dir), sql).to_pylist()


def _tensorboard(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "trackers" / "tensorboard"))
    ea.Reload()
    return {tag: [(e.step, e.value) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}


def _purge_markers(run_dir: Path) -> list[int]:
    """Steps of the SessionLog.START (purge) events in the TensorBoard files, in file order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = []
    for f in sorted((run_dir / "trackers" / "tensorboard").glob("events.out.tfevents.*")):
        out += [e.step for e in EventFileLoader(str(f)).Load() if e.HasField("session_log")]
    return out


def _mlflow(run_dir: Path) -> tuple[list, dict[str, list[tuple[int, float]]]]:
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "trackers" / "state.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'trackers' / 'mlflow.db'}")
    run = client.get_run(state["mlflow"]["run_id"])
    runs = client.search_runs([run.info.experiment_id])
    hist = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}
    return runs, hist | {"_params": run.data.params}


def _wandb(run_dir: Path) -> tuple[list[Path], dict[str, list[tuple[int, float]]]]:
    from flows.report.trackers import read_wandb_history

    state = json.loads((run_dir / "trackers" / "state.json").read_text())
    files = sorted((run_dir / "trackers" / "wandb").glob(f"offline-run-*-{state['wandb']['run_id']}/run-*.wandb"))
    out: dict[str, list[tuple[int, float]]] = {}
    for f in files:
        for row in read_wandb_history(f):
            for k, v in row.items():
                if not k.startswith("_"):
                    out.setdefault(k, []).append((row["_step"], v))
    return files, out


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A 2-step campaign with all sinks, read back; then resumed from train@2 (train and calibrate
    replay step 2 after restoring the step-1 checkpoint) and read back again."""
    from storage.parts.writer import set_aside_from

    tmp = tmp_path_factory.mktemp("tracked")
    cfg = micro_config(
        "trackers=[tensorboard, mlflow, wandb]",
        "steps=2",
        "checkpoint.interval=1",
        "calibration.interval=1",
        "evaluation.benchmarks=[{name: synthetic, k: 2, limit: 8, max_new_tokens: 12}]",
    )
    run_dir = _new_run(tmp, cfg)
    t0 = time.perf_counter()
    os.environ.update(FP8RL_FAULT="rollout@1=transient", FP8RL_FAULT_MARKER=str(tmp / "fault-marker"))
    try:
        _campaign(run_dir)  # a failed rollout attempt, retried by Prefect: its reason must show in the UI
    finally:
        os.environ.pop("FP8RL_FAULT"), os.environ.pop("FP8RL_FAULT_MARKER")
    first = {
        "tb": _tensorboard(run_dir),
        "purges": _purge_markers(run_dir),
        "mlflow": _mlflow(run_dir),
        "wandb": _wandb(run_dir),
        "state": json.loads((run_dir / "trackers" / "state.json").read_text()),
        "seconds": time.perf_counter() - t0,
    }
    set_aside_from(run_dir, step=2, stages_at_step=["train", "calibrate", "evaluate", "checkpoint"])
    _campaign(run_dir, resume=True)
    return run_dir, first


def _f32(x: float) -> np.float32:
    return np.float32(x)


@pytest.mark.timeout(1200)
def test_tensorboard_holds_the_steps_table(tracked):
    run_dir, first = tracked
    table = _steps_table(run_dir)
    for tb in (first["tb"], _tensorboard(run_dir)):
        for tag, col in STEP_METRICS.items():
            assert [s for s, _ in tb[tag]] == [1, 2], tag  # no duplicate step after the replay
            assert [_f32(v) for _, v in tb[tag]] == [_f32(table[col][s]) for s in (1, 2)], tag
    purges = _purge_markers(run_dir)  # the replay purged (and re-logged) from a replayed step on, never before step 1
    assert first["purges"] == [] and purges and min(purges) >= 1
    bounds = _sql(run_dir, "SELECT step, lower, alpha FROM bounds ORDER BY step")
    tb = _tensorboard(run_dir)
    assert tb["calibration/lower"] == [(b["step"], _f32(b["lower"])) for b in bounds]
    evals = _sql(run_dir, "SELECT step, value FROM eval_scores WHERE metric = 'avg@k' AND k = 2 ORDER BY step")
    assert [(s, _f32(v)) for s, v in tb["eval/synthetic/avg@2"]] == [(e["step"], _f32(e["value"])) for e in evals]
    assert [e["step"] for e in evals] == [0, 2]


def test_tensorboard_replaces_a_replayed_step_with_the_new_values(tmp_path):
    """A replay with *different* values (a rollback): the reader shows the new ones, once."""
    from flows.report.trackers import Trackers
    from storage.parts.writer import TableWriter

    cfg = micro_config("trackers=[tensorboard]")
    run_dir = _new_run(tmp_path, cfg)
    hub = Trackers(cfg, run_dir, "run")
    w = TableWriter(run_dir, durable=False, listeners=[hub.on_write])
    for s in (1, 2, 3):
        w.write("steps", s, {"reward_mean": 0.1 * s}, stage="train")
    w.write("eval_scores", 2, [{"benchmark": "b", "metric": "avg@1", "k": 1, "value": 0.5}], stage="evaluate")
    hub.close()
    hub = Trackers(cfg, run_dir, "run")  # a new process: marks come from state.json
    w = TableWriter(run_dir, durable=False, listeners=[hub.on_write])
    w.write("steps", 2, {"reward_mean": 0.9}, stage="train", attempt=1)
    hub.close()
    tb = _tensorboard(run_dir)
    assert tb["train/reward_mean"] == [(1, _f32(0.1)), (2, _f32(0.9)), (3, _f32(0.3))]
    assert tb["eval/b/avg@1"] == [(2, 0.5)]


@pytest.mark.timeout(1200)
def test_mlflow_run_holds_the_steps_table_and_the_config(tracked):
    run_dir, first = tracked
    table = _steps_table(run_dir)
    runs_before, _ = first["mlflow"]
    runs, hist = _mlflow(run_dir)
    assert len(runs) == len(runs_before) == 1, "the resume continued the same MLflow run"
    for tag, col in STEP_METRICS.items():
        assert [s for s, _ in hist[tag]] == [1, 2], tag
        assert [_f32(v) for _, v in hist[tag]] == [_f32(table[col][s]) for s in (1, 2)], tag
    assert [s for s, _ in hist["eval/synthetic/avg_at_2"]] == [0, 2]
    assert (
        hist["_params"]["calibration.interval"] == "1"
        and hist["_params"]["trackers"] == '["tensorboard", "mlflow", "wandb"]'
    )


@pytest.mark.timeout(1200)
def test_wandb_offline_run_holds_the_steps_table(tracked):
    run_dir, first = tracked
    table = _steps_table(run_dir)
    files, hist = _wandb(run_dir)
    assert len(first["wandb"][0]) == 1 and len(files) == 2, "the resume wrote a second segment of the same W&B run"
    for tag, col in STEP_METRICS.items():
        assert [s for s, _ in hist[tag]] == [1, 2], tag
        assert [_f32(v) for _, v in hist[tag]] == [_f32(table[col][s]) for s in (1, 2)], tag
    state = json.loads((run_dir / "trackers" / "state.json").read_text())
    assert state["wandb"]["run_id"] == first["state"]["wandb"]["run_id"]
    assert state["mlflow"]["run_id"] == first["state"]["mlflow"]["run_id"]


def test_a_sink_at_an_unreachable_server_warns_once_and_loses_no_row(tmp_path, caplog):
    from flows.report.trackers import Trackers
    from storage.parts.writer import TableWriter

    cfg = micro_config(
        "trackers=[mlflow, tensorboard]", "tracking.mlflow_uri=http://127.0.0.1:9", "tracking.timeout_s=1"
    )
    run_dir = _new_run(tmp_path, cfg)
    (tmp_path / "run" / "trackers").mkdir()
    (tmp_path / "run" / "trackers" / "tensorboard").write_text("a file where a folder should be")  # disk-level failure
    hub = Trackers(cfg, run_dir, "run")
    w = TableWriter(run_dir, durable=False, listeners=[hub.on_write])
    with caplog.at_level(logging.WARNING, logger="fp8rl.trackers"):
        for s in (1, 2, 3):
            w.write("steps", s, {"reward_mean": 0.1 * s}, stage="train")
        t0 = time.perf_counter()
        hub.close()
        assert time.perf_counter() - t0 < 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "fp8rl.trackers"]
    assert len([m for m in warnings if m.startswith("tracker mlflow")]) == 1, warnings
    assert len([m for m in warnings if m.startswith("tracker tensorboard")]) == 1, warnings
    assert [r["step"] for r in _sql(run_dir, "SELECT step FROM steps ORDER BY step")] == [1, 2, 3]


def test_only_rank_0_logs(tmp_path, monkeypatch):
    from flows.report.trackers import Trackers

    cfg = micro_config("trackers=[tensorboard]")
    monkeypatch.setenv("RANK", "1")
    assert Trackers(cfg, tmp_path, "run").workers == []
    monkeypatch.setenv("RANK", "0")
    hub = Trackers(cfg, tmp_path, "run")
    assert [w.sink.name for w in hub.workers] == ["tensorboard"]
    hub.close()


def test_without_trackers_no_tracker_code_is_imported(tmp_path, monkeypatch):
    """Importing any tracker module fails (ImportError) here, so a campaign that touched one would crash."""
    for mod in ("flows.report.trackers", "tensorboard", "mlflow", "wandb"):
        monkeypatch.setitem(sys.modules, mod, None)
    cfg = micro_config("steps=1", "evaluation.benchmarks=[{name: synthetic, k: 1, limit: 4, max_new_tokens: 4}]")
    assert cfg.trackers == ()
    run_dir = _new_run(tmp_path, cfg)
    _campaign(run_dir)
    assert not (run_dir / "trackers").exists()
    assert [r["step"] for r in _sql(run_dir, "SELECT step FROM steps")] == [1]


# --------------------------------------------------------------------------- Prefect's UI (part 4)


def _flow_run_of(run_dir: Path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["fp8rl-campaign"])))
    mine = [r for r in runs if r.parameters.get("run_dir") == str(run_dir)]
    assert len(mine) == 2, "the first run and the resume"
    return sorted(mine, key=lambda r: r.start_time)


@pytest.mark.timeout(1200)
def test_prefect_client_finds_the_flow_run_stage_tasks_and_artifacts(tracked):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterTaskRunId,
    )

    from flows.orchestration.ui import artifact_key

    run_dir, _ = tracked
    first, resumed = _flow_run_of(run_dir)
    assert first.state.is_completed() and resumed.state.is_completed()
    key = artifact_key("run")
    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[first.id])))
        names = {t.name: t for t in tasks}
        for stage, step in [
            ("rollout", 1),
            ("score", 1),
            ("train", 1),
            ("calibrate", 1),
            ("evaluate", 0),
            ("evaluate", 2),
            ("checkpoint", 1),
            ("train", 2),
            ("calibrate", 2),
        ]:
            assert f"{stage}-step-{step}" in names, sorted(names)
        assert names["rollout-step-1"].run_count == 2 and names["rollout-step-1"].state.is_completed()
        logs = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=[names["rollout-step-1"].id])))
        assert any("attempt 0 failed: InjectedTransientFault: injected transient fault" in lg.message for lg in logs)

        ours = {first.id, resumed.id}  # the suite's other campaigns share the Prefect server (and may share a run id)

        def versions(k: str):
            found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[k])))
            return [a for a in found if a.flow_run_id in ours]

        failures = versions(f"failures-{key}")
        assert len(failures) == 1 and "injected transient fault in rollout at step 1" in failures[0].data
        steps = versions(f"steps-{key}")
        assert sorted({row["step"] for a in steps for row in json.loads(a.data)}) == [1, 2]
        history = versions(f"bounds-history-{key}")
        assert max(len(json.loads(a.data)) for a in history) == 2  # calibrations at steps 1 and 2
        summary = versions(f"bounds-summary-{key}")
        assert any("| 2 | calibrated |" in a.data for a in summary)
        evals = versions(f"eval-{key}")
        assert len(evals) >= 2  # steps 0, 2 (+ the resume's re-evaluation of step 2)
    rows = {r["step"]: r for r in _sql(run_dir, "SELECT step, reward_mean FROM steps")}
    last = {row["metric"]: row["value"] for a in steps for row in json.loads(a.data) if row["step"] == 1}
    assert last["train/reward_mean"] == pytest.approx(rows[1]["reward_mean"], abs=1e-6)


CHROMIUM = next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser") if Path(p).exists()), None)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prefect_ui(tracked):
    """``prefect server start`` on the tests' Prefect database (the UI the user would open)."""
    import subprocess
    import urllib.request

    port = _free_port()
    env = dict(
        os.environ,
        PREFECT_SERVER_API_HOST="127.0.0.1",
        PREFECT_SERVER_API_PORT=str(port),
        PREFECT_UI_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_LOGGING_LEVEL="WARNING",
    )
    env.pop("PREFECT_API_URL", None)
    log_file = open(Path(os.environ["PREFECT_HOME"]) / "ui-server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        for _ in range(240):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(
                "prefect server did not start: "
                + (Path(os.environ["PREFECT_HOME"]) / "ui-server.log").read_text()[-2000:]
            )
        yield f"http://127.0.0.1:{port}"
    finally:
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log_file.close()


def render(url: str, profile: Path, *, screenshot: Path | None = None, budget_ms: int = 25000) -> str:
    """The DOM of ``url`` after Prefect's single-page app rendered it in headless Chromium."""
    import subprocess

    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        "--window-size=1400,900",
    ]
    if screenshot is not None:
        return subprocess.run(
            cmd + [f"--screenshot={screenshot}", url], capture_output=True, text=True, timeout=180
        ).stderr
    return subprocess.run(cmd + ["--dump-dom", url], capture_output=True, text=True, timeout=180).stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian: apt-get install -y chromium)")
@pytest.mark.timeout(600)
def test_prefect_ui_renders_the_campaign(tracked, prefect_ui, tmp_path):
    from flows.orchestration.ui import artifact_key

    run_dir, _ = tracked
    first, _ = _flow_run_of(run_dir)
    page = render(f"{prefect_ui}/runs/flow-run/{first.id}", tmp_path / "profile")  # the Logs tab
    assert "rollout-step-1 attempt 0 failed: InjectedTransientFault: injected transient fault" in page, page[-3000:]
    assert "Completed" in page
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        summary = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"bounds-summary-{artifact_key('run')}"]))
        )
    page = render(f"{prefect_ui}/artifacts/artifact/{summary[-1].id}", tmp_path / "profile")
    assert "Calibrated clipping" in page and "In force from step" in page, page[-3000:]
