"""Experiment-tracker sinks: TensorBoard, MLflow and W&B, fed from the Parquet rows.

The Parquet tables stay the source of truth. A campaign with ``trackers:
[tensorboard, mlflow, wandb]`` registers one listener on its
:class:`storage.parts.writer.TableWriter`; every live write of ``steps``, ``bounds``
or ``eval_scores`` (main variant) is turned into points — the very rows that
went to Parquet, so one place computes a metric — and handed to each sink.

Names are grouped the way the tools show them: ``clip/`` (clip shares and the
bounds in force), ``train/`` (every other ``steps`` column, timings included),
``calibration/`` (``bounds`` columns) and ``eval/<benchmark>/<metric>@<k>``.
The config is logged as parameters (flattened, dotted keys). Only rank 0 logs.

Isolation: each sink runs in its own daemon thread behind a bounded queue. A
sink that raises (server down, disk full) is warned about once and then only
drains its queue; one that hangs is abandoned after ``tracking.timeout_s`` at
the end of the campaign (one warning). Neither ever fails a stage, and the
tables are complete either way.

Resume and replays. Each sink keeps, per table, the highest step it logged
(its "high-water mark") in ``<tracker dir>/state.json`` together with the
MLflow / W&B run ids, so a resumed campaign continues the same tracker run.
A write of a step at or below the mark is a replay (resume replays train and
calibrate after the restored checkpoint; ``resume --from``; a rollback):

- TensorBoard event files are append-only, but TensorBoard's reader honours
  a ``SessionLog.START`` event at step s by purging every point at steps
  >= s read before it (what ``SummaryWriter(purge_step=s)`` writes). The sink
  writes that marker and then re-logs every table's live Parquet rows from
  step s on, so what TensorBoard shows from s on equals the tables exactly,
  new values included.
- MLflow keeps a metric's full history (a second point at the same step is
  a second point; there is no delete), and W&B drops steps below its current
  step. Both sinks therefore skip replayed steps: a resume reproduces the
  same values (the resume test checks the tables are equal), so nothing is
  lost; after a rollback with *different* values those two trackers keep the
  first ones, and the tables (and TensorBoard) hold the new ones.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa

log = logging.getLogger("fp8rl.trackers")

from flows.orchestration.ui import live_rows, metric_points  # noqa: F401,E402 (metric_points: the one naming of points)

TRACKED_TABLES = ("steps", "bounds", "eval_scores")
_STOP = object()


# --------------------------------------------------------------------------- rows -> points


def flat_params(cfg: Any) -> dict[str, str]:
    """The config as ``{"algorithm.eps_low": "0.2", ...}`` (what trackers show as parameters)."""
    out: dict[str, str] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            out[prefix] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)

    walk("", cfg.model_dump(mode="json"))
    return out


def is_rank0() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except Exception:  # pragma: no cover
        pass
    return os.environ.get("RANK", "0") == "0"


# --------------------------------------------------------------------------- state


class TrackerState:
    """``state.json`` of the tracker dir: run ids and per-table high-water marks, per sink."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        try:
            self.data = json.loads(path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def get(self, sink: str) -> dict:
        with self.lock:
            return self.data.setdefault(sink, {"hw": {}})

    def save(self) -> None:
        with self.lock:  # every mutation of ``data`` holds this lock too
            text = json.dumps(self.data, indent=1, sort_keys=True)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{threading.get_ident()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)


# --------------------------------------------------------------------------- sinks


class Sink:
    name = "?"

    def __init__(self, ctx: "TrackerContext") -> None:
        self.ctx = ctx
        self.state = ctx.state.get(self.name)
        self.hw: dict[str, int] = self.state.setdefault("hw", {})

    def open(self) -> None: ...

    def log(self, table: str, step: int, points: list[tuple[int, str, float]]) -> None: ...

    def close(self) -> None: ...

    def _advance(self, table: str, step: int) -> None:
        self._set_mark(table, max(step, self.hw.get(table, -1)))

    def _set_mark(self, table: str, value: int) -> None:
        with self.ctx.state.lock:  # other sinks' threads may be saving the shared state file
            self.hw[table] = value


class TensorBoardSink(Sink):
    name = "tensorboard"

    def open(self) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = self.ctx.dir / "tensorboard"
        self.writer = EventFileWriter(str(self.logdir))

    def _scalars(self, points: Iterable[tuple[int, str, float]]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        now = time.time()
        for step, name, value in points:
            self.writer.add_event(
                Event(wall_time=now, step=step, summary=Summary(value=[Summary.Value(tag=name, simple_value=value)]))
            )

    def log(self, table: str, step: int, points: list[tuple[int, str, float]]) -> None:
        if step <= self.hw.get(table, -1):
            log.info(
                "tensorboard: %s of step %s replayed (marks %s): purge from step %s, re-log the live rows",
                table,
                step,
                dict(self.hw),
                step,
            )
            self._purge_and_resync(step)
        else:
            self._scalars(points)
            self._advance(table, step)
        self.writer.flush()

    def _purge_and_resync(self, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.writer.add_event(Event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START)))
        for table in TRACKED_TABLES:
            rows = self.ctx.live_rows(table, from_step=step)
            pts = metric_points(table, rows)
            self._scalars(pts)
            steps = [p[0] for p in pts]
            self._set_mark(table, max(steps) if steps else min(self.hw.get(table, -1), step - 1))

    def close(self) -> None:
        self.writer.close()


class MlflowSink(Sink):
    name = "mlflow"

    def open(self) -> None:
        uri = self.ctx.cfg.tracking.mlflow_uri or f"sqlite:///{self.ctx.dir / 'mlflow.db'}"
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store was asked for explicitly
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        run_id = self.state.get("run_id")
        if run_id is None:
            name = self.ctx.cfg.tracking.experiment or self.ctx.cfg.name
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            run = self.client.create_run(
                exp_id, run_name=self.ctx.run_id, tags={"fp8rl.run_dir": str(self.ctx.run_dir)}
            )
            params = [Param(k[:250], v[:6000]) for k, v in flat_params(self.ctx.cfg).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(run.info.run_id, params=params[i : i + 100])
            with self.ctx.state.lock:
                self.state["run_id"] = run.info.run_id
            self.ctx.state.save()
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = self.state["run_id"]

    def log(self, table: str, step: int, points: list[tuple[int, str, float]]) -> None:
        from mlflow.entities import Metric

        if step <= self.hw.get(table, -1):
            return  # a replay: MLflow would keep both points (see the module docstring)
        ts = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(n), v, ts, s) for s, n, v in points]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        self._advance(table, step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def mlflow_name(name: str) -> str:
    """MLflow allows letters, digits, ``_-. /``: ``eval/synthetic/avg@2`` -> ``eval/synthetic/avg_at_2``."""
    return "".join(c if c.isalnum() or c in "_-. /" else ("_at_" if c == "@" else "_") for c in name)


class WandbSink(Sink):
    name = "wandb"

    def open(self) -> None:
        import wandb

        t = self.ctx.cfg.tracking
        run_id = self.state.get("run_id") or secrets.token_hex(4)
        (self.ctx.dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=t.experiment or self.ctx.cfg.name,
            entity=t.wandb_entity,
            dir=str(self.ctx.dir),
            mode=t.wandb_mode,
            id=run_id,
            resume="allow",
            name=self.ctx.run_id,
            config=flat_params(self.ctx.cfg),
            settings=wandb.Settings(
                silent=True,
                console="off",
                x_disable_stats=True,
                x_disable_machine_info=True,
                x_disable_meta=True,
                disable_git=True,
                save_code=False,
                x_save_requirements=False,
            ),
            reinit="create_new",
        )
        if self.state.get("run_id") is None:
            with self.ctx.state.lock:
                self.state["run_id"] = run_id
            self.ctx.state.save()

    def log(self, table: str, step: int, points: list[tuple[int, str, float]]) -> None:
        top = max(self.hw.values(), default=-1)
        if step <= self.hw.get(table, -1) or step < top:
            return  # a replay; W&B itself drops steps below its current one
        self.run.log({n: v for _, n, v in points}, step=step)
        self._advance(table, step)

    def close(self) -> None:
        self.run.finish()


SINKS = {"tensorboard": TensorBoardSink, "mlflow": MlflowSink, "wandb": WandbSink}


# --------------------------------------------------------------------------- the hub


class TrackerContext:
    def __init__(self, cfg: Any, run_dir: Path, run_id: str) -> None:
        self.cfg, self.run_dir, self.run_id = cfg, Path(run_dir), run_id
        self.dir = Path(cfg.tracking.dir) if cfg.tracking.dir else self.run_dir / "trackers"
        self.state = TrackerState(self.dir / "state.json")

    def live_rows(self, table: str, *, from_step: int) -> pa.Table:
        """The live main-variant Parquet rows of ``table`` at steps >= ``from_step`` (for a resync)."""
        return live_rows(self.run_dir, table, from_step=from_step)


class _Worker:
    """One sink in its own thread; failures and hangs are warned about once."""

    def __init__(self, sink: Sink, queue_size: int) -> None:
        self.sink = sink
        self.q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.failed = False
        self.warned = False
        self.thread = threading.Thread(target=self._loop, name=f"fp8rl-tracker-{sink.name}", daemon=True)
        self.thread.start()

    def warn(self, msg: str) -> None:
        if not self.warned:
            self.warned = True
            log.warning(
                "tracker %s: %s; the campaign continues and the Parquet tables are complete", self.sink.name, msg
            )

    def put(self, item: Any) -> None:
        try:
            self.q.put_nowait(item)
        except queue.Full:
            self.warn(f"queue full ({self.q.maxsize} rows): dropping rows (the sink is slow or hung)")

    def _loop(self) -> None:
        try:
            self.sink.open()
        except Exception as err:
            self.failed = True
            self.warn(f"could not start ({type(err).__name__}: {str(err)[:300]})")
        while True:
            item = self.q.get()
            if item is _STOP:
                break
            if self.failed:
                continue
            try:
                self.sink.log(*item)
                self.sink.ctx.state.save()
            except Exception as err:
                self.failed = True
                self.warn(f"failed ({type(err).__name__}: {str(err)[:300]})")
        if not self.failed:
            try:
                self.sink.close()
            except Exception as err:
                self.warn(f"failed to close ({type(err).__name__}: {str(err)[:300]})")


class Trackers:
    """The sinks of one campaign process; :meth:`on_write` is the TableWriter listener."""

    def __init__(self, cfg: Any, run_dir: str | Path, run_id: str, names: Iterable[str] | None = None) -> None:
        self.cfg = cfg
        self.ctx = TrackerContext(cfg, Path(run_dir), run_id)
        names = list(dict.fromkeys(cfg.trackers if names is None else names))
        self.workers = [_Worker(SINKS[n](self.ctx), cfg.tracking.queue_size) for n in names] if is_rank0() else []
        self.seconds = 0.0  # time spent in on_write (the campaign's share of tracker cost)

    def on_write(self, table: str, step: int, rows: pa.Table, variant: str) -> None:
        from storage.tables.spec import MAIN_VARIANT

        if table not in TRACKED_TABLES or variant != MAIN_VARIANT or not self.workers:
            return
        t0 = time.perf_counter()
        points = metric_points(table, rows)
        for w in self.workers:
            w.put((table, int(step), points))
        self.seconds += time.perf_counter() - t0

    def close(self, timeout_s: float | None = None) -> None:
        timeout = self.cfg.tracking.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        for w in self.workers:
            try:
                w.q.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                pass
        for w in self.workers:
            w.thread.join(max(0.0, deadline - time.monotonic()))
            if w.thread.is_alive():
                w.warn(f"did not finish within {timeout:g} s (tracking.timeout_s): abandoned")


def attach(ctx: Any) -> Trackers:
    """Build the configured sinks and tee the run's table writes into them."""
    hub = Trackers(ctx.cfg, ctx.run_dir, ctx.run_id)
    ctx.writer.listeners.append(hub.on_write)
    return hub


# --------------------------------------------------------------------------- W&B offline reader


def read_wandb_history(path: str | Path) -> list[dict]:
    """History rows (``{"_step": ..., name: value}``) of a W&B offline ``run-*.wandb`` file.

    The file is W&B's record log: a 7-byte header (``:W&B``, magic, version),
    then LevelDB-log records (crc32c, 2-byte length, type full/first/middle/last)
    in 32 KiB blocks, each record a ``wandb_internal_pb2.Record``.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk = data[pos : pos + length]
        pos += length
        if kind == 0 and length == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind not in (1, 4):
            continue
        rec = pb.Record()
        rec.ParseFromString(buf)
        buf = b""
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out.append(row)
    return out
