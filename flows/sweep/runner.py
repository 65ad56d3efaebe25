"""``fp8rl sweep``: a matrix of campaigns, resumable, ending in one comparison table.

The sweep file and its cells are :mod:`flows.sweep.spec`, their states and what is
re-checked about them each time the sweep opens :mod:`flows.sweep.state`; the
comparison table is :mod:`flows.sweep.table`; this module runs the cells.

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
(the sweep file changed), a twin or a choice the file no longer gives, is an
error naming it, never silently mixed (:mod:`flows.sweep.state`).

A sweep keeps the run's protections: the cells it selected are locked against a
second sweep on the directory (:mod:`flows.sweep.lock`); each cell passes ``fp8rl
run``'s memory refusal before anything is written (:func:`refuse_too_large`); and
once SIGINT or SIGTERM has come no later cell starts (the command ends through
the run's shutdown path, :func:`flows.campaign.launch.until_signal`).

Every cell records the code it ran on: each start or resume appends the commit (and
whether the checkout had uncommitted changes) to ``_cells/<cell>.starts.jsonl`` -- the
commit when the sweep's process ran its first cell, the code it has loaded -- and the
marker holds those commits and the run's numerics fingerprint (a hash of ``run.json``'s CPU
numerics and layer precision with the torch, transformers and torchao versions, less what cannot
change a bit: :func:`arithmetic_of`), so cells that ran on different numerics are told apart, and
cells that ran on the same numerics on different CPUs are not.

A sweep with a ``choose:`` block (:mod:`flows.sweep.choice`) runs the pilot's cells first,
makes each choice once its pilot has finished, then runs the cells that waited for it.

The campaign is injected (:data:`CampaignFn`): the CLI passes
:func:`prefect_campaign` — each cell a Prefect subflow of :data:`sweep_flow`
calling ``flows.campaign.flow.campaign_flow`` — and tests pass a cheap fake.
"""

from __future__ import annotations

import fnmatch
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from flows.campaign.configuration import ConfigError
from flows.plan.fit import memory_refusal
from flows.sweep.choice import choice_markdown, make_choice, read_choices
from flows.sweep.lock import cells_held, choice_held
from flows.sweep.spec import Cell, SweepSpec, load_sweep, open_sweep, select_cells, waiting_cell_ids
from flows.sweep.state import (
    FINISHED,
    NEW,
    PARTIAL,
    CellOutcome,
    cell_state,
    check_cells,
    marker_path,
    run_name,
    twins,
)
from flows.sweep.table import comparison_table, write_tables
from storage.run.layout import config_hash, write_text_atomic

CampaignFn = Callable[[str, bool], dict]  # (run_dir, resume) -> campaign_flow's summary


# --------------------------------------------------------------------------- running


def prefect_campaign(run_dir: str, resume: bool) -> dict:
    """The real campaign: ``campaign_flow`` as a Prefect subflow named after the cell."""
    from flows.campaign.flow import campaign_flow

    return campaign_flow.with_options(flow_run_name=Path(run_dir).name)(run_dir, resume=resume)


def run_cell(sweep_dir: Path, cell: Cell, campaign: CampaignFn, twin: Cell | None = None) -> CellOutcome:
    """Run, resume or skip one cell; write its marker after success. ``twin``: a finished cell with the
    same config (:func:`flows.sweep.state.twins`): a new cell then reads its run instead of running."""
    from storage.run.layout import create_run

    run_dir = Path(sweep_dir) / cell.id
    state = cell_state(sweep_dir, cell)
    if state == FINISHED:
        if not marker_path(sweep_dir, cell).is_file():  # finished, killed before its marker: write it now
            _write_marker(sweep_dir, cell, {"from": "ledger"}, 0.0)
        return CellOutcome(cell, Path(sweep_dir) / run_name(sweep_dir, cell), "skipped")
    if state == NEW and twin is not None:
        _write_twin_marker(sweep_dir, cell, twin)
        return CellOutcome(cell, Path(sweep_dir) / twin.id, "same")
    if state == NEW:
        create_run(sweep_dir, cell.id, config=cell.config_text)
    _record_start(sweep_dir, cell)
    t0 = time.perf_counter()
    try:
        result = campaign(str(run_dir), state == PARTIAL)
    except Exception as err:  # KeyboardInterrupt / SystemExit propagate: the sweep stops, resumable
        if _signalled() is not None:  # Prefect's SIGTERM bridge ended the cell: the sweep ends, not the cell
            raise
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


