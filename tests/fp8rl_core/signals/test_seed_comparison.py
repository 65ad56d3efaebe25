"""benchmarks/seed_comparison.py's pairing and per-run statistics, on hand-made rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fp8rl_core.signals.paired_stats import mcnemar_exact_p


@pytest.fixture(scope="module")
def sc():
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "seed_comparison.py"
    spec = importlib.util.spec_from_file_location("seed_comparison", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rows(run: str, acc_by_step: dict[int, list[bool]], entropy: list[float]):
    evals = [
        {"run_id": run, "step": step, "problem_id": f"p{i}", "sample_index": 0, "correct": ok}
        for step, oks in acc_by_step.items()
        for i, ok in enumerate(oks)
    ]
    steps = [
        {
            "run_id": run,
            "step": s + 1,
            "entropy_mean": e,
            "shadow": float(s % 2 == 0),
            "lower_clip_share_neg_fp8": 0.02,
            "lower_clip_share_neg_bf16": 0.01,
            "overclipped_share": 0.001,
        }
        for s, e in enumerate(entropy)
    ]
    return evals, steps


def test_second_half_pairs_and_surges(sc):
    flat = [0.01] * 30
    surge = [0.01] * 15 + [0.05, 0.05, 0.05] + [0.01] * 12  # 3 steps above 1.5x the previous median
    a = rows("fp8.s0", {0: [False] * 4, 10: [True, True, False, False], 20: [True, True, True, False]}, surge)
    b = rows("bf16.s0", {0: [True] * 4, 10: [True, False, True, True], 20: [True, True, True, True]}, flat)
    runs = sc.per_run(a[0] + b[0], a[1] + b[1])
    assert runs["fp8.s0"]["second_half"] == pytest.approx(100 * (0.5 + 0.75) / 2)  # steps 10 and 20 of 0..20
    assert runs["bf16.s0"]["second_half"] == pytest.approx(100 * (0.75 + 1.0) / 2)
    assert runs["fp8.s0"]["surges"] == [16] and runs["bf16.s0"]["surges"] == []
    assert runs["fp8.s0"]["clip_fp8"] / runs["fp8.s0"]["clip_bf16"] == pytest.approx(2.0)
    c = sc.compare({0: "fp8.s0"}, {0: "bf16.s0"}, runs)  # step 10: A only p1, B only p2 p3; step 20: B only p3
    assert (c["pairs"], c["only_a"], c["only_b"]) == (8, 1, 3)
    assert c["p_problem"] == pytest.approx(mcnemar_exact_p(1, 3))
    assert c["mean"] == pytest.approx(62.5 - 87.5) and c["seeds"] == 1


def test_cells_without_a_finished_marker_are_left_out(sc, tmp_path):
    (tmp_path / "_cells").mkdir()
    for cell in ("bf16.standard.s0", "bf16.standard.s1", "fp8-blockwise.calibrated.s0"):
        (tmp_path / cell).mkdir()
    for cell in ("bf16.standard.s0", "fp8-blockwise.calibrated.s0", "gone.standard.s3"):
        (tmp_path / "_cells" / f"{cell}.json").write_text("{}")
    assert sc.finished_cells(tmp_path) == {
        "bf16.standard": {0: "bf16.standard.s0"},
        "fp8-blockwise.calibrated": {0: "fp8-blockwise.calibrated.s0"},
    }


def test_a_twin_cell_reads_the_run_it_names(sc, tmp_path):
    """A cell a sweep did not run again because another cell had its very config (marker ``same_as``)
    pairs with that cell's run; a twin whose run is gone is left out."""
    import json

    (tmp_path / "_cells").mkdir()
    (tmp_path / "fp8-standard.s0").mkdir()
    (tmp_path / "_cells" / "fp8-standard.s0.json").write_text("{}")
    (tmp_path / "_cells" / "fp8-strongest.s0.json").write_text(json.dumps({"same_as": "fp8-standard.s0"}))
    (tmp_path / "_cells" / "fp8-strongest.s1.json").write_text(json.dumps({"same_as": "fp8-standard.s1"}))
    assert sc.finished_cells(tmp_path) == {
        "fp8-standard": {0: "fp8-standard.s0"},
        "fp8-strongest": {0: "fp8-standard.s0"},
    }
