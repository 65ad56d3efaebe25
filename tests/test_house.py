"""The house rules that keep the code readable: import arrows one way, a light ``--help``, one way to fail."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package -> packages it must never import, eagerly or lazily (inside a function)
FORBIDDEN = {
    "fp8rl_core": ("stages", "flows", "storage"),
    "storage": ("stages", "flows"),
    "stages": ("flows",),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_arrows_point_one_way_lazy_imports_included(package: str) -> None:
    bad = []
    for f in sorted((ROOT / package).rglob("*.py")):
        for line, mod in _imports(f):
            top = mod.split(".")[0]
            if top in FORBIDDEN[package]:
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "argv, shown",
    [
        (["--help"], "Commands"),
        (["run", "--help"], "Usage"),
        (["run", "--bogus"], "HEAVY"),  # a usage error is answered before any command's imports
        (["query", "--bogus"], "HEAVY"),
    ],
)
def test_help_and_usage_errors_do_not_import_torch_or_prefect(argv: list[str], shown: str) -> None:
    code = (
        f"import sys; sys.argv = ['fp8rl', *{argv!r}]\n"
        "from flows import cli\n"
        "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'prefect', 'transformers', 'duckdb') if m in sys.modules]\n"
        "print('HEAVY', heavy)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert shown in r.stdout and "HEAVY []" in r.stdout, r.stdout[-500:] + r.stderr[-2000:]


def test_every_registered_command_module_exists_and_registers() -> None:
    """A typo in a module name must fail loudly, not silently drop its commands."""
    import importlib

    from flows import cli

    names = {c.name for c in cli.app.registered_commands}
    assert {"run", "resume", "rerun", "deploy", "query", "doctor", "report", "sweep", "config"} <= names
    for mod in cli._COMMAND_MODULES:
        assert hasattr(importlib.import_module(mod), "register"), mod


def test_one_fail_for_every_command_module() -> None:
    """Every CLI module fails the same way: flows.cli_common.fail (no private copies)."""
    copies = []
    for f in sorted((ROOT / "flows").glob("cli*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in ("_fail", "fail") and f.name != "cli_common.py":
                copies.append(f"{f.name}:{node.lineno}")
    assert not copies, copies


def test_fault_injection_keeps_no_module_state() -> None:
    """storage.faults parses the plan at each point; the running stage is a ContextVar, not a global dict."""
    import contextvars

    from storage import faults

    for name, value in vars(faults).items():
        if name.startswith("__") or name == "annotations" or callable(value):
            continue
        if isinstance(value, (str, tuple, type(faults))):
            continue
        assert isinstance(value, contextvars.ContextVar), f"storage.faults.{name} is module state: {value!r}"
    with faults.stage_scope("train", 3):
        with pytest.raises(OSError, match="No space left"):
            faults.at("train", 3, "mb1", env={faults.ENV: "train@3:mb1=enospc"})
    with pytest.raises(ValueError, match="bad item"):
        faults.parse("train@x=kill")


# --------------------------------------------------------------------------- size, names, circles, history

SOURCE_DIRS = ("fp8rl_core", "stages", "flows", "storage", "gpu_check")
MAX_FUNCTION_LINES = 80


def _sources(dirs=SOURCE_DIRS) -> list[Path]:
    return [f for d in dirs for f in sorted((ROOT / d).rglob("*.py"))]


def test_no_function_over_80_lines_outside_benchmarks_and_tests() -> None:
    long = []
    for f in _sources():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "\n".join(long)


def _registry_names() -> dict[str, tuple[set[str], set[str]]]:
    """Registry -> (its names, the modules allowed to spell them: where they are registered)."""
    from fp8rl_core.advantages import ADVANTAGE_ESTIMATORS
    from fp8rl_core.calibration import CLIP_MODES, UPDATE_BOUNDS
    from fp8rl_core.registered import POLICY_LOSSES

    return {
        "policy loss": (set(POLICY_LOSSES.names()), {"fp8rl_core/losses.py", "fp8rl_core/gspo.py"}),
        "clip mode": (set(CLIP_MODES.names()) | set(UPDATE_BOUNDS.names()), {"fp8rl_core/calibration.py"}),
        "advantage estimator": (set(ADVANTAGE_ESTIMATORS.names()), {"fp8rl_core/advantages.py"}),
    }


def test_no_caller_compares_a_string_with_a_loss_clip_mode_or_estimator_name() -> None:
    """Behaviour comes from the registry entry, never from ``if cfg.loss == "gspo"`` in a caller."""
    bad = []
    registries = _registry_names()
    for f in _sources():
        rel = str(f.relative_to(ROOT))
        for node in ast.walk(ast.parse(f.read_text(), rel)):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                if not (isinstance(side, ast.Constant) and isinstance(side.value, str)):
                    continue
                for kind, (names, home) in registries.items():
                    if side.value in names and rel not in home:
                        bad.append(f"{rel}:{node.lineno} compares with the {kind} {side.value!r}")
    assert not bad, "\n".join(bad)


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(path: Path, known: set[str]) -> set[str]:
    """Project modules ``path`` imports, eagerly or lazily (``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for body in node.body
        for n in ast.walk(body)
    }
    me = _module_of(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != me and not name.endswith("__init__"):
                out.add(name)
    return out


def test_no_import_circle_between_files_lazy_imports_included() -> None:
    files = {_module_of(f): f for f in _sources(SOURCE_DIRS)}
    known = set(files)
    graph = {m: {d for d in _runtime_imports(f, known) if files[d].name != "__init__.py"} for m, f in files.items()}
    circles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                circles.append(" -> ".join(path[path.index(d) :] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(circles)


ISSUE_REF = r"\b[Ii]ssues? #?\d+|(?<=[\s(])#\d{1,3}\b"


def test_no_issue_number_references_in_the_tree() -> None:
    """History is told with dates and commit ids: an issue number means nothing to the next reader."""
    import re

    pattern = re.compile(ISSUE_REF)
    bad = []
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for rel in tracked:
        if not rel.endswith((".py", ".md", ".yaml", ".yml", ".toml", ".sql", ".txt", ".cfg")) and rel != "Makefile":
            continue
        path = ROOT / rel
        if not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line) and "ISSUE_REF" not in line:
                bad.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not bad, f"{len(bad)} line(s):\n" + "\n".join(bad[:60])


# --------------------------------------------------------------------------- one name, one meaning

# The vocabulary of ranks and collectives: the helpers that decide which ranks run what, and the
# one-process stand-ins of the collectives. Each public module-level name here means one thing.
RANK_VOCABULARY = ("stages/runtime", "stages/trainer/collective.py", "stages/context.py")


def _public_module_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") and len(n) > 1}


def test_rank_and_collective_names_mean_one_thing() -> None:
    """``from_main`` (a value rank 0 computes) is not ``on_main`` (a stage rank 0 runs); the
    one-process stage comm is not the one-process trainer collective."""
    files = []
    for entry in RANK_VOCABULARY:
        path = ROOT / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    homes: dict[str, list[str]] = {}
    for f in files:
        for name in _public_module_names(f):
            homes.setdefault(name, []).append(str(f.relative_to(ROOT)))
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    assert not twice, "\n".join(f"{name}: {', '.join(where)}" for name, where in sorted(twice.items()))
