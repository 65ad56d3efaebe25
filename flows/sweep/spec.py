"""A sweep file and its cells: the matrix and every cell's config.

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
      - {clip: calibrated, seed: [1]}          # ``seed``: only these seeds of the matching cells

An exclude pattern's ``seed`` (a seed or a list of them) leaves out only those seeds of the cells
it matches, so a setting can run on fewer seeds than the rest (a two-seed screen beside a
seven-seed comparison); ``seed`` is therefore not an axis name.

Override keys are dotted config paths (``calibration.mode``); a mapping value
merges into the section. Overrides apply in order: base, ``overrides``, each
axis in file order, then ``seed``. Every cell's config is validated when the
file is loaded, so a typo fails before anything runs, naming the file, the
cell and the key. The file and its base preset are read by the configs' strict
loader (:func:`flows.campaign.configuration.read_yaml`): a label given twice in one axis,
like any key given twice, is refused with its line, and so are anchors and
aliases (a few lines that expand without bound), merge keys and tags.

A ``choose:`` block names a setting a pilot picks by a rule fixed in the file, and an axis
label uses it as ``{choose: NAME}`` (:mod:`flows.sweep.choice`); its pilot cells come first,
and the cells using it wait until the choice is made.

Each cell's state in a sweep directory (new, partial, finished, a twin reading another cell's
run) and what is re-checked about it every time the sweep opens are :mod:`flows.sweep.state`.
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flows.campaign.configuration import ConfigError, config_from_dict, dump_config, read_yaml, resolve_preset
from flows.sweep.choice import CHOOSE_KEY, ChoiceSpec, distinct_seeds, pilot_prefix, read_choices
from fp8rl_core.config.campaign import CampaignConfig

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")  # no '.': it joins labels into cell ids
SEED_KEY = "seed"  # in an exclude pattern: the seeds it leaves out
CELLS_DIR = "_cells"  # '_' cannot start a run id, so the catalog never takes it for a run


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
    choose: dict[str, ChoiceSpec] = Field(
        default_factory=dict,
        description="Name -> a setting chosen by a pilot (flows.sweep.choice); an axis label uses it as "
        "{choose: NAME}.",
    )
    exclude: list[dict[str, str | int | list[str] | list[int]]] = Field(
        default_factory=list,
        description="Cells to leave out: axis -> label (or labels), and optionally seed -> a seed (or seeds); a "
        "cell matching every entry of one item is excluded.",
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
            if axis == SEED_KEY:
                raise ValueError(f"{SEED_KEY!r} cannot name an axis: it is the campaign seed (list them in seeds)")
            if not values:
                raise ValueError(f"axis {axis!r} has no labels")
            for label in values:
                if not LABEL.match(label):
                    raise ValueError(f"{axis}.{label}: label must match {LABEL.pattern}")
        return axes

    _seeds = field_validator("seeds")(classmethod(lambda cls, seeds: distinct_seeds(seeds)))

    @model_validator(mode="after")
    def _choices(self) -> "SweepSpec":
        for name in self.choose:
            if not LABEL.match(name):
                raise ValueError(f"choose.{name}: name must match {LABEL.pattern}")
            for cand in self.choose[name].candidates:
                if not LABEL.match(cand):
                    raise ValueError(f"choose.{name}.candidates.{cand}: label must match {LABEL.pattern}")
        for axis, values in self.axes.items():
            for label, overrides in values.items():
                used = overrides.get(CHOOSE_KEY)
                if used is not None and used not in self.choose:
                    known = ", ".join(self.choose) or "none"
                    raise ValueError(f"axes.{axis}.{label}.{CHOOSE_KEY}: unknown choice {used!r}; choices: {known}")
        return self

    @model_validator(mode="after")
    def _exclude(self) -> "SweepSpec":
        for i, pattern in enumerate(self.exclude):
            for axis, labels in pattern.items():
                if axis == SEED_KEY:
                    seeds = [labels] if isinstance(labels, int) else labels
                    if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
                        raise ValueError(f"exclude.{i}.seed: seeds are integers, got {labels!r}")
                    unknown = [s for s in seeds if s not in self.seeds]
                    if unknown:
                        raise ValueError(
                            f"exclude.{i}.seed: {unknown[0]} is not a seed of the sweep; seeds: "
                            + ", ".join(map(str, self.seeds))
                        )
                    continue
                if axis not in self.axes:
                    raise ValueError(f"exclude.{i}.{axis}: unknown axis; axes: {', '.join(self.axes)}")
                for label in [labels] if isinstance(labels, (str, int)) else labels:
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
    pilot: str | None = None  # the choice this cell is a pilot run of (flows.sweep.choice)

    @cached_property
    def config_text(self) -> str:  # (a frozen dataclass: the cache goes into the instance's __dict__)
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


def _excluded(spec: SweepSpec, labels: dict[str, str], seed: int | None = None) -> bool:
    """Whether an exclude pattern matches the cell of ``labels``: all its seeds (``seed`` None: the patterns
    without a ``seed`` entry), or its ``seed``."""

    def hit(axis: str, want) -> bool:
        got = seed if axis == SEED_KEY else labels[axis]
        return got in ([want] if isinstance(want, (str, int)) else want)

    return any(
        all(hit(a, w) for a, w in pattern.items())
        for pattern in spec.exclude
        if seed is not None or SEED_KEY not in pattern
    )


def _combos(spec: SweepSpec):
    """Each label combination with the seeds it runs on (the combinations every seed of which is excluded
    are left out)."""
    for combo in itertools.product(*(list(v) for v in spec.axes.values())):
        labels = dict(zip(spec.axes, combo))
        if _excluded(spec, labels):
            continue
        seeds = [s for s in spec.seeds if not _excluded(spec, labels, s)]
        if seeds:
            yield combo, labels, seeds


def _uses(spec: SweepSpec, labels: dict[str, str]) -> set[str]:
    """The choices the cell of ``labels`` uses."""
    return {spec.axes[a][lab][CHOOSE_KEY] for a, lab in labels.items() if CHOOSE_KEY in spec.axes[a][lab]}


def expand_cells(spec: SweepSpec, base: dict, *, source: str, choices: dict[str, dict] | None = None) -> list[Cell]:
    """The cells of ``spec`` over the ``base`` config tree, each validated: the pilot cells of every
    choice first, then the matrix; a cell using a choice not in ``choices`` (name -> its record) waits
    and is left out (:func:`waiting_cell_ids`)."""
    choices = choices or {}
    cells = []
    for name, choice in spec.choose.items():
        for cand, overrides in choice.candidates.items():
            for seed in choice.seeds:
                cell_id = f"{pilot_prefix(name)}.{cand}.s{seed}"
                tree = copy.deepcopy(base)
                for key, value in [*spec.overrides.items(), *choice.overrides.items(), *overrides.items()]:
                    _apply(tree, key, value, f"{source}: choose.{name}")
                tree["seed"] = seed
                cfg = config_from_dict(tree, source=f"{source}: cell {cell_id}")
                cells.append(Cell(cell_id, (("pilot", name), ("candidate", cand)), seed, cfg, pilot=name))
    matrix = 0
    for combo, labels, seeds in _combos(spec):
        matrix += 1
        if _uses(spec, labels) - set(choices):
            continue
        for seed in seeds:
            cell_id = ".".join(combo) + f".s{seed}"
            where = f"{source}: cell {cell_id}"
            tree = copy.deepcopy(base)
            for key, value in spec.overrides.items():
                _apply(tree, key, value, f"{source}: overrides")
            for axis, label in labels.items():
                for key, value in spec.axes[axis][label].items():
                    if key == CHOOSE_KEY:
                        for k, v in choices[value]["overrides"].items():
                            _apply(tree, k, v, f"{source}: {CHOOSE_KEY} {value} (chosen {choices[value]['winner']})")
                    else:
                        _apply(tree, key, value, f"{source}: axes.{axis}.{label}")
            tree["seed"] = seed
            cfg = config_from_dict(tree, source=where)
            cells.append(Cell(cell_id, tuple(labels.items()), seed, cfg))
    if not matrix:
        raise ConfigError(f"{source}: every cell is excluded")
    ids = [c.id for c in cells]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:  # a matrix label such as 'pilot-NAME' can spell a pilot cell's id
        raise ConfigError(
            f"{source}: two cells have the id {twice[0]} (a cell id is its labels and seed); rename a label"
        )
    return cells


def waiting_cell_ids(spec: SweepSpec, choices: dict[str, dict]) -> list[str]:
    """The ids of the cells that wait for a choice not yet made."""
    return [
        ".".join(combo) + f".s{seed}"
        for combo, labels, seeds in _combos(spec)
        if _uses(spec, labels) - set(choices)
        for seed in seeds
    ]


def _format_validation(source: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return f"{source}: " + "; ".join(parts)


def _read_yaml(path: Path, what: str) -> Any:
    """A sweep file or its base preset, read by the configs' strict loader (``read_yaml``): a key given
    twice (a label twice in one axis), anchors and aliases (the way a few lines expand without bound),
    merge keys, tags and files over 1 MiB are refused in one line naming the file and the line."""
    try:
        return read_yaml(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the {what} ({getattr(err, 'strerror', None) or err})") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def load_sweep(path: str | Path, sweep_dir: str | Path | None = None) -> tuple[SweepSpec, list[Cell]]:
    """Parse and validate a sweep file and every cell's config; ConfigError names the key.

    ``sweep_dir``: where the choices already made are read from (cells using one that is not
    made yet are left out; without it, every such cell is).
    """
    path = Path(path)
    data = _read_yaml(path, "sweep file")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping (name, base, axes, ...)")
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation(str(path), err)) from None
    local = path.parent / spec.base
    base_path = local if local.is_file() else resolve_preset(spec.base)
    base = _read_yaml(base_path, "base preset") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{base_path}: top level must be a mapping of config sections")
    choices = read_choices(Path(sweep_dir) if sweep_dir is not None else None, spec.choose)
    return spec, expand_cells(spec, base, source=str(path), choices=choices)


def select_cells(
    cells: list[Cell],
    patterns: tuple[str, ...] | list[str] | None,
    *,
    source: str = "sweep",
    waiting: list[str] = (),
) -> list[Cell]:
    """The cells whose id matches any glob in ``patterns`` (all cells when none), in file order.

    For running a sweep in parts (one process or machine per part, the same
    sweep directory): ``--cells 'nvfp4.*' --cells 'bf16.*.s0'``. A pattern
    that matches no cell is a ConfigError naming it and the cells there are.
    """
    if not patterns:
        return list(cells)
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(i, pat) for i in [*(c.id for c in cells), *waiting]):
            raise ConfigError(
                f"{source}: --cells {pat!r} matches no cell; the cells are " + ", ".join(c.id for c in cells)
            )
    return [c for c in cells if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]


def default_sweep_dir(spec: SweepSpec, cells: list[Cell]) -> Path:
    return Path(cells[0].config.storage.runs_root) / "sweeps" / spec.name


def open_sweep(sweep_file: str | Path, out: str | Path | None = None) -> tuple[SweepSpec, list[Cell], Path, list[str]]:
    """A sweep file as its directory holds it: the spec, the cells that can run (with the choices made
    there), the directory (``out`` or the default) and the ids of the cells still waiting for a choice."""
    spec, cells = load_sweep(sweep_file)
    sweep_dir = Path(out) if out is not None else default_sweep_dir(spec, cells)
    if spec.choose:
        spec, cells = load_sweep(sweep_file, sweep_dir)
    return spec, cells, sweep_dir, waiting_cell_ids(spec, read_choices(sweep_dir, spec.choose))
