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


@pytest.mark.parametrize("argv, shown", [
    (["--help"], "Commands"),
    (["run", "--help"], "Usage"),
    (["run", "--bogus"], "HEAVY"),  # a usage error is answered before any command's imports
    (["query", "--bogus"], "HEAVY"),
])
def test_help_and_usage_errors_do_not_import_torch_or_prefect(argv: list[str], shown: str) -> None:
    code = (f"import sys; sys.argv = ['fp8rl', *{argv!r}]\n"
            "from flows import cli\n"
            "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'prefect', 'transformers', 'duckdb') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
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
        if name.startswith("__") or name == "annotations" or callable(value) or isinstance(value, (str, tuple, type(faults))):
            continue
        assert isinstance(value, contextvars.ContextVar), f"storage.faults.{name} is module state: {value!r}"
    with faults.stage_scope("train", 3):
        with pytest.raises(OSError, match="No space left"):
            faults.at("train", 3, "mb1", env={faults.ENV: "train@3:mb1=enospc"})
    with pytest.raises(ValueError, match="bad item"):
        faults.parse("train@x=kill")
