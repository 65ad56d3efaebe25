"""Answer extraction, math equivalence, and the process-pool batch grader."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from fp8rl_core.tasks.verifiers import VERIFIERS, extract_final_answer, last_boxed, math_equal
from stages.grade.pool import GradingPool, grade_batch


@pytest.mark.parametrize(
    "text, inner",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\boxed {x^{2}}", "x^{2}"),
        ("\\fbox{7}", "7"),
        ("\\boxed 5$", "5"),
        ("\\boxed{unterminated", None),
        ("nothing", None),
    ],
)
def test_last_boxed(text, inner):
    assert last_boxed(text) == inner


@pytest.mark.parametrize(
    "response, answer",
    [
        ("We get \\boxed{42}. Done", "42"),
        ("Therefore, the final answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
        ("The answer is 12.", "12"),
        ("Answer: 7", "7"),
        ("work...\n#### 1,234", "1,234"),
        ("234#432", "432"),
        ("## Step 1\nAdd 2 and 3 to get 5", "5"),  # a heading is not the answer marker
        ("first 3 then 4.5 dollars", "4.5"),
        ("I cannot tell.", None),
        ("", None),
    ],
)
def test_extract_final_answer(response, answer):
    assert extract_final_answer(response) == answer


@pytest.mark.parametrize(
    "response, gold",
    [
        ("\\boxed{0.5}", "\\frac{1}{2}"),
        ("\\boxed{1/2}", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{27.0}", "27"),
        ("\\boxed{27}", "27.0"),
        ("\\boxed{(3,\\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)"),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\pi/2)"),
        ("\\boxed{[1,2)}", "[1,2)"),
        ("\\boxed{\\{2,1\\}}", "\\{1,2\\}"),
        ("\\boxed{5\\text{ cm}}", "5"),
        ("\\boxed{1,000}", "1000"),
        ("The answer is 18.", "18"),
        ("#### 18", "18"),
    ],
)
def test_equivalent_forms_are_equal(response, gold):
    assert math_equal(response, gold)


@pytest.mark.parametrize(
    "response, gold",
    [
        ("\\boxed{0.6}", "\\frac{1}{2}"),
        ("\\boxed{28}", "27"),
        ("\\boxed{(3,\\pi)}", "(3,\\pi/2)"),
        ("\\boxed{[1,2]}", "[1,2)"),
    ],
)
def test_different_answers_are_not_equal(response, gold):
    assert not math_equal(response, gold)


def test_no_answer_is_wrong_not_an_error():
    assert math_equal("I don't know.", "5") is False
    assert math_equal("", "5") is False
    assert math_equal("\\boxed{}", "5") is False


def test_math_equal_in_a_thread_does_not_crash():
    """signal.alarm only works in the main thread; off it the timeout is disabled."""
    out = []
    t = threading.Thread(target=lambda: out.append(math_equal("\\boxed{0.5}", "\\frac{1}{2}")))
    t.start()
    t.join(30)
    assert out == [True]


def test_registry_names():
    assert set(VERIFIERS.names()) >= {"math", "synthetic"}
    with pytest.raises(KeyError, match="valid"):
        grade_batch(["a"], ["x"], ["y"], verifier="nope")


def test_synthetic_grading_is_inline_and_ordered():
    res = grade_batch(["a", "b", "c"], ["234#432", "234#433", "no"], ["432", "432", "432"], verifier="synthetic")
    assert [r.id for r in res] == ["a", "b", "c"]
    assert [r.correct for r in res] == [True, False, False]
    assert [r.status for r in res] == ["ok", "ok", "no_answer"]
    assert res[0].extracted == "432"


def test_pool_grades_in_order():
    ids = [f"p{i}" for i in range(12)]
    golds = [str(i) for i in range(12)]
    responses = [f"\\boxed{{{i if i % 3 else i + 1}}}" for i in range(12)]
    res = grade_batch(ids, responses, golds, verifier="math", timeout_s=10)
    assert [r.id for r in res] == ids
    assert [r.correct for r in res] == [bool(i % 3) for i in range(12)]


def sleepy_verifier(response: str, gold: str) -> bool:
    """A verifier that hangs on gold "hang" (imported by path in the workers)."""
    if gold == "hang":
        time.sleep(120)
    return response.endswith("{" + gold + "}")


def test_hanging_item_scores_zero_and_does_not_block(caplog):
    sys.path.insert(0, str(Path(__file__).parent))  # workers inherit sys.path at start
    verifier = f"{Path(__file__).stem}:sleepy_verifier"
    pool = GradingPool(workers=2)
    try:
        ids = ["ok1", "stuck", "ok2", "ok3", "ok4"]
        golds = ["1", "hang", "2", "3", "4"]
        responses = [f"\\boxed{{{g}}}" for g in golds]
        t0 = time.monotonic()
        with caplog.at_level("WARNING"):
            res = pool.grade(ids, responses, golds, verifier=verifier, timeout_s=2.0)
        elapsed = time.monotonic() - t0
        assert [r.status for r in res] == ["ok", "timeout", "ok", "ok", "ok"]
        assert [r.correct for r in res] == [True, False, True, True, True]
        assert elapsed < 15, elapsed  # the other items kept flowing; only the stuck one waited 2 s
        assert "stuck" in caplog.text
        assert pool.timeouts == 1
        again = pool.grade(["x"], ["\\boxed{9}"], ["9"], verifier=verifier, timeout_s=5.0)
        assert again[0].correct  # the pool replaced its killed worker
    finally:
        pool.close()


def test_the_code_verifiers_are_marked_sandboxed_and_are_never_called():
    from fp8rl_core.tasks.verifiers import is_sandboxed

    assert [n for n in sorted(VERIFIERS.names()) if is_sandboxed(n)] == ["code", "code_expr"]
    assert not is_sandboxed("tests.test_verifiers:test_registry_names")  # an importable verifier runs as given
    with pytest.raises(RuntimeError, match="graded in the sandbox"):
        VERIFIERS.get("code")("print(1)", "{}")


def test_the_pool_sends_a_verifier_marked_sandboxed_to_the_sandbox(monkeypatch):
    """The mark decides, not the name: a verifier registered as sandboxed under another name is graded by
    the sandbox's batch grader."""
    from fp8rl_core.tasks.verifiers import SandboxedVerifier
    from stages.grade import code, pool

    monkeypatch.setitem(VERIFIERS._items, "code_planted", SandboxedVerifier("code_planted"))
    seen = []
    monkeypatch.setattr(code, "grade_code_responses", lambda ids, *a, **k: seen.append(list(ids)) or [])
    pool.grade_batch(["a"], ["print(1)"], ["{}"], verifier="code_planted")
    assert seen == [["a"]]
