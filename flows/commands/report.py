"""``fp8rl report`` and ``fp8rl sweep``: look at campaigns, and run a matrix of them.

    fp8rl report runs/tiny-cpu-20260101-120000            # -> runs/tiny-cpu-.../report/index.html
    fp8rl report runs/a runs/b --out reports/a-vs-b       # runs overlaid
    fp8rl sweep configs/sweeps/paper-tiny.yaml            # -> runs/sweeps/paper-tiny/{table.md,report/}
    fp8rl sweep configs/sweeps/paper-tiny.yaml --dry-run  # the cells and their state; runs nothing

User errors (no run there, a bad sweep file, a sweep directory holding runs of
another config, a cell another sweep is running, a model too large for the
machine) print one line ``error: ...`` and exit 2; a sweep with a failed cell
exits 1 after running the others. SIGINT and SIGTERM end a sweep the way they
end a run (:mod:`flows.process.shutdown`): one line, exit 130 / 143, no later cell.
Heavy imports (matplotlib, Prefect) happen only when a command runs.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Optional

import typer

from flows.commands.common import fail as _fail
from flows.commands.common import io_errors, refuse_run_paths


def report_command(
    roots: list[Path] = typer.Argument(
        ..., help="Run directories, or folders of run directories; their runs are overlaid."
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Output folder (default: ROOT/report for one root, ./report-<time> for several)."
    ),
) -> None:
    """Build an HTML report (figures + the SQL behind each, comparison table) of one or more runs."""
    from flows.report.figures import paper_table_markdown
    from flows.report.page import build_report
    from storage.errors import StorageError

    if out is None:
        out = roots[0] / "report" if len(roots) == 1 else Path(f"report-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    refuse_run_paths(out, own="report")  # (the default, ROOT/report, is the report's own folder)
    try:
        with io_errors(out):  # an --out below a file, a full disk: one line
            rep = build_report(roots, out)
    except StorageError as err:
        raise _fail(str(err))
    empty = [f.figure.name for f in rep.figures if f.png is None]
    drawn = len(rep.figures) - len(empty)
    typer.echo(
        f"{len(rep.runs)} run(s), {drawn} figure(s) with data" + (f"; no data: {', '.join(empty)}" if empty else "")
    )
    typer.echo(paper_table_markdown(rep.table.to_pylist(), ["run_id"]))
    for path, why in rep.problems:
        typer.echo(f"warning: {path}: {why}", err=True)
    typer.echo(f"wrote {rep.index} in {rep.seconds:.1f} s")


def _dry_run(sweep_file: Path, out: Path | None, cells: list[str] | None) -> None:
    """``fp8rl sweep --dry-run``: the cells, their state, the choices made and the cells waiting for one,
    after the same checks as a run (twins, choices, finished cells against the file and their runs)."""
    import fnmatch

    from flows.sweep.choice import read_choices
    from flows.sweep.spec import open_sweep, select_cells
    from flows.sweep.state import check_cells, twins

    spec, every, sweep_dir, waiting = open_sweep(sweep_file, out)
    made = read_choices(sweep_dir, spec.choose)
    chosen = select_cells(every, cells, source=str(sweep_file), waiting=waiting)
    states = check_cells(sweep_dir, every)
    total = len(every) + len(waiting)
    if cells:
        waiting = [i for i in waiting if any(fnmatch.fnmatchcase(i, p) for p in cells)]
    part = f" ({len(chosen) + len(waiting)} selected)" if cells else ""
    typer.echo(f"sweep {spec.name}: {total} cell(s){part} in {sweep_dir}")
    if spec.description:
        typer.echo(f"  {spec.description}")
    for name, record in made.items():
        typer.echo(f"  choice {name}: {record['winner']} (made {record['made_at']})")
    twin_of = twins([c for c in every if not c.pilot])
    for c in chosen:
        cfg = c.config
        twin = f" (the config of {twin_of[c.id]}: read, not run again)" if c.id in twin_of else ""
        typer.echo(
            f"  {c.id:<36} {states[c.id]:<9} train={cfg.precision.train} "
            f"rollout={cfg.precision.rollout} clip={cfg.calibration.mode} seed={cfg.seed} "
            f"steps={cfg.steps}{twin}"
        )
    for i in waiting:
        typer.echo(f"  {i:<36} waiting   for its pilot's choice")


def _continue_command(sweep_file: Path, out: Path | None, cells: list[str] | None) -> str:
    """The command that continues an interrupted sweep."""
    where = ["--out", str(out)] if out else []
    return " ".join(["fp8rl sweep", str(sweep_file), *where, *[f"--cells '{c}'" for c in cells or []]])


def _run_sweep(sweep_file: Path, out: Path | None, cells: list[str] | None, **options) -> dict:
    """The sweep's flow through the run's one shutdown path (:func:`flows.campaign.launch.until_signal`):
    Prefect's temporary server in a session of its own, stopped last; SIGINT or SIGTERM end the cell in
    flight and every process below this one, start no later cell, and end the command in one line,
    exit 130 / 143 (:class:`flows.process.shutdown.RunEnded`, which ``fp8rl``'s entry point exits with)."""
    from flows.campaign.launch import until_signal

    def body(start_server) -> dict:
        from flows.orchestration.env import quiet_console_failures
        from flows.sweep.runner import sweep_flow

        start_server()
        quiet_console_failures()  # a failed cell is the sweep's one line, not Prefect's tracebacks
        return sweep_flow(str(sweep_file), None if out is None else str(out), only=list(cells or []), **options)

    return until_signal(body, resume=_continue_command(sweep_file, out, cells))


def sweep_command(
    sweep_file: Path = typer.Argument(..., help="Sweep YAML (see configs/sweeps/paper-tiny.yaml)."),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="Sweep directory (default: <runs_root>/sweeps/<name>)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="List the cells and their state (new, partial, finished); run nothing."
    ),
    fail_fast: bool = typer.Option(
        False, "--fail-fast", help="Stop at the first failed cell (default: run the others)."
    ),
    report: bool = typer.Option(True, "--report/--no-report", help="Build the sweep's HTML report at the end."),
    cells: Optional[list[str]] = typer.Option(
        None,
        "--cells",
        help="Run only the cells whose id matches this glob "
        "(repeatable), e.g. 'nvfp4.*' or '*.s1': a sweep in parts, "
        "one process or machine per part, into the same directory.",
    ),
    skip_memory_check: bool = typer.Option(
        False, "--skip-memory-check", help="Start cells whose model's training state exceeds the device's memory."
    ),
) -> None:
    """Run a matrix of campaigns (precision x clip mode x seed); re-running skips finished cells."""
    from flows.campaign.configuration import ConfigError
    from storage.errors import StorageError

    try:
        if dry_run:
            _dry_run(sweep_file, out, cells)
            return
        from flows.sweep.runner import opened_sweep

        # every check, the cells' locks and the memory refusal before Prefect starts; the flow keeps the locks
        with opened_sweep(sweep_file, out, cells, check_memory=not skip_memory_check):
            summary = _run_sweep(
                sweep_file, out, cells, fail_fast=fail_fast, report=report, check_memory=not skip_memory_check
            )
    except (ConfigError, StorageError) as err:
        raise _fail(str(err))
    except KeyboardInterrupt:  # an interrupt that is not a signal's: finished cells stay finished
        again = _continue_command(sweep_file, out, cells)
        typer.echo(f"interrupted; `{again}` continues the sweep (finished cells are skipped)", err=True)
        raise typer.Exit(130) from None
    if summary["failed"]:
        typer.echo(
            f"{len(summary['failed'])} cell(s) failed: {', '.join(summary['failed'])}; "
            f"fix and re-run `fp8rl sweep {sweep_file}` (finished cells are skipped)",
            err=True,
        )
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``report`` and ``sweep`` to the ``fp8rl`` app."""
    app.command("report")(report_command)
    app.command("sweep")(sweep_command)
