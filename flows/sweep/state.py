"""Each cell's state in a sweep directory, re-checked against the sweep file and the runs it names
every time the sweep opens.

A cell is NEW (no run directory), PARTIAL (started, unfinished) or FINISHED (its
marker ``<sweep dir>/_cells/<cell>.json``, or a ledger whose final step has every
stage done).

Two cells can name one campaign: when a pilot's choice falls on what a setting already
does, the cells using the choice have the very config of their counterparts. Such a cell
is a *twin* of the first cell with its config (:func:`twins`): a campaign is a
deterministic function of its config on one machine, so the twin is not run again; its
marker says ``same_as`` and it reads that run (:func:`run_name`).

What a sweep reads instead of running, it checks every time it opens
(:func:`check_cells`, before ``fp8rl sweep`` runs anything and in ``--dry-run``). A
disagreement is refused in one line that names the cell, the file and the way out;
nothing is read silently:

- **A cell's own run** holds the cell's config: ``run.json`` records the config the
  sweep file gives the cell now (or the same settings, written before a release added
  one at its default), ``config.yaml`` is unedited, and the run took no config change
  at resume (``fp8rl resume --accept-config-change``): such a run is no longer the
  campaign the sweep file names, and neither is a twin that reads it.
- **A marker** is whole, is the marker of its cell, and was written for the config
  of the run it vouches for. A finished cell's run directory must still be there.
- **A twin's marker** names a run of this sweep directory that holds the twin's very
  config now (a twin whose config the sweep file changed, or whose marker names
  another cell, is refused) and that has finished.
- **Choice records**: :func:`flows.sweep.choice.check_record`, when the file loads.

The cost is one read of each marker and ``run.json`` and one load of each run's
``config.yaml`` (a few milliseconds a cell); cells without a marker fold their ledger,
as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from flows.campaign.configuration import ConfigError
from flows.sweep.spec import CELLS_DIR, Cell
from fp8rl_core.config.campaign import CampaignConfig
from storage.run.layout import config_hash, is_run_dir, read_run_info

NEW, PARTIAL, FINISHED = "new", "partial", "finished"


def marker_path(sweep_dir: Path, cell: Cell | str) -> Path:
    return Path(sweep_dir) / CELLS_DIR / f"{cell if isinstance(cell, str) else cell.id}.json"


def ledger_finished(run_dir: Path, cfg: CampaignConfig) -> bool:
    """True when the ledger has every stage of the campaign's final step done."""
    from stages.context import is_checkpoint_step, is_eval_step
    from stages.runtime.io import RunTables, shadow_steps
    from storage.ledger.events import Ledger

    last = cfg.steps
    need = {"rollout", "score", "train"}
    need |= {"calibrate"} if shadow_steps(RunTables.open(run_dir), [last]) else set()  # what its train stage decided
    need |= {"evaluate"} if is_eval_step(cfg, last) else set()
    need |= {"checkpoint"} if is_checkpoint_step(cfg, last) else set()
    return need <= Ledger(run_dir).done_stages(last)


def twins(cells: list[Cell]) -> dict[str, str]:
    """cell id -> the id of the first earlier cell with the very same config (the module docstring)."""
    first: dict[str, str] = {}
    out = {}
    for c in cells:
        out.update({c.id: first[c.config_text]} if c.config_text in first else {})
        first.setdefault(c.config_text, c.id)
    return out


def run_name(sweep_dir: Path, cell: Cell) -> str:
    """The run directory (under the sweep directory) holding the cell's campaign: its own, or, for a twin
    that was not run, the one its marker names (checked by :func:`cell_state`)."""
    if is_run_dir(Path(sweep_dir) / cell.id):
        return cell.id
    marker = read_marker(sweep_dir, cell.id)
    return (marker or {}).get("same_as") or cell.id


def read_marker(sweep_dir: Path, cell_id: str) -> dict | None:
    """The marker of ``cell_id`` (None when there is none); a damaged one is a ConfigError in one line."""
    path = marker_path(sweep_dir, cell_id)
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
        if not (isinstance(marker, dict) and isinstance(marker.get("cell"), str)):
            raise ValueError("not a cell's marker")
        if not isinstance(marker.get("config_hash"), str) or not isinstance(marker.get("same_as", ""), str):
            raise ValueError("no config hash, or a same_as that is not a run's name")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        why = err.strerror if isinstance(err, OSError) else str(err).splitlines()[0]
        raise ConfigError(
            f"cell {cell_id}: {path} is damaged ({why}); delete it and re-run the sweep: the cell's state is "
            "then read from its run's ledger, or the cell runs"
        ) from None
    if marker["cell"] != cell_id:
        raise ConfigError(f"cell {cell_id}: {path} is the marker of cell {marker['cell']}; delete it")
    return marker


