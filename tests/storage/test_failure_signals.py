"""Garbled share and entropy surge (fp8rl_core.signals.failure_signals), with loop references."""

from __future__ import annotations

import random
import statistics

import pytest

from fp8rl_core.signals.failure_signals import first_surge, garbled_mask, garbled_share, surge_mask, surge_onsets
from fp8rl_core.tasks.synthetic import extract_answer

pytestmark = pytest.mark.timeout(30)


def test_garbled_is_what_the_answer_parser_cannot_read():
    responses = ["1+2+0=03;#3", "1+2+0=03;#", "no marker", "#12 and more", "#-4", ""]
    assert garbled_mask(responses, extract_answer) == [False, True, True, True, False, True]
    assert garbled_share(responses, extract_answer) == pytest.approx(4 / 6)
    assert garbled_share([], extract_answer) == 0.0
    # a wrong but readable answer is not garbled
    assert garbled_share(["#999"], extract_answer) == 0.0


def _reference_onsets(e, factor, window, min_steps):
    """Step by step, straight from the definition."""
    out, t = [], window
    while t < len(e):
        thr = factor * statistics.median(e[t - window : t])
        k = 0
        while t + k < len(e) and e[t + k] > thr:
            k += 1
        if k >= min_steps:
            out.append(t)
            t += k
        else:
            t += 1
    return out


def test_surge_definition():
    flat = [1.0] * 20
    assert surge_onsets(flat) == []
    e = [1.0] * 12 + [1.6, 1.7, 1.8, 1.0, 1.0]
    assert surge_onsets(e) == [12]
    assert surge_mask(e) == [False] * 12 + [True] * 3 + [False] * 2
    assert first_surge(list(range(100, 117)), e) == 112
    # two steps above is a blip, not a surge; exactly 1.5x is not above
    assert surge_onsets([1.0] * 12 + [1.6, 1.7, 1.0, 1.0]) == []
    assert surge_onsets([1.0] * 12 + [1.5, 1.5, 1.5]) == []
    # not before a full window of history
    assert surge_onsets([1.0] * 5 + [3.0] * 5) == []
    # config fields change the answer
    assert surge_onsets(e, factor=2.0) == []
    assert surge_onsets([1.0] * 12 + [1.6, 1.7, 1.0], min_steps=2) == [12]
    with pytest.raises(ValueError):
        surge_onsets(e, factor=1.0)


def test_surge_matches_the_loop_reference_on_random_walks():
    rng = random.Random(0)
    for _ in range(200):
        e, x = [], 1.0
        for _ in range(60):
            x = max(0.05, x * rng.choice([0.8, 1.0, 1.0, 1.3, 1.6]))
            e.append(x)
        for f, w, m in ((1.5, 10, 3), (1.2, 5, 2)):
            assert surge_onsets(e, factor=f, window=w, min_steps=m) == _reference_onsets(e, f, w, m)


def test_failure_signals_query_agrees_with_the_python_definition(tmp_path):
    """The named query's first surge step equals fp8rl_core.signals.failure_signals on the same steps."""
    from storage.parts.writer import TableWriter
    from storage.queries import get_query
    from storage.queries.catalog import connect, query, set_params
    from storage.run.layout import create_run

    rng = random.Random(1)
    expected = {}
    for r in range(6):
        run = create_run(tmp_path, f"run{r}", config={"name": f"run{r}"}).root
        w = TableWriter(run, durable=False)
        e, x = [], 1.0
        for step in range(1, 41):
            x = max(0.05, x * rng.choice([0.8, 1.0, 1.0, 1.3, 1.6] if r % 2 else [0.95, 1.0, 1.05]))
            e.append(x)
            w.write(
                "steps",
                step,
                {
                    "entropy_mean": x,
                    "garbled_share": 0.1 * (step % 3) + 0.01 * (step > 30),
                    "accuracy": 0.5,
                    "clipfrac_lower": 0.01,
                    "clipfrac_upper": 0.02,
                },
                stage="train",
            )
        expected[f"run{r}"] = first_surge(list(range(1, 41)), e)
    con = connect(tmp_path)
    q = get_query("failure-signals")
    set_params(con, {k: v for k, (v, _) in q.params.items()})
    rows = {row["run_id"]: row for row in query(con, q.sql).to_pylist()}
    assert {k: rows[k]["first_surge_step"] for k in expected} == expected
    assert any(v is not None for v in expected.values()) and any(v is None for v in expected.values())
    assert rows["run0"]["garbled_peak"] == pytest.approx(0.21)
    # steps 1-10 hold 0.1 * (1,2,0,1,2,0,1,2,0,1) (mean 0.10); steps 31-40 the same + 0.01
    assert rows["run0"]["garbled_first10"] == pytest.approx(0.10) and rows["run0"]["garbled_last10"] == pytest.approx(
        0.11
    )
