"""The campaign in Prefect's UI: per-step metrics and calibrations as artifacts.

Prefect is a window on the run, the Parquet tables are the truth: every
artifact below is built from the live Parquet rows just written, so the UI
shows what a query would.

==================== ========= ===============================================
key                  kind      content (a new version per step / calibration)
==================== ========= ===============================================
``steps-<run>``      table     the step's metrics, grouped (train/, clip/)
``bounds-<run>``     markdown  the calibration just done: L, H, alpha, balances
``bounds-history-…`` table     every calibration so far (the ``bounds`` table)
``eval-<run>``       table     one per evaluation (flows.campaign.flow)
==================== ========= ===============================================

Task runs are named ``<stage>-step-<n>``; a failed attempt's reason is the
Prefect state message of that attempt (the exception), kept in the task run's
state history next to the ledger's ``failed`` record. Artifact errors never
fail a stage.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pyarrow as pa

from storage.tables.schemas import BOUNDS_HEADLINE

log = logging.getLogger("fp8rl.ui")

_KEYS = {"run_id", "step", "variant", "mode", "benchmark", "metric", "k"}
_CLIP = ("clipfrac", "dualclip", "lower_bound", "upper_bound")
BOUNDS_COLUMNS = ("step", *BOUNDS_HEADLINE)


def artifact_key(run_id: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in run_id.lower())[:60]


def metric_points(table: str, rows: pa.Table) -> list[tuple[int, str, float]]:
    """``(step, name, value)`` for each numeric cell of ``steps``/``bounds``/``eval_scores`` rows.

    Names are grouped the way trackers show them: ``clip/`` (clip shares and
    the bounds in force), ``train/`` (every other ``steps`` column),
    ``calibration/`` (``bounds``), ``eval/<benchmark>/<metric>`` with ``@k``
    spelled out (``avg@2``). Nulls are skipped.
    """
    out: list[tuple[int, str, float]] = []
    if rows.num_rows == 0:
        return out
    for row in rows.to_pylist():
        step = int(row["step"])
        if table == "eval_scores":
            if row.get("value") is not None:
                metric = str(row["metric"])
                if metric.endswith("@k") and row.get("k") is not None:
                    metric = f"{metric[:-1]}{int(row['k'])}"  # avg@k, k=2 -> avg@2
                out.append((step, f"eval/{row['benchmark']}/{metric}", float(row["value"])))
            continue
        if table not in ("steps", "bounds"):
            continue
        for name, v in row.items():
            if name in _KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if table == "bounds":
                out.append((step, f"calibration/{name}", float(v)))
            else:
                group = "clip" if name.startswith(_CLIP) else "train"
                out.append((step, f"{group}/{name}", float(v)))
    return out


def live_rows(run_dir: str | Path, table: str, *, from_step: int = 0, to_step: int | None = None) -> pa.Table:
    """The live main-variant Parquet rows of ``table`` with ``from_step <= step <= to_step``."""
    import pyarrow.parquet as pq

    from storage.parts.writer import TableWriter
    from storage.tables.spec import MAIN_VARIANT

    parts = []
    # a part's step and variant are in its path: read only the files in range (publishing a
    # step's row after every step must not read every earlier step's file: O(steps) per step)
    for p in TableWriter(run_dir, durable=False).live_parts(table):
        if p.step < from_step or (to_step is not None and p.step > to_step) or p.name.variant != MAIN_VARIANT:
            continue
        t = pq.read_table(p.path)
        if t.num_rows and t.column("variant")[0].as_py() == MAIN_VARIANT:
            parts.append(t)
    if not parts:
        return pa.table({"step": pa.array([], pa.int64())})
    return pa.concat_tables(parts, promote_options="permissive").sort_by("step")


def _num(v: Any) -> Any:
    if isinstance(v, float):
        return None if not math.isfinite(v) else round(v, 6)
    return v


def publish_step(ctx: Any, step: int) -> None:
    """A table artifact with the step's metrics (from its live ``steps`` row)."""
    try:
        from prefect.artifacts import create_table_artifact

        rows = live_rows(ctx.run_dir, "steps", from_step=step, to_step=step)
        points = metric_points("steps", rows)
        create_table_artifact(
            key=f"steps-{artifact_key(ctx.run_id)}",
            table=[{"step": s, "metric": n, "value": _num(v)} for s, n, v in points],
            description=f"Metrics of step {step} (the `steps` table row)",
        )
    except Exception:  # artifacts are a convenience; never fail a stage on them
        log.debug("step artifact not created", exc_info=True)


def publish_bounds(ctx: Any, step: int) -> None:
    """After a calibration: the bounds history as a table and a markdown summary of it."""
    try:
        from prefect.artifacts import create_markdown_artifact, create_table_artifact

        rows = live_rows(ctx.run_dir, "bounds", to_step=step).to_pylist()
        hist = [{c: _num(r.get(c)) for c in BOUNDS_COLUMNS} for r in rows]
        key = artifact_key(ctx.run_id)
        create_table_artifact(
            key=f"bounds-history-{key}",
            table=hist,
            description=f"Calibration history up to step {step} (the `bounds` table)",
        )
        lines = [
            f"### Calibrated clipping, run `{ctx.run_id}`",
            "",
            "| step | mode | alpha | L | H | balance before | after |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in hist:
            lines.append(
                f"| {r['step']} | {r['mode']} | {_fmt(r['alpha'])} | {_fmt(r['lower'])} | {_fmt(r['upper'])}"
                f" | {_fmt(r['balance_before'])} | {_fmt(r['balance_after'])} |"
            )
        if hist:
            last = hist[-1]
            lines += ["", f"In force from step {step + 1}: **L = {_fmt(last['lower'])}, H = {_fmt(last['upper'])}**."]
        create_markdown_artifact(
            key=f"bounds-summary-{key}", markdown="\n".join(lines), description="Bounds history summary"
        )
    except Exception:
        log.debug("bounds artifacts not created", exc_info=True)


def publish_failure(env: Any, stage: str, step: int, err: BaseException) -> None:
    """A failed attempt's reason: a WARNING in the task run's logs and a markdown artifact.

    Prefect's own retry message is an INFO log and its ``AwaitingRetry`` state
    carries no reason; this makes the reason of every failed attempt (retried
    or final) visible in the UI.
    """
    try:
        from prefect import get_run_logger
        from prefect.artifacts import create_markdown_artifact

        reason = f"{type(err).__name__}: {str(err)[:500]}"
        attempt = env.ledger.next_attempt(step, stage, variant=env.variant) - 1  # the ledger holds the failed one
        get_run_logger().warning("%s-step-%s attempt %s failed: %s", stage, step, attempt, reason)
        create_markdown_artifact(
            key=f"failures-{artifact_key(env.run_id)}",
            markdown=f"**{stage}** of step {step}, attempt {attempt} failed:\n\n```\n{reason}\n```",
            description=f"Failed attempt: {stage}-step-{step} (attempt {attempt})",
        )
    except Exception:
        log.debug("failure artifact not created", exc_info=True)


def _fmt(v: Any) -> str:
    return "–" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))
