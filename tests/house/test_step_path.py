"""The path walker of ``benchmarks/step_path.py`` counts what its docstring says: a stop on entering a
function in another file or on coming back to run more of the caller, a function read once."""

from __future__ import annotations

import sys

from benchmarks import step_path


def _module(path, source: str) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    namespace: dict = {}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace


def _traced(walk, fn, *args) -> None:
    """Call ``fn(*args)`` with ``walk`` as the trace function."""
    sys.settrace(walk)
    try:
        fn(*args)
    finally:
        sys.settrace(None)


def test_stops_returns_and_functions_read_once(tmp_path, monkeypatch):
    monkeypatch.setattr(step_path, "FOLLOWED", ("demo",))
    helpers = _module(tmp_path / "demo" / "helpers.py", "def g():\n    return 1\n\n\ndef h():\n    return 2\n")
    stage = _module(
        tmp_path / "demo" / "stage.py",
        "def run_x(b):\n    x = b['g']()\n    y = b['h']()\n    z = b['g']()\n    return x + y + z\n\n\n"
        "def run_y(b):\n    return b['h']()\n",
    )
    walk = step_path.PathWalk(tmp_path.resolve(), "run_x", leaves=False)
    _traced(walk, stage["run_x"], helpers)
    # stage, helpers (g), back in stage, helpers again (h: a return), back in stage; g's second call is read already
    assert [(f.split("/")[-1], name, back) for f, name, back in walk.stops] == [
        ("stage.py", "run_x", False),
        ("helpers.py", "g", False),
        ("stage.py", "run_x", True),
        ("helpers.py", "h", True),
        ("stage.py", "run_x", True),
    ]
    assert walk.report().endswith("5 stops in 2 files, 3 returns")
    tail = step_path.PathWalk(tmp_path.resolve(), "run_y", leaves=False)
    _traced(tail, stage["run_y"], helpers)
    assert len(tail.stops) == 2  # a call that ends its caller's work: no stop back in the caller
