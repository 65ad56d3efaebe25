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
