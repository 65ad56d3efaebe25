"""The synthetic task: determinism, disjoint splits, fixed-length prompts, the
worked solution, the noisy teacher and the answer extraction."""

from __future__ import annotations

import random

import pytest

from fp8rl_core.tasks.synthetic import (
    LEVELS,
    carry_columns,
    column_work,
    demonstration,
    exact_verify,
    expected_sampled_accuracy,
    extract_answer,
    make_problem,
    prompt_length,
    split_of,
)


def test_hand_example():
    # 347 + 85: columns 7+5=12 -> 2 c1, 4+8+1=13 -> 3 c1, 3+0+1=4 -> 4
    assert column_work((347, 85), 3) == ("234", "432")
    assert column_work((999, 999), 3) == ("8991", "1998")
    assert column_work((5, 3), 2) == ("80", "8")
    assert column_work((0, 0), 2) == ("00", "0")
    assert column_work((999, 999, 999), 3) == ("7992", "2997")  # carry of 2
    assert carry_columns((347, 85), 3) == [0, 1]
    # dropping the carry out of column 0 gives a consistent wrong answer: 7+5 -> 2, 4+8 -> 2 c1, 3+1 -> 4
    assert column_work((347, 85), 3, frozenset({0})) == ("224", "422")


def test_problem_is_deterministic_and_correct():
    for d, lv in LEVELS.items():
        for split in ("train", "test"):
            for i in range(300):
                p = make_problem(i, split, d, seed=5)
                assert p == make_problem(i, split, d, seed=5)
                assert len(p.operands) == lv.n_operands
                assert int(p.answer) == sum(p.operands)
                work, _, answer = p.solution.partition("#")
                assert answer == p.answer and work[::-1].lstrip("0") in (answer, "")
                assert len(p.prompt) == prompt_length(d)  # fixed length: no prompt padding
                assert split_of(p.operands, d) == split
    assert make_problem(0, "train", 1, seed=1) != make_problem(0, "train", 1, seed=2)


def test_prompt_is_little_endian():
    p = next(make_problem(i, "train", 1, 0) for i in range(1000) if make_problem(i, "train", 1, 0).operands[1] < 100)
    a, b = p.operands
    assert p.prompt == f"Q:{str(a).zfill(3)[::-1]}+{str(b).zfill(3)[::-1]}=?A:"


def test_splits_are_disjoint_across_seeds():
    for d in (1, 2):
        train = {make_problem(i, "train", d, s).operands for s in (0, 1) for i in range(3000)}
        test = {make_problem(i, "test", d, s).operands for s in (0, 1) for i in range(3000)}
        assert not train & test
        assert len(test) > 2500  # few repeats at these levels


def test_test_share_is_about_ten_percent():
    rng = random.Random(0)
    tuples = [(rng.randrange(1000), rng.randrange(1000)) for _ in range(20000)]
    share = sum(split_of(t, 1) == "test" for t in tuples) / len(tuples)
    assert 0.09 < share < 0.11


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="split"):
        make_problem(0, "validation", 1, 0)
    with pytest.raises(ValueError, match="difficulty"):
        make_problem(0, "train", 9, 0)


def test_demonstration_noise():
    rng = random.Random(0)
    problems = [make_problem(i, "train", 1, 0) for i in range(3000)]
    assert all(demonstration(p, 1, 0.0, rng) == p.solution for p in problems[:200])
    drop = 0.4
    n_carry = 0
    exact = 0
    for p in problems:
        demo = demonstration(p, 1, drop, rng)
        exact += demo == p.solution
        n_carry += bool(carry_columns(p.operands, 3))
        work, _, answer = demo.partition("#")
        assert answer == (work[::-1].lstrip("0") or "0")  # the answer follows the written work
    expected = sum((1 - drop) ** len(carry_columns(p.operands, 3)) for p in problems) / len(problems)
    assert abs(exact / len(problems) - expected) < 0.03


def test_expected_sampled_accuracy_bands():
    assert expected_sampled_accuracy(1, 0.0, n=300) == 1.0
    acc = expected_sampled_accuracy(2, 0.4, n=1000)
    assert 0.25 < acc < 0.4


@pytest.mark.parametrize(
    "response, answer, ok",
    [
        ("234#432", "432", True),
        ("234#432 ", "432", True),
        ("234#0432", "432", True),
        ("234#433", "432", False),
        ("234#4321", "432", False),  # ran on past the answer
        ("234#432#", "432", False),
        ("234432", "432", False),  # no marker: no answer
        ("", "432", False),
        ("#-5", "-5", True),
    ],
)
def test_exact_verify(response, answer, ok):
    assert exact_verify(response, answer) is ok


def test_extract_answer():
    assert extract_answer("12#34") == "34"
    assert extract_answer("1#2#3") == "3"
    assert extract_answer("no marker") is None
    assert extract_answer("1#x") is None
