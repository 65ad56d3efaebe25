"""``fp8rl sweep``: a matrix of campaigns, resumable, ending in one comparison table.

A sweep file names a base preset and axes; each axis maps a *label* to config
overrides, and the cells are the cartesian product of the axes times the
seeds, minus the ``exclude`` patterns (as in a CI build matrix)::

    name: paper-tiny
    base: tiny-cpu                        # preset in configs/ or a YAML path
    overrides: {steps: 40}                # applied to every cell
    axes:
      precision:
        bf16: {precision.train: bf16, precision.rollout: bf16}
        fp8-tensorwise: {precision.train: fp8_tensorwise}
      clip:
        standard: {calibration.mode: standard}
        calibrated: {calibration.mode: calibrated}
    seeds: [0, 1]
    exclude:
      - {precision: bf16, clip: calibrated}    # a value may also be a list of labels

Override keys are dotted config paths (``calibration.mode``); a mapping value
merges into the section. Overrides apply in order: base, ``overrides``, each
axis in file order, then ``seed``. Every cell's config is validated when the
file is loaded, so a typo fails before anything runs, naming the file, the
cell and the key.

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

import copy
import fnmatch
import itertools
import json
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.configuration import ConfigError, config_from_dict, dump_config, resolve_preset
from flows.report_figures import FAILURE_COLUMNS, TABLE_COLUMNS, paper_table_markdown
from fp8rl_core.config.campaign import CampaignConfig
from storage.layout import config_hash, is_run_dir, read_run_info, write_text_atomic

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")  # no '.': it joins labels into cell ids
CELLS_DIR = "_cells"  # '_' cannot start a run id, so the catalog never takes it for a run
CampaignFn = Callable[[str, bool], dict]  # (run_dir, resume) -> campaign_flow's summary


class SweepSpec(BaseModel):
    """A sweep file (``configs/sweeps/*.yaml``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Sweep name; the default sweep directory is <runs_root>/sweeps/<name>.")
    description: str = Field("", description="Free text shown by --dry-run.")
    base: str = Field(
        "tiny-cpu",
        description="Base campaign preset: a name in configs/ or a YAML path "
        "(relative to the sweep file or the working directory).",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted config key -> value, applied to every cell."
    )
    axes: dict[str, dict[str, dict[str, Any]]] = Field(
        description="Axis -> label -> overrides; cells are the product of the axes."
    )
    seeds: list[int] = Field(
        [0], min_length=1, description="Campaign seeds; each cell runs once per seed (sets `seed`)."
    )
    exclude: list[dict[str, str | list[str]]] = Field(
        default_factory=list,
        description="Cells to leave out: axis -> label (or labels); a cell matching every entry of one item is "
        "excluded.",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not LABEL.match(v):
            raise ValueError(f"{v!r} must match {LABEL.pattern}")
        return v

    @field_validator("axes")
    @classmethod
    def _axes(cls, axes: dict) -> dict:
        if not axes:
            raise ValueError("needs at least one axis")
        for axis, values in axes.items():
            if not LABEL.match(axis):
                raise ValueError(f"axis name {axis!r} must match {LABEL.pattern}")
            if not values:
                raise ValueError(f"axis {axis!r} has no labels")
            for label in values:
                if not LABEL.match(label):
                    raise ValueError(f"{axis}.{label}: label must match {LABEL.pattern}")
        return axes

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds repeat: {seeds}")
        return seeds

    @model_validator(mode="after")
    def _exclude(self) -> "SweepSpec":
        for i, pattern in enumerate(self.exclude):
            for axis, labels in pattern.items():
                if axis not in self.axes:
                    raise ValueError(f"exclude.{i}.{axis}: unknown axis; axes: {', '.join(self.axes)}")
                for label in [labels] if isinstance(labels, str) else labels:
                    if label not in self.axes[axis]:
                        raise ValueError(
                            f"exclude.{i}.{axis}: unknown label {label!r}; labels: {', '.join(self.axes[axis])}"
                        )
        return self


@dataclass(frozen=True)
class Cell:
    """One campaign of the matrix: its id (the run directory's name), labels, seed and config."""

    id: str
    labels: tuple[tuple[str, str], ...]  # (axis, label) in axis order
    seed: int
    config: CampaignConfig

    @property
    def config_text(self) -> str:
        return dump_config(self.config)


def _apply(tree: dict, key: str, value: Any, where: str) -> None:
    """Set dotted ``key`` in ``tree``; a mapping value merges into an existing section."""
    *path, last = key.split(".")
    node = tree
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where}: {key}: {part} is not a config section")
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        for k, v in value.items():
            _apply(node[last], k, v, where)
    else:
        node[last] = copy.deepcopy(value)


def _excluded(spec: SweepSpec, labels: dict[str, str]) -> bool:
    def hit(axis: str, want: str | list[str]) -> bool:
        return labels[axis] in ([want] if isinstance(want, str) else want)

    return any(all(hit(a, w) for a, w in pattern.items()) for pattern in spec.exclude)


def expand_cells(spec: SweepSpec, base: dict, *, source: str) -> list[Cell]:
    """The cells of ``spec`` over the ``base`` config tree, each validated."""
    cells = []
    for combo in itertools.product(*(list(v) for v in spec.axes.values())):
        labels = dict(zip(spec.axes, combo))
        if _excluded(spec, labels):
            continue
        for seed in spec.seeds:
            cell_id = ".".join(combo) + f".s{seed}"
            where = f"{source}: cell {cell_id}"
            tree = copy.deepcopy(base)
            for key, value in spec.overrides.items():
                _apply(tree, key, value, f"{source}: overrides")
            for axis, label in labels.items():
                for key, value in spec.axes[axis][label].items():
                    _apply(tree, key, value, f"{source}: axes.{axis}.{label}")
            tree["seed"] = seed
            cfg = config_from_dict(tree, source=where)
            cells.append(Cell(cell_id, tuple(labels.items()), seed, cfg))
    if not cells:
        raise ConfigError(f"{source}: every cell is excluded")
    return cells


def _format_validation(source: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return f"{source}: " + "; ".join(parts)


def load_sweep(path: str | Path) -> tuple[SweepSpec, list[Cell]]:
    """Parse and validate a sweep file and every cell's config; ConfigError names the key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such sweep file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping (name, base, axes, ...)")
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation(str(path), err)) from None
    local = path.parent / spec.base
    base_path = local if local.is_file() else resolve_preset(spec.base)
    try:
        base = yaml.safe_load(base_path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{base_path}: not valid YAML ({str(err).splitlines()[0]})") from None
    return spec, expand_cells(spec, base, source=str(path))


def select_cells(
    cells: list[Cell], patterns: tuple[str, ...] | list[str] | None, *, source: str = "sweep"
) -> list[Cell]:
    """The cells whose id matches any glob in ``patterns`` (all cells when none), in file order.

    For running a sweep in parts (one process or machine per part, the same
    sweep directory): ``--cells 'nvfp4.*' --cells 'bf16.*.s0'``. A pattern
    that matches no cell is a ConfigError naming it and the cells there are.
    """
    if not patterns:
        return list(cells)
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(c.id, pat) for c in cells):
            raise ConfigError(
                f"{source}: --cells {pat!r} matches no cell; the cells are " + ", ".join(c.id for c in cells)
            )
    return [c for c in cells if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]


def default_sweep_dir(spec: SweepSpec, cells: list[Cell]) -> Path:
    return Path(cells[0].config.storage.runs_root) / "sweeps" / spec.name


# --------------------------------------------------------------------------- cell state


NEW, PARTIAL, FINISHED = "new", "partial", "finished"


def marker_path(sweep_dir: Path, cell: Cell) -> Path:
    return Path(sweep_dir) / CELLS_DIR / f"{cell.id}.json"


def ledger_finished(run_dir: Path, cfg: CampaignConfig) -> bool:
    """True when the ledger has every stage of the campaign's final step done."""
    from stages.context import is_checkpoint_step, is_eval_step
    from stages.runtime.io import RunTables, shadow_steps
    from storage.ledger import Ledger

    last = cfg.steps
    need = {"rollout", "score", "train"}
    need |= {"calibrate"} if shadow_steps(RunTables.open(run_dir), [last]) else set()  # what its train stage decided
    need |= {"evaluate"} if is_eval_step(cfg, last) else set()
    need |= {"checkpoint"} if is_checkpoint_step(cfg, last) else set()
    return need <= Ledger(run_dir).done_stages(last)


def cell_state(sweep_dir: Path, cell: Cell) -> str:
    """NEW (no run directory), PARTIAL (started, unfinished) or FINISHED.

    Raises ConfigError if the cell's run directory holds another config's run.
    """
    run_dir = Path(sweep_dir) / cell.id
    if not is_run_dir(run_dir):
        return NEW
    info = read_run_info(run_dir)
    if info.config_hash not in (None, config_hash(cell.config_text)):
        raise ConfigError(
            f"cell {cell.id}: {run_dir} was run with another config (the sweep file changed); "
            "move that directory away or use another --out"
        )
    if marker_path(sweep_dir, cell).is_file() or ledger_finished(run_dir, cell.config):
        return FINISHED
    return PARTIAL


# --------------------------------------------------------------------------- running


@dataclass
class CellOutcome:
    """What happened to a cell in this invocation: 'skipped' (finished earlier), 'done' or 'failed'."""

    cell: Cell
    run_dir: Path
    status: str
    resumed: bool = False
    seconds: float = 0.0
    error: str | None = None
    result: dict = field(default_factory=dict)


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


# --------------------------------------------------------------------------- the comparison table


def comparison_table(
    sweep_dir: Path, spec: SweepSpec, cells: list[Cell], outcomes: list[CellOutcome] | None = None
) -> list[dict]:
    """One row per cell: labels, seed, status, then the ``paper-table`` columns of its run."""
    from storage.catalog import connect, query, set_params
    from storage.queries import get_query

    status = {
        o.cell.id: ("failed" if o.status == "failed" else "finished" if o.status in ("done", "skipped") else o.status)
        for o in outcomes or []
    }
    have = [c.id for c in cells if is_run_dir(Path(sweep_dir) / c.id)]
    by_run: dict[str, dict] = {}
    if have:
        con = connect(sweep_dir, runs=have)
        for name, columns in (("paper-table", None), ("failure-signals", [c for c, _, _ in FAILURE_COLUMNS])):
            named = get_query(name)
            set_params(con, {k: d for k, (d, _) in named.params.items()})
            for r in query(con, named.sql).to_pylist():
                keep = r if columns is None else {k: r.get(k) for k in columns}
                by_run.setdefault(r["run_id"], {}).update(keep)
    rows = []
    for c in cells:
        state = status.get(c.id) or cell_state(sweep_dir, c)
        metrics = {k: v for k, v in by_run.get(c.id, {}).items() if k != "run_id"}
        rows.append({"cell": c.id, **dict(c.labels), "seed": c.seed, "status": state, **metrics})
    return rows


def _mean_over_seeds(spec: SweepSpec, rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[a] for a in spec.axes), []).append(r)
    out = []
    for key, members in groups.items():
        row: dict[str, Any] = dict(zip(spec.axes, key))
        row["seeds"] = sum(m["status"] == "finished" for m in members)
        for col, _, _ in TABLE_COLUMNS + FAILURE_COLUMNS:
            vals = [m[col] for m in members if isinstance(m.get(col), (int, float)) and m[col] == m[col]]
            row[col] = sum(vals) / len(vals) if vals else None
            if col in SPREAD_COLUMNS:  # the seeds' spread, shown next to the mean
                header, scale = SPREAD_COLUMNS[col]
                row[header] = _spread(vals, scale)
        # a surge is an event, not a quantity: how many seeds had one, and when each began
        onsets = [m.get("first_surge_step") for m in members if m["status"] == "finished"]
        row["first_surge_step"] = None
        row["seeds with a surge"] = f"{sum(o is not None for o in onsets)}/{len(onsets)}" + (
            f" (steps {', '.join(str(int(o)) for o in onsets if o is not None)})"
            if any(o is not None for o in onsets)
            else ""
        )
        out.append(row)
    return out


# columns whose seed-to-seed spread the mean table shows: column -> (header, scale)
SPREAD_COLUMNS = {
    "best_eval_average": ("best eval % min–max (sd)", 100.0),
    "late_eval_average": ("2nd-half eval % min–max (sd)", 100.0),
    "lower_clip_vs_bf16": ("lower-clip vs BF16 min–max (sd)", 1.0),
    "garbled_last10": ("garbled last-10 % min–max (sd)", 100.0),
    "accuracy_last10": ("train acc last-10 % min–max (sd)", 100.0),
}
_TABLE_SPREADS = ("best_eval_average", "late_eval_average", "lower_clip_vs_bf16")  # the failure table has the rest


def _spread(vals: list[float], scale: float) -> str:
    """``min–max (sd)`` over the seeds (sample sd), scaled (100 for shares in %); "—" under 2 seeds."""
    if len(vals) < 2:
        return "—"
    mean = sum(vals) / len(vals)
    sd = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
    digits = 1 if scale == 100.0 else 2
    return f"{scale * min(vals):.{digits}f}–{scale * max(vals):.{digits}f} ({scale * sd:.{digits}f})"


def write_tables(sweep_dir: Path, spec: SweepSpec, rows: list[dict]) -> str:
    """Save ``table.csv`` (every column, raw values) and ``table.md``; return the markdown."""
    import csv
    import io

    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(Path(sweep_dir) / "table.csv", buf.getvalue())
    keys = list(spec.axes) + (["seed"] if len(spec.seeds) > 1 else [])
    if any(r["status"] != "finished" for r in rows):
        keys.append("status")
    md = f"## Sweep {spec.name}\n\n{paper_table_markdown(rows, keys)}\n"
    means = _mean_over_seeds(spec, rows) if len(spec.seeds) > 1 else []
    if means:
        spreads = [SPREAD_COLUMNS[c][0] for c in _TABLE_SPREADS]
        md += f"\n### Mean over seeds\n\n{paper_table_markdown(means, list(spec.axes) + ['seeds'] + spreads)}\n"
    md += (
        "\nShares in %; entropy in nats; NMAE and over-clipping on BF16 shadow steps; "
        "column definitions: `fp8rl query --list` (paper-table).\n"
    )
    md += f"\n### Failure signals\n\n{paper_table_markdown(rows, keys, FAILURE_COLUMNS)}\n"
    if means:
        spreads = tuple((h, h, "s") for c, (h, _) in SPREAD_COLUMNS.items() if c not in _TABLE_SPREADS)
        fail_cols = tuple(c for c in FAILURE_COLUMNS if c[0] != "first_surge_step") + spreads
        md += (
            f"\n### Failure signals, mean over seeds\n\n"
            f"{paper_table_markdown(means, list(spec.axes) + ['seeds', 'seeds with a surge'], fail_cols)}\n"
        )
    md += (
        "\nFailure signals (docs/method.md; `fp8rl query <dir> --named failure-signals`): an entropy "
        "surge is a step above 1.5x the median entropy of the previous 10 steps for at least 3 steps; a "
        "garbled response is one the task's answer parser cannot read; A<0 / A>0 clipped: the mean share "
        "of tokens clipped below L with negative advantage / above H with positive advantage.\n"
    )
    write_text_atomic(Path(sweep_dir) / "table.md", md)
    return md


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
