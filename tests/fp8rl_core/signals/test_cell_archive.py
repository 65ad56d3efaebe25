"""benchmarks/cell_archive.py: an archived cell reads back as the rows it was made from, a re-run that
differs is caught, and seed_comparison takes archived cells only where the sweep has none."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _module(name: str):
    sys.path.insert(0, str(ROOT))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ca():
    return _module("cell_archive")


@pytest.fixture(scope="module")
def sc():
    return _module("seed_comparison")


def _line(cell: str, outcomes: dict[str, str], entropy=(0.5, 0.4)) -> dict:
    cols = {"step": [1, 2], "entropy_mean": list(entropy), "shadow": [1.0, 0.0]}
    return {"cell": cell, "config_hash": "c" * 64, "numerics": "f" * 12, "commits": ["abc"], "seconds": 1.0,
            "steps": cols, "eval_keys": ["p0|0", "p1|0", "p2|0"], "eval_outcomes": outcomes}


def test_an_archived_cell_reads_back_as_its_evaluation_and_step_rows(ca):
    evals, steps = ca.as_rows(_line("bf16.s0", {"0": "10-", "2": "011"}))
    assert [(e["step"], e["problem_id"], e["sample_index"], e["correct"]) for e in evals] == [
        (0, "p0", 0, True), (0, "p1", 0, False), (2, "p0", 0, False), (2, "p1", 0, True), (2, "p2", 0, True)]
    assert {e["run_id"] for e in evals} == {"archive:bf16.s0"}
    assert steps == [{"run_id": "archive:bf16.s0", "step": 1, "entropy_mean": 0.5, "shadow": 1.0},
                     {"run_id": "archive:bf16.s0", "step": 2, "entropy_mean": 0.4, "shadow": 0.0}]


def test_a_re_run_is_compared_on_what_it_computed_not_on_where_or_when(ca):
    a = _line("bf16.s0", {"2": "011"})
    assert ca.same_content(a, {**a, "commits": ["def"], "seconds": 9.0, "finished_at": "later"}) == []
    assert ca.same_content(a, _line("bf16.s0", {"2": "010"})) == ["eval_outcomes"]
    assert ca.same_content(a, _line("bf16.s0", {"2": "011"}, entropy=(0.5, 0.4000001))) == ["steps"]


def test_the_comparison_takes_archived_cells_where_the_sweep_has_none(sc, tmp_path):
    archive = tmp_path / "a.jsonl"
    lines = [_line("bf16.s0", {"2": "111"}), _line("bf16.s1", {"2": "110"}), _line("pilot-x.s100", {"2": "1"})]
    archive.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    got = sc.archived_cells([archive], {"bf16": {0: "bf16.s0"}})
    assert sorted(got) == ["bf16.s1"]  # s0 is live; pilots pair with nothing
    other = tmp_path / "b.jsonl"
    other.write_text(json.dumps(_line("bf16.s1", {"2": "100"})) + "\n")
    with pytest.raises(SystemExit, match="bf16.s1 differs between archives"):
        sc.archived_cells([archive, other], {})


def test_a_marker_s_numerics_are_fingerprinted_from_its_parts_by_today_s_definition(ca):
    """A cell re-run on another CPU records the auto choice's reason in its own words; the archive line
    takes the fingerprint from the recorded parts, so the re-export compares equal on the numbers."""
    from flows.sweep.runner import fingerprint_of

    def marker(reason: str, stored: str) -> dict:
        parts = {"cpu_numerics": {"bf16_gemm": {"setting": "auto", "kind": "portable", "reason": reason},
                                  "cpu": "AMD EPYC", "threads": 2},
                 "layer_precision": {"mode": "bf16"}, "versions": {"torch": "2.13.0+cpu"}}
        return {"numerics": {"fingerprint": stored, **parts}}

    zen4, zen3 = marker("AVX512-BF16, but hidden size 128 < 256", "1" * 12), marker("no AMX-BF16/AVX512-BF16", "2" * 12)
    assert ca.numerics_of(zen4) == ca.numerics_of(zen3) == fingerprint_of({k: v for k, v in zen3["numerics"].items()
                                                                           if k != "fingerprint"})
    assert ca.numerics_of({"numerics": {"fingerprint": "3" * 12}}) == "3" * 12  # no parts recorded: as stored