def code_identity() -> dict:
    """The commit of this checkout and whether it has uncommitted changes (None outside git)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        git = {"cwd": root, "capture_output": True, "text": True, "timeout": 10}
        head = subprocess.run(["git", "rev-parse", "HEAD"], **git)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **git)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    if head.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def numerics_fingerprint(run_dir: Path) -> dict:
    """A short hash of what decides a run's arithmetic: ``run.json``'s CPU numerics and layer precision,
    and the versions of torch, transformers and torchao; with the parts it describes (as recorded).

    Only what changes the bits is hashed (:func:`arithmetic_of`): not the words that explain a choice, and
    for the ``portable`` GEMMs not the CPU's name nor whether the compiled kernels ran, since those give
    the same numbers on every x86-64 CPU with AVX2. Two cells of one config then share a fingerprint
    wherever they ran, and differ where their arithmetic can."""
    from importlib import metadata

    from storage.run.layout import RUN_FILE

    try:
        info = json.loads((Path(run_dir) / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        info = {}
    parts = {
        "cpu_numerics": info.get("cpu_numerics"),
        "layer_precision": info.get("layer_precision"),
        "versions": {p: _version(metadata, p) for p in ("torch", "transformers", "torchao")},
    }
    return {"fingerprint": fingerprint_of(parts), **parts}


def fingerprint_of(parts: dict) -> str:
    """The 12-hex-digit hash of :func:`arithmetic_of` ``parts``."""
    import hashlib

    return hashlib.sha256(json.dumps(arithmetic_of(parts), sort_keys=True, default=str).encode()).hexdigest()[:12]


def arithmetic_of(parts: dict) -> dict:
    """``parts`` (``cpu_numerics``, ``layer_precision``, ``versions``) without what cannot change a bit:
    every ``reason`` (the words of an ``auto`` choice, which name the CPU's instructions), the setting that
    led to a GEMM kind (``auto`` or the kind itself), and where the kind is ``portable`` the CPU's name and
    ``exact_gemm_kernels`` (the compiled kernels and the tensor path give the same bits)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "reason"}
        return value

    out = strip(json.loads(json.dumps(parts, default=str)))
    cpu = out.get("cpu_numerics")
    if isinstance(cpu, dict):
        gemm = cpu.get("bf16_gemm")
        if isinstance(gemm, dict):
            gemm.pop("setting", None)
            if gemm.get("kind") == "portable":
                cpu.pop("cpu", None)
                cpu.pop("exact_gemm_kernels", None)
    return out


