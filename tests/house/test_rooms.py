"""The house's rooms: the rooms of fp8rl_core, flows and storage and the arrows between them, the size of a
folder, and a tests tree that mirrors the package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------- the rooms of fp8rl_core

# room -> the rooms it may import (eagerly or lazily). The top-level ``registry`` may be imported by any
# room; ``registered`` imports the rooms to fill the registries and is imported by none of them.
ROOMS = {
    "host": (),  # process settings that are not numerics
    "cpu_numerics": (),  # the BF16 rule and the CPU-independent exact math
    "signals": (),  # guard, failure signals, diagnostics, evaluation metrics, paired statistics
    "config": ("registry",),
    "precision": ("cpu_numerics", "host", "registry"),  # FP8/FP4 formats, linears, conversion, BF16 shadow
    "tasks": ("config", "registry"),
    "objective": ("config", "cpu_numerics", "precision", "registry"),  # losses, advantages, log-probs
    "calibration": ("config", "objective", "signals", "registry"),  # Calibrated Clipping and its parts
}
CORE_TOP_LEVEL = {"__init__.py", "registry.py", "registered.py"}


def test_every_core_module_lives_in_a_room() -> None:
    core = ROOT / "fp8rl_core"
    loose = sorted(p.name for p in core.glob("*.py") if p.name not in CORE_TOP_LEVEL)
    assert not loose, f"put these in a room of fp8rl_core ({', '.join(ROOMS)}): {loose}"
    rooms = sorted(p.name for p in core.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == sorted(ROOMS), f"a room without its rules in ROOMS (or rules without a room): {rooms}"
    assert not [d for room in ROOMS for d in (core / room).iterdir() if d.is_dir() and d.name != "__pycache__"]


def _core_imports(path: Path) -> list[tuple[int, str]]:
    """Imported modules, a room imported by name from the package read as the room's module; a relative
    import is reported as such (the rooms import by absolute name only)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.append((node.lineno, "fp8rl_core.<relative import>"))
        elif isinstance(node, ast.ImportFrom) and node.module == "fp8rl_core":
            out += [(node.lineno, f"fp8rl_core.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_the_rooms_of_fp8rl_core_import_one_way(room: str) -> None:
    bad = []
    for f in sorted((ROOT / "fp8rl_core" / room).rglob("*.py")):
        for line, mod in _core_imports(f):
            parts = mod.split(".")
            if parts[0] != "fp8rl_core" or len(parts) < 2 or parts[1] == room:
                continue
            if parts[1] not in ROOMS[room]:
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod} (room {room} may import {ROOMS[room]})")
    assert not bad, "\n".join(bad)


def test_the_room_rules_catch_an_arrow_back(tmp_path: Path) -> None:
    """The rule reads a room imported by name and lazy imports as well as dotted ones."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from fp8rl_core import calibration\n    import fp8rl_core.objective.losses\n")
    assert sorted(m for _, m in _core_imports(probe)) == ["fp8rl_core.calibration", "fp8rl_core.objective.losses"]


# --------------------------------------------------------------------------- the rooms of flows and storage

# package -> (room -> the rooms it may import, eagerly or lazily). Beside the rooms: modules at the bottom that
# any room may import and that import no room, and modules at the top that import rooms and that no room imports.
HALL_ROOMS = {
    "flows": {
        "process": (),  # shutdown path, child guard, torchrun
        "plan": (),  # memory plan, split placement, generation work, fit
        "orchestration": ("process",),  # Prefect's environment, server, UI
        "report": ("orchestration", "process"),  # HTML report, figures, trackers
        "campaign": ("orchestration", "plan", "process", "report"),  # config, flow, guard, launch, rerun, deploy
        "sweep": ("campaign", "orchestration", "plan", "process", "report"),
        "commands": ("campaign", "orchestration", "plan", "process", "report", "sweep"),
        "cluster": ("campaign", "commands", "orchestration", "plan", "process", "report", "sweep"),
    },
    "storage": {
        "tables": (),  # table specs, schemas, derived columns
        "run": ("tables",),  # run directory layout, identity, lock
        "ledger": ("run", "tables"),
        "checkpoints": ("run",),
        "parts": ("checkpoints", "ledger", "run", "tables"),  # the atomic writer and part checks
        "queries": ("ledger", "parts", "run", "tables"),  # the DuckDB catalog and named SQL
    },
}
HALL_BOTTOM = {"flows": {"__init__"}, "storage": {"__init__", "errors", "faults"}}
HALL_TOP = {"flows": {"cli", "spmd"}, "storage": {"doctor"}}
MAX_MODULES_PER_FOLDER = 15


def _package_imports(path: Path, package: str) -> list[tuple[int, str]]:
    """Imported modules, a module imported by name from ``package`` read as that module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            out.append((node.lineno, f"{package}.<relative import>"))
        elif isinstance(node, ast.ImportFrom) and node.module == package:
            out += [(node.lineno, f"{package}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
    return out


def _hall_arrows(package: str, path: Path, rel: str) -> list[str]:
    """The arrows of one module of ``package`` (``rel``: its path inside the package) its rules refuse."""
    rooms, bottom, top = HALL_ROOMS[package], HALL_BOTTOM[package], HALL_TOP[package]
    parts = Path(rel).with_suffix("").parts
    here = parts[0] if len(parts) > 1 else None  # None: a module beside the rooms
    bad = []
    for line, mod in _package_imports(path, package):
        tp = mod.split(".")
        if tp[0] != package or len(tp) < 2:
            continue
        name = tp[1]
        if name in bottom or name == here:
            continue
        if name in top:
            bad.append(f"{package}/{rel}:{line} imports {mod}, a module above the rooms")
        elif here is None and Path(rel).stem in bottom:
            bad.append(f"{package}/{rel}:{line} imports {mod} (a module below the rooms imports none)")
        elif here is not None and name not in rooms.get(here, ()):
            bad.append(f"{package}/{rel}:{line} imports {mod} (room {here} may import {rooms.get(here, ())})")
    return bad


@pytest.mark.parametrize("package", sorted(HALL_ROOMS))
def test_every_module_of_flows_and_storage_lives_in_a_room_or_beside_them_by_rule(package: str) -> None:
    loose = sorted(p.stem for p in (ROOT / package).glob("*.py"))
    assert set(loose) <= HALL_BOTTOM[package] | HALL_TOP[package], (
        f"{package}: put {sorted(set(loose) - HALL_BOTTOM[package] - HALL_TOP[package])} in a room "
        f"({', '.join(HALL_ROOMS[package])})"
    )
    dirs = sorted(p.name for p in (ROOT / package).iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert dirs == sorted(HALL_ROOMS[package]), f"a room without its rules (or rules without a room): {dirs}"


@pytest.mark.parametrize("package", sorted(HALL_ROOMS))
def test_the_rooms_of_flows_and_storage_import_one_way(package: str) -> None:
    bad = []
    for f in sorted((ROOT / package).rglob("*.py")):
        bad += _hall_arrows(package, f, f.relative_to(ROOT / package).as_posix())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "package, rel, line, refused",
    [
        ("flows", "process/probe.py", "from flows.campaign.flow import run_campaign", "room process may import"),
        ("flows", "sweep/probe.py", "def f():\n    from flows import cli", "above the rooms"),
        ("flows", "campaign/probe.py", "import flows.commands.run", "room campaign may import"),
        ("storage", "tables/probe.py", "def f():\n    from storage.run import layout", "room tables may import"),
        ("storage", "errors.py", "from storage.run.layout import RunLayout", "below the rooms"),
        ("storage", "queries/probe.py", "from storage.doctor import check_run", "above the rooms"),
    ],
)
def test_the_hall_rules_catch_a_planted_arrow(package, rel, line, refused, tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(line + "\n")
    bad = _hall_arrows(package, probe, rel)
    assert len(bad) == 1 and refused in bad[0], bad


def _folder_module_counts() -> dict[str, int]:
    out = {}
    for package in ("fp8rl_core", "stages", "storage", "flows"):
        for d in [ROOT / package, *(p.parent for p in (ROOT / package).rglob("__init__.py"))]:
            out[d.relative_to(ROOT).as_posix()] = len(list(d.glob("*.py")))
    return out


TEST_FOLDERS_BESIDE_THE_PACKAGE = {"house", "gpu_check"}  # repository-wide rules; the GPU check's own package


def _misplaced_tests(tests: Path) -> list[str]:
    """Test files outside a folder that mirrors a folder of the package (``tests/stages/trainer/`` for
    ``stages/trainer/``), and basenames used twice (pytest imports test files by basename)."""
    bad, seen = [], {}
    for f in sorted(tests.rglob("test_*.py")):
        rel = f.parent.relative_to(tests)
        mirrored = rel.parts and (
            rel.parts[0] in TEST_FOLDERS_BESIDE_THE_PACKAGE
            or (rel.parts[0] in ("fp8rl_core", "stages", "storage", "flows") and (ROOT / rel / "__init__.py").exists())
        )
        if not mirrored:
            bad.append(f"{f.relative_to(tests)}: not in a folder that mirrors the package")
        if f.name in seen:
            bad.append(f"{f.relative_to(tests)}: basename also {seen[f.name]}")
        seen[f.name] = f.relative_to(tests)
    return bad


def test_the_tests_mirror_the_package_with_unique_basenames() -> None:
    bad = _misplaced_tests(ROOT / "tests")
    assert not bad, "\n".join(bad)


def test_the_test_folder_rule_catches_a_planted_file(tmp_path: Path) -> None:
    planted = [("test_loose.py",), ("stages", "nowhere", "test_x.py"), ("stages", "trainer", "test_twice.py")]
    planted += [("house", "test_twice.py"), ("stages", "trainer", "test_fine.py")]
    for parts in planted:
        (tmp_path.joinpath(*parts)).parent.mkdir(parents=True, exist_ok=True)
        tmp_path.joinpath(*parts).write_text("")
    refused = [b.split(":")[0] for b in _misplaced_tests(tmp_path)]
    assert refused == ["/".join(p) for p in (planted[1], planted[2], planted[0])]


def test_no_folder_of_the_package_holds_more_than_15_modules() -> None:
    crowded = {d: n for d, n in _folder_module_counts().items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules (__init__.py counted): {crowded}"


def test_the_folder_rule_counts_what_it_should(tmp_path: Path, monkeypatch) -> None:
    """A planted 16th module in a room is found (``__init__.py`` counted)."""
    room = ROOT / "storage" / "tables"
    n = len(list(room.glob("*.py")))
    planted = [room / f"_planted_{i}.py" for i in range(MAX_MODULES_PER_FOLDER + 1 - n)]
    try:
        for p in planted:
            p.write_text("")
        assert _folder_module_counts()["storage/tables"] == MAX_MODULES_PER_FOLDER + 1
    finally:
        for p in planted:
            p.unlink()
