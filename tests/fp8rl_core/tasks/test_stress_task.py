"""The stress task (fp8rl_core.tasks.stress): worked chains, noisy teacher, splits, lengths."""

from __future__ import annotations

import random

import pytest

from fp8rl_core.tasks import stress as st
from fp8rl_core.tasks.synthetic import exact_verify, extract_answer

pytestmark = pytest.mark.timeout(60)


def test_the_docstring_example():
    solution, answer = st.chain((4821, 3759), 4)
    assert st.format_prompt((4821, 3759), 0) == "Q:1+9+?=??;2+5+?=??;8+7+?=??;4+3+?=??;A:"
    assert solution == "1+9+0=10;2+5+1=08;8+7+0=15;4+3+1=08;#8580" and answer == "8580"


@pytest.mark.parametrize("difficulty", sorted(st.LEVELS))
def test_chains_are_right_and_long(difficulty):
    n = st.LEVELS[difficulty]
    for i in range(200):
        p = st.make_problem(i, "train", difficulty, seed=3)
        assert int(p.answer) == sum(p.operands)  # the loop reference: plain addition
        assert exact_verify(p.solution, p.answer)
        assert len(p.prompt) == st.prompt_length(difficulty)
        assert 40 <= len(p.solution) + 1 <= 120  # response tokens, EOS included
        assert len(p.solution) + 1 <= st.response_cap(difficulty)
        cells = p.solution.split("#")[0].split(";")[:-1]
        assert len(cells) == n
        for cell in cells:  # every intermediate is written and adds up
            a, b, rest = cell.split("+")
            c, s = rest.split("=")
            assert int(a) + int(b) + int(c) == int(s)


def test_noisy_teacher_drops_carries_and_follows_through():
    rng = random.Random(0)
    p = next(
        st.make_problem(i, "train", 1, 0)
        for i in range(100)
        if len(st.carry_in_columns(st.make_problem(i, "train", 1, 0).operands, 6)) >= 2
    )
    assert st.demonstration(p, 1, 0.0, rng) == p.solution
    wrong = [st.demonstration(p, 1, 0.9, rng) for _ in range(50)]
    assert any(w != p.solution for w in wrong)
    for w in wrong:
        got = extract_answer(w)
        assert got is not None  # a slip is a wrong answer, never a garbled one
        cells = w.split("#")[0].split(";")[:-1]
        assert all(
            int(c.split("+")[0]) + int(c.split("+")[1]) + int(c.split("+")[2].split("=")[0]) == int(c.split("=")[1])
            for c in cells
        )
        assert (w == p.solution) == (got == p.answer)
    with pytest.raises(ValueError):
        st.demonstration(p, 1, 1.0, rng)


def test_splits_are_disjoint_and_levels_checked():
    train = {st.make_problem(i, "train", 0, 0).operands for i in range(300)}
    test = {st.make_problem(i, "test", 0, 0).operands for i in range(300)}
    assert not train & test
    with pytest.raises(ValueError, match="difficulty"):
        st.make_problem(0, "train", 9, 0)
    with pytest.raises(ValueError, match="split"):
        st.make_problem(0, "dev", 0, 0)
    assert 0.4 < st.expected_sampled_accuracy(0, 0.45, n=300) < 0.55


def test_prompt_source_and_benchmark_use_the_stress_task():
    from fp8rl_core.config.model import TaskConfig
    from stages.data.benchmarks import load_synthetic
    from stages.data.prompts import make_source

    cfg = TaskConfig(kind="stress", difficulty=0)
    src = make_source(cfg)
    item = src[0]
    assert src.verifier == "synthetic" and item.prompt.startswith("Q:") and item.prompt.endswith("A:")
    assert item.prompt == st.make_problem(0, "train", 0, cfg.seed).prompt
    bench = load_synthetic(5, cfg)
    assert bench.problems[0].problem == st.make_problem(0, "test", 0, cfg.seed).prompt
    assert "stress" in bench.report.path