def _version(metadata, package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _starts_path(sweep_dir: Path, cell: Cell) -> Path:
    return marker_path(sweep_dir, cell).with_name(f"{cell.id}.starts.jsonl")


_LOADED_CODE: dict = {}  # the checkout's commit when this process first ran a cell: the code it has loaded


def _record_start(sweep_dir: Path, cell: Cell) -> None:
    path = _starts_path(sweep_dir, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not _LOADED_CODE:  # a later commit in the checkout is not what this process runs
        _LOADED_CODE.update(code_identity())
    line = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **_LOADED_CODE}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def _starts(sweep_dir: Path, cell: Cell) -> list[dict]:
    path = _starts_path(sweep_dir, cell)
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def _write_marker(sweep_dir: Path, cell: Cell, result: dict, seconds: float) -> None:
    starts = _starts(sweep_dir, cell)
    _save_marker(sweep_dir, cell, seconds, {
        "commits": list(dict.fromkeys(s["commit"] for s in starts)),
        "uncommitted_changes": any(s.get("dirty") for s in starts),
        "numerics": numerics_fingerprint(Path(sweep_dir) / cell.id),
        "result": result,
    })  # fmt: skip


def _write_twin_marker(sweep_dir: Path, cell: Cell, twin: Cell) -> None:
    """The marker of a cell not run because ``twin`` ran its very config: the twin's result and code."""
    try:
        theirs = json.loads(marker_path(sweep_dir, twin).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        theirs = {}
    ran = {k: theirs.get(k) for k in ("commits", "uncommitted_changes", "numerics", "result")}
    _save_marker(sweep_dir, cell, 0.0, {"same_as": twin.id, **ran})


def _save_marker(sweep_dir: Path, cell: Cell, seconds: float, fields: dict) -> None:
    """``_cells/<cell>.json``: the cell, its labels, seed, seconds and config hash, then ``fields``."""
    path = marker_path(sweep_dir, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "cell": cell.id,
        "labels": dict(cell.labels),
        "seed": cell.seed,
        "seconds": seconds,
        "config_hash": config_hash(cell.config_text),
        **fields,
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
    twin_of: dict[str, Cell] | None = None,
    check_memory: bool = True,
) -> list[CellOutcome]:
    """Every cell in order: skip finished ones, resume partial ones, start the rest.

    A failing cell is reported and the sweep goes on (``fail_fast`` stops it);
    an interrupt stops it at once, and no later cell starts — re-running resumes where it stopped.
    ``twin_of``: cell id -> the earlier cell with its very config; a twin whose counterpart finished
    is not run again. ``check_memory``: each cell to run passes ``fp8rl run``'s memory refusal first.
    """
    sweep_dir = Path(sweep_dir)
    states = check_cells(sweep_dir, cells)  # every check before any work
    if check_memory:
        refuse_too_large([c for c in cells if states[c.id] != FINISHED])
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(sweep_dir / "sweep.json", json.dumps(spec.model_dump(mode="json"), indent=1) + "\n")
    outcomes = []
    for i, cell in enumerate(cells, start=1):
        _stop_if_signalled()
        head = f"[{i}/{len(cells)}] {cell.id}"
        twin = (twin_of or {}).get(cell.id)
        twin = twin if twin is not None and cell_state(sweep_dir, twin) == FINISHED else None  # it may have failed
        if states[cell.id] != FINISHED and not (twin and states[cell.id] == NEW):
            echo(f"{head}: {'resuming' if states[cell.id] == PARTIAL else 'starting'}")
        out = run_cell(sweep_dir, cell, campaign, twin)
        outcomes.append(out)
        if out.status == "skipped":
            echo(f"{head}: finished earlier, skipped")
        elif out.status == "same":
            echo(f"{head}: the same config as {out.run_dir.name}, which has run it: not run again")
        elif out.status == "done":
            echo(f"{head}: done in {out.seconds:.0f} s")
        else:
            echo(f"{head}: FAILED after {out.seconds:.0f} s: {out.error}")
            if fail_fast:
                break
    return outcomes


def _signalled() -> int | None:
    """SIGINT or SIGTERM delivered to this process inside the command's shutdown path
    (:mod:`flows.process.shutdown`)."""
    from flows.process.shutdown import received

    return received()


def _stop_if_signalled() -> None:
    """No cell starts once a signal has come, whichever handler took it (Prefect's own SIGTERM bridge inside
    a flow turns it into an exception a cell's campaign may have ended with)."""
    signum = _signalled()
    if signum is not None:
        from flows.process.shutdown import Interrupted

        raise Interrupted(signum)


def refuse_too_large(cells: list[Cell]) -> None:
    """ConfigError naming the first of ``cells`` whose model ``fp8rl run`` would refuse (one check per model)."""
    seen: dict[str, str | None] = {}
    for c in cells:
        key = json.dumps([c.config.model.model_dump(mode="json"), c.config.device], sort_keys=True, default=str)
        if key not in seen:
            seen[key] = memory_refusal(c.config, 1)
        if seen[key]:
            raise ConfigError(f"cell {c.id}: {seen[key]}")


# --------------------------------------------------------------------------- entry points


@dataclass(frozen=True)
class OpenSweep:
    """A sweep file as its directory holds it (:func:`opened_sweep`)."""

    spec: SweepSpec
    cells: list[Cell]  # those that can run: the pilots, and the matrix cells whose choices are made
    sweep_dir: Path
    waiting: list[str]  # ids of the cells still waiting for a pilot's choice
    chosen: list[Cell]  # the cells selected by ``only``
    states: dict[str, str]  # cell id -> state, every cell checked


@contextmanager
def opened_sweep(
    sweep_file: str | Path, out: str | Path | None = None, only: list[str] | tuple[str, ...] | None = None,
    *, check_memory: bool = True,
) -> Iterator[OpenSweep]:  # fmt: skip
    """Open a sweep to run it: every cell, twin and choice checked against the file and the runs they name
    (:mod:`flows.sweep.state`), the selected cells locked against a second sweep (:mod:`flows.sweep.lock`)
    for the block, and, with ``check_memory``, each selected cell to run passed through ``fp8rl run``'s
    memory refusal. Any refusal is one line (ConfigError, RunLocked); the locks are the first thing written."""
    spec, cells, sweep_dir, waiting = open_sweep(sweep_file, out)
    chosen = select_cells(cells, only, source=str(sweep_file), waiting=waiting)
    chosen_waiting = [i for i in waiting if not only or any(fnmatch.fnmatchcase(i, p) for p in only)]
    states = check_cells(sweep_dir, cells)
    if check_memory:
        refuse_too_large([c for c in chosen if states[c.id] != FINISHED])
    with cells_held(sweep_dir, [*(c.id for c in chosen), *chosen_waiting]):  # (each run re-checks under them)
        yield OpenSweep(spec, cells, sweep_dir, waiting, chosen, states)


def run_sweep_file(
    sweep_file: str | Path,
    out: str | Path | None = None,
    *,
    campaign: CampaignFn | None = None,
    fail_fast: bool = False,
    report: bool = True,
    echo: Callable[[str], None] = print,
    only: tuple[str, ...] | list[str] | None = None,
    check_memory: bool = True,
) -> dict:
    """Load, check, run (or resume) a sweep, then write its table and report; returns a summary.

    ``campaign``: how a cell runs (default :func:`prefect_campaign`, looked up at call time).
    ``only``: globs over cell ids (:func:`select_cells`); the other cells are not run, and the
    table still lists every cell with its state. ``check_memory``: :func:`opened_sweep`.
    """
    campaign = campaign or prefect_campaign
    with opened_sweep(sweep_file, out, only, check_memory=check_memory) as opened:
        return _run_opened(opened, sweep_file, campaign, fail_fast, report, echo, only, check_memory)


def _run_opened(opened: OpenSweep, sweep_file, campaign, fail_fast, report, echo, only, check_memory) -> dict:
    spec, cells, sweep_dir, waiting, chosen = opened.spec, opened.cells, opened.sweep_dir, opened.waiting, opened.chosen
    total = len(cells) + len(waiting)
    part = f" ({len(chosen)} selected)" if only else ""
    wait = f", {len(waiting)} waiting for a pilot's choice" if waiting else ""
    echo(f"sweep {spec.name}: {total} cell(s){part}{wait} in {sweep_dir}")
    # the pilots first, then the choices they decide, then the matrix in file order
    run = {"campaign": campaign, "fail_fast": fail_fast, "echo": echo, "check_memory": check_memory}
    outcomes = run_sweep(spec, [c for c in chosen if c.pilot], sweep_dir, **run)
    if not (fail_fast and any(o.status == "failed" for o in outcomes)):
        if waiting:  # a choice whose pilot has finished is made now, once
            _stop_if_signalled()
            spec, cells = _make_choices(sweep_file, spec, cells, sweep_dir, echo)
            waiting = waiting_cell_ids(spec, read_choices(sweep_dir, spec.choose))
        rest = [c for c in select_cells(cells, only, source=str(sweep_file), waiting=waiting) if not c.pilot]
        by_id = {c.id: c for c in cells}
        twin_of = {i: by_id[t] for i, t in twins([c for c in cells if not c.pilot]).items()}
        outcomes += run_sweep(spec, rest, sweep_dir, twin_of=twin_of, **run)
    _stop_if_signalled()
    matrix = [c for c in cells if c.pilot is None]
    rows = comparison_table(sweep_dir, spec, matrix, [o for o in outcomes if o.cell.pilot is None])
    pilots = "".join("\n" + choice_markdown(r) for r in read_choices(sweep_dir, spec.choose).values())
    echo("\n" + write_tables(sweep_dir, spec, rows, extra=pilots))
    echo(f"table: {sweep_dir / 'table.csv'}, {sweep_dir / 'table.md'}")
    if report and any(o.status != "failed" for o in outcomes):
        from flows.report.page import build_report

        rep = build_report([sweep_dir], sweep_dir / "report")
        echo(f"report: {rep.index}")
    ran = {o.cell.id for o in outcomes}
    return {
        "sweep_dir": str(sweep_dir),
        "cells": {o.cell.id: o.status for o in outcomes},
        "failed": [o.cell.id for o in outcomes if o.status == "failed"],
        "unfinished": [c.id for c in select_cells(cells, only, waiting=waiting) if c.id not in ran],
    }


def _make_choices(sweep_file, spec, cells: list[Cell], sweep_dir: Path, echo) -> tuple:
    """Make every choice whose pilot has finished and is not made yet; returns the sweep reloaded
    (its cells now include those whose choice is made). Another part of the sweep that finishes the
    pilot at the same time waits for the choice's lock and then finds the choice made."""
    for name, choice in spec.choose.items():
        pilot = [c for c in cells if c.pilot == name]
        if any(cell_state(sweep_dir, c) != FINISHED for c in pilot):
            continue
        with choice_held(sweep_dir, name):
            if name in read_choices(sweep_dir, {name: choice}):
                continue
            runs: dict[str, list[str]] = {}
            for c in pilot:
                runs.setdefault(dict(c.labels)["candidate"], []).append(c.id)
            record = make_choice(sweep_dir, name, choice, runs, code_identity())
        echo(f"choice {name}: {record['winner']} (rule {choice.rule}; _choices/{name}.json)")
    return load_sweep(sweep_file, sweep_dir)


def _sweep_flow(
    sweep_file: str,
    out: str | None = None,
    fail_fast: bool = False,
    report: bool = True,
    only: list[str] | None = None,
    check_memory: bool = True,
) -> dict:
    """Prefect flow: run a sweep; each cell's ``campaign_flow`` is a subflow of this one."""
    return run_sweep_file(sweep_file, out, fail_fast=fail_fast, report=report, only=only, check_memory=check_memory)


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
        from flows.orchestration.env import configure_prefect_env

        configure_prefect_env()
        from prefect import flow

        _FLOW = flow(name="fp8rl-sweep", persist_result=False, validate_parameters=False, log_prints=False)(_sweep_flow)
    return _FLOW
