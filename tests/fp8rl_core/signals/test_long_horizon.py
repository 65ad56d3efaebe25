"""benchmarks/long_horizon.py's two rules (headroom, drift slopes), on hand-made series."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def lh():
    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location("long_horizon", root / "benchmarks" / "long_horizon.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_headroom_is_the_gain_from_steps_150_160_to_190_200_in_points(lh):
    evals = {150: 0.30, 160: 0.32, 170: 0.9, 180: 0.0, 190: 0.33, 200: 0.35}
    assert lh.headroom(evals) == pytest.approx(3.0)
    assert lh.headroom({150: 0.3, 160: 0.3, 190: 0.3}) is None  # step 200 not evaluated yet


def test_the_drift_slope_is_per_100_steps_and_undefined_on_too_few_points(lh):
    line = {s: 0.5 + 0.002 * s for s in range(40, 201, 10)}
    assert lh.slope_per_100(line) == pytest.approx(0.2)
    assert lh.slope_per_100({s: 1.0 for s in range(40, 201)}) == pytest.approx(0.0)
    assert math.isnan(lh.slope_per_100({40: 0.1, 50: 0.2}))


def test_an_archived_cell_gives_the_per_step_series_and_the_evaluation_means(lh):
    line = {
        "steps": {"step": [1, 2, 3], "entropy_mean": [0.5, None, 0.3], "clipfrac_lower": [0.02, 0.01, 0.0]},
        "eval_keys": ["p0|0", "p1|0", "p2|0", "p3|0"],
        "eval_outcomes": {"0": "0100", "10": "11-1", "20": "----"},
    }
    got = lh.archived_series({"bf16.s0": line})["archive:bf16.s0"]
    assert got["entropy_mean"] == {1: 0.5, 3: 0.3}  # a missing value is no point, not a zero
    assert got["clipfrac_lower"] == {1: 0.02, 2: 0.01, 3: 0.0}
    assert got["eval"] == {0: 0.25, 10: 1.0}  # unevaluated outcomes ("-") count for nothing


def test_the_figure_draws_every_setting_and_seed(lh, tmp_path):
    pytest.importorskip("matplotlib")
    data = {
        f"archive:{s}.s{k}": {
            "entropy_mean": {t: 0.3 - 0.001 * t for t in range(1, 31)},
            "clipfrac_lower": {t: 0.01 for t in range(1, 31)},
            "eval": {t: 0.1 + 0.01 * t for t in range(0, 31, 10)},
        }
        for s in ("bf16", "fp8-standard")
        for k in (0, 1)
    }
    cells = {s: {k: f"archive:{s}.s{k}" for k in (0, 1)} for s in ("bf16", "fp8-standard")}
    out = tmp_path / "curves.png"
    lh.draw(cells, data, out, "a caption")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_the_figure_draws_any_number_of_settings_each_in_a_colour_of_its_own(lh, tmp_path):
    """The sweep file holds six settings, more than a fixed palette of five: each gets a colour, the
    sweep's own settings the same colour in every figure, whatever else is drawn beside them."""
    pytest.importorskip("matplotlib")
    settings = ("bf16", "fp8-calibrated", "fp8-oracle", "fp8-rollout-only", "fp8-standard", "fp8-train-only",
                "another", "and-one-more")
    series = {
        "entropy_mean": {t: 0.3 - 0.001 * t for t in range(1, 31)},
        "clipfrac_lower": {t: 0.01 for t in range(1, 31)},
        "eval": {t: 0.1 + 0.01 * t for t in range(0, 31, 10)},
    }
    data = {f"archive:{s}.s0": series for s in settings}
    cells = {s: {0: f"archive:{s}.s0"} for s in settings}
    colours = lh.colours_of(cells)
    assert len(set(colours.values())) == len(settings)
    assert lh.colours_of({"fp8-train-only": {}, "bf16": {}}) == {k: colours[k] for k in ("bf16", "fp8-train-only")}
    out = tmp_path / "curves.png"
    lh.draw(cells, data, out, "a caption")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