def cell_state(sweep_dir: Path, cell: Cell) -> str:
    """NEW (no run directory), PARTIAL (started, unfinished) or FINISHED, after the checks of the module
    docstring; ConfigError (one line) when the cell's run, marker or twin disagrees with the sweep file."""
    sweep_dir = Path(sweep_dir)
    run_dir = sweep_dir / cell.id
    marker = read_marker(sweep_dir, cell.id)
    path = marker_path(sweep_dir, cell)
    if not is_run_dir(run_dir):
        if marker is None:
            return NEW
        if not marker.get("same_as"):
            raise ConfigError(
                f"cell {cell.id}: {path} says the cell finished, but its run directory {run_dir} is not there; "
                "restore it, or delete the marker to have the cell run again"
            )
        _check_twin(sweep_dir, cell, marker)
        return FINISHED
    why = _not_the_cells_run(run_dir, cell)
    if why:
        raise ConfigError(f"cell {cell.id}: {run_dir} {why}; move that directory away or use another --out")
    if marker is None:
        return FINISHED if ledger_finished(run_dir, cell.config) else PARTIAL
    if marker.get("same_as"):
        raise ConfigError(
            f"cell {cell.id}: {path} says the cell reads run {marker['same_as']}, but the cell has a run of its "
            f"own ({run_dir}); delete the marker: the cell's state is then read from its run's ledger"
        )
    _check_marker_hash(path, cell, marker, run_dir)
    return FINISHED


def check_cells(sweep_dir: Path, cells: list[Cell]) -> dict[str, str]:
    """cell id -> state for every cell, each checked (:func:`cell_state`): what the sweep does when it opens."""
    return {c.id: cell_state(sweep_dir, c) for c in cells}


def _check_twin(sweep_dir: Path, cell: Cell, marker: dict) -> None:
    """A twin's marker names a finished run of this sweep directory that holds the cell's config now."""
    from storage.tables.spec import RUN_ID

    twin, path = marker["same_as"], marker_path(sweep_dir, cell)
    refuse = f"cell {cell.id}: {path} says the cell reads run {twin}, but"
    fix = "delete the marker to have the cell run again"
    if twin == cell.id or not RUN_ID.match(twin) or not is_run_dir(sweep_dir / twin):
        raise ConfigError(f"{refuse} {sweep_dir} has no such run; {fix}")
    why = _not_the_cells_run(sweep_dir / twin, cell)
    if why:
        raise ConfigError(f"{refuse} run {twin} {why}; {fix}")
    _check_marker_hash(path, cell, marker, sweep_dir / twin)
    theirs = read_marker(sweep_dir, twin)
    if theirs is None and not ledger_finished(sweep_dir / twin, cell.config):
        raise ConfigError(f"{refuse} run {twin} has not finished; {fix}")


def _check_marker_hash(path: Path, cell: Cell, marker: dict, run_dir: Path) -> None:
    """The marker was written for the config of the run it vouches for (or the cell's config now)."""
    if marker["config_hash"] not in (config_hash(cell.config_text), read_run_info(run_dir).current_config_hash):
        raise ConfigError(
            f"cell {cell.id}: {path} was written for another config than its run's {run_dir}; delete the marker: "
            "the cell's state is then read from its run's ledger, or the cell runs"
        )


def _not_the_cells_run(run_dir: Path, cell: Cell) -> str | None:
    """Why ``run_dir`` is not a run of ``cell``'s config as the sweep file gives it now (None: it is).

    A run made before a release added a setting (at its default) records other config text for the same
    campaign: its ``config.yaml``, read by this code, is compared with the cell's config instead. The
    config is loaded only then, or when ``config.yaml`` is not the text ``run.json`` records."""
    from flows.campaign.configuration import load_config
    from flows.campaign.run_checks import config_drift

    info = read_run_info(run_dir)
    if info.config_changes:
        keys = "; ".join(k for change in info.config_changes for k in change.get("keys") or []) or "see run.json"
        return (
            f"took a config change at resume (fp8rl resume --accept-config-change: {keys}), so it is not the "
            f"campaign the sweep file gives {cell.id}"
        )
    stored = None
    try:
        text = (run_dir / "config.yaml").read_text(encoding="utf-8")
        if info.config_hash is None or config_hash(text) != info.config_hash:
            stored = load_config(run_dir / "config.yaml")
            drift = config_drift(info, text, stored)
            if drift is not None:
                return f"has a config.yaml edited since the run was made ({'; '.join(drift[:4])})"
        if info.config_hash not in (None, config_hash(cell.config_text)):
            stored = stored or load_config(run_dir / "config.yaml")
    except (OSError, UnicodeDecodeError, ConfigError) as err:
        return f"has a config.yaml this code cannot read ({str(err).splitlines()[0]})"
    if stored is not None and info.config_hash != config_hash(cell.config_text) and stored != cell.config:
        return f"was run with another config than the sweep file gives {cell.id} now"
    return None


@dataclass
class CellOutcome:
    """What happened to a cell in this invocation: 'skipped' (finished earlier), 'done', 'same' (a twin:
    the same campaign as a finished cell, not run again) or 'failed'."""

    cell: Cell
    run_dir: Path
    status: str
    resumed: bool = False
    seconds: float = 0.0
    error: str | None = None
    result: dict = field(default_factory=dict)
