"""``fp8rl sweep``: a matrix of campaigns, resumable, ending in one comparison table.

The sweep file, its cells and their states are :mod:`flows.sweep_spec`; the
comparison table is :mod:`flows.sweep_table`; this module runs the cells.

Layout: cell ``fp8-tensorwise.calibrated.s0`` runs in
``<sweep dir>/fp8-tensorwise.calibrated.s0/`` (a normal run directory: the
sweep dir is a root the catalog, ``fp8rl query`` and ``fp8rl report`` take
as is). ``<sweep dir>/_cells/<cell>.json`` marks a finished cell;
``table.csv`` / ``table.md`` hold the comparison (the ``paper-table`` query
joined with the cell labels), ``report/`` the figures.

Resume: re-running the same file skips finished cells (marker, or a ledger
whose final step has every stage done), resumes interrupted ones
(``resume=True``: restore the newest checkpoint, replay from the ledger) and
starts the others. A cell whose run directory was made by another config
(the sweep file changed) is an error naming it, never silently mixed.

The campaign is injected (:data:`CampaignFn`): the CLI passes
:func:`prefect_campaign` — each cell a Prefect subflow of :data:`sweep_flow`
calling ``flows.campaign.campaign_flow`` — and tests pass a cheap fake.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from flows.sweep_spec import (
    FINISHED,
    NEW,
    PARTIAL,
    Cell,
    CellOutcome,
    SweepSpec,
    cell_state,
    default_sweep_dir,
    load_sweep,
    marker_path,
    select_cells,
)
from flows.sweep_table import comparison_table, write_tables
from storage.layout import config_hash, write_text_atomic

CampaignFn = Callable[[str, bool], dict]  # (run_dir, resume) -> campaign_flow's summary


# --------------------------------------------------------------------------- running


def prefect_campaign(run_dir: str, resume: bool) -> dict:
    """The real campaign: ``campaign_flow`` as a Prefect subflow named after the cell."""
    from flows.campaign import campaign_flow

    return campaign_flow.with_options(flow_run_name=Path(run_dir).name)(run_dir, resume=resume)


def run_cell(sweep_dir: Path, cell: Cell, campaign: CampaignFn) -> CellOutcome:
    """Run, resume or skip one cell; write its marker after success."""
    from storage.layout import create_run

    run_dir = Path(sweep_dir) / cell.id
    state = cell_state(sweep_dir, cell)
    if state == FINISHED:
        if not marker_path(sweep_dir, cell).is_file():  # finished, killed before its marker: write it now
            _write_marker(sweep_dir, cell, {"from": "ledger"}, 0.0)
        return CellOutcome(cell, run_dir, "skipped")
    if state == NEW:
        create_run(sweep_dir, cell.id, config=cell.config_text)
    t0 = time.perf_counter()
    try:
        result = campaign(str(run_dir), state == PARTIAL)
    except Exception as err:  # KeyboardInterrupt / SystemExit propagate: the sweep stops, resumable
        return CellOutcome(
            cell,
            run_dir,
            "failed",
            state == PARTIAL,
            time.perf_counter() - t0,
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
        )
    seconds = time.perf_counter() - t0
    _write_marker(sweep_dir, cell, result, seconds)
    return CellOutcome(cell, run_dir, "done", state == PARTIAL, seconds, result=dict(result or {}))


def _write_marker(sweep_dir: Path, cell: Cell, result: dict, seconds: float) -> None:
    path = marker_path(sweep_dir, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "cell": cell.id,
        "labels": dict(cell.labels),
        "seed": cell.seed,
        "seconds": seconds,
        "config_hash": config_hash(cell.config_text),
        "result": result,
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_text_atomic(path, json.dumps(body, indent=1, default=str) + "\n")


def run_sweep(
    spec: SweepSpec,
    cells: list[Cell],
    sweep_dir: str | Path,
    *,
    campaign: CampaignFn,
    fail_fast: bool = False,
    echo: Callable[[str], None] = print,
) -> list[CellOutcome]:
    """Every cell in order: skip finished ones, resume partial ones, start the rest.

    A failing cell is reported and the sweep goes on (``fail_fast`` stops it);
    an interrupt stops it at once — re-running resumes where it stopped.
    """
    sweep_dir = Path(sweep_dir)
    states = {c.id: cell_state(sweep_dir, c) for c in cells}  # every config check before any work
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(sweep_dir / "sweep.json", json.dumps(spec.model_dump(mode="json"), indent=1) + "\n")
    outcomes = []
    for i, cell in enumerate(cells, start=1):
        head = f"[{i}/{len(cells)}] {cell.id}"
        if states[cell.id] != FINISHED:
            echo(f"{head}: {'resuming' if states[cell.id] == PARTIAL else 'starting'}")
        out = run_cell(sweep_dir, cell, campaign)
        outcomes.append(out)
        if out.status == "skipped":
            echo(f"{head}: finished earlier, skipped")
        elif out.status == "done":
            echo(f"{head}: done in {out.seconds:.0f} s")
        else:
            echo(f"{head}: FAILED after {out.seconds:.0f} s: {out.error}")
            if fail_fast:
                break
    return outcomes


# --------------------------------------------------------------------------- entry points


def run_sweep_file(
    sweep_file: str | Path,
    out: str | Path | None = None,
    *,
    campaign: CampaignFn | None = None,
    fail_fast: bool = False,
    report: bool = True,
    echo: Callable[[str], None] = print,
    only: tuple[str, ...] | list[str] | None = None,
) -> dict:
    """Load, run (or resume) a sweep, then write its table and report; returns a summary.

    ``campaign``: how a cell runs (default :func:`prefect_campaign`, looked up at call time).
    ``only``: globs over cell ids (:func:`select_cells`); the other cells are not run, and the
    table still lists every cell with its state.
    """
    campaign = campaign or prefect_campaign
    spec, cells = load_sweep(sweep_file)
    chosen = select_cells(cells, only, source=str(sweep_file))
    sweep_dir = Path(out) if out is not None else default_sweep_dir(spec, cells)
    part = f" ({len(chosen)} selected)" if len(chosen) != len(cells) else ""
    echo(f"sweep {spec.name}: {len(cells)} cell(s){part} in {sweep_dir}")
    outcomes = run_sweep(spec, chosen, sweep_dir, campaign=campaign, fail_fast=fail_fast, echo=echo)
    rows = comparison_table(sweep_dir, spec, cells, outcomes)
    echo("\n" + write_tables(sweep_dir, spec, rows))
    echo(f"table: {sweep_dir / 'table.csv'}, {sweep_dir / 'table.md'}")
    if report and any(o.status != "failed" for o in outcomes):
        from flows.report import build_report

        rep = build_report([sweep_dir], sweep_dir / "report")
        echo(f"report: {rep.index}")
    return {
        "sweep_dir": str(sweep_dir),
        "cells": {o.cell.id: o.status for o in outcomes},
        "failed": [o.cell.id for o in outcomes if o.status == "failed"],
        "unfinished": [c.id for c in chosen[len(outcomes) :]],
    }


def _sweep_flow(
    sweep_file: str, out: str | None = None, fail_fast: bool = False, report: bool = True, only: list[str] | None = None
) -> dict:
    """Prefect flow: run a sweep; each cell's ``campaign_flow`` is a subflow of this one."""
    return run_sweep_file(sweep_file, out, fail_fast=fail_fast, report=report, only=only)


_FLOW = None


def __getattr__(name: str):
    """``sweep_flow``, the Prefect flow, built on first use (PEP 562).

    Importing Prefect costs ~2 s and configures its home; loading, checking and
    listing a sweep (``--dry-run``, tests) need neither.
    """
    global _FLOW
    if name != "sweep_flow":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _FLOW is None:
        from flows.prefect_env import configure_prefect_env

        configure_prefect_env()
        from prefect import flow

        _FLOW = flow(name="fp8rl-sweep", persist_result=False, validate_parameters=False, log_prints=False)(_sweep_flow)
    return _FLOW
