"""Code RL: test formats, output comparison, loaders (offline), the tiny code task,
verifier wiring (pass/fail + fraction), the shipped sets' reference solutions, and a
2-step code campaign whose tables have the shape of a math campaign's."""

from __future__ import annotations

import json
import random

import pytest

from fp8rl_core.config.model import CodeConfig
from fp8rl_core.tasks import code as code_task
from stages.data.code_benchmarks import (
    CODE_SOURCES,
    _eurus,
    _taco_apps,
    load_code_benchmark,
    records_to_set,
)
from stages.grade.code import (
    CodeGradingConfig,
    extract_code,
    get_sandbox,
    grade_code_batch,
    grade_code_responses,
    grade_program,
)
from stages.grade.code_tests import parse_tests
from stages.grade.sandbox import probe_isolation
from stages.grade.stdio_match import outputs_match

pytestmark = pytest.mark.timeout(120)
needs_sandbox = pytest.mark.skipif(
    probe_isolation()[0] != "namespaces+uid", reason="full sandbox isolation unavailable"
)

FUNCTIONAL = {
    "functional": "def check(candidate):\n    assert candidate(a=1) == 2\n    assert candidate(a=5) == 6\n\n"
    "check(Solution().inc)"
}


def test_parse_tests_formats():
    assert parse_tests([{"input": "1\n", "output": "2"}]).cases[0].output == "2"
    t = parse_tests(json.dumps({"inputs": ["1\n", "2\n"], "outputs": ["2\n", "3\n"]}))  # APPS / TACO input_output
    assert t.kind == "stdio" and t.n_cases == 2
    assert parse_tests(str([{"input": "x", "output": "y"}])).n_cases == 1  # Python-literal string
    f = parse_tests(FUNCTIONAL)
    assert f.kind == "functional" and f.n_cases == 2 and f.candidate == "candidate = Solution().inc"
    with pytest.raises(ValueError, match="fn_name"):
        parse_tests({"inputs": [[1]], "outputs": [2], "fn_name": "f"})
    for bad in ("not tests", [], {"functional": "x = 1"}, {"functional": "def check(c):\n    pass\ncheck(1)"}):
        with pytest.raises(ValueError):
            parse_tests(bad)


def test_outputs_match_whitespace_rules():
    assert outputs_match("1 2\n3\n\n", "1 2 \n3")
    assert outputs_match("1  2\r\n3", "1\n2\n3")
    assert outputs_match("0.3333333", "0.33333333")
    assert not outputs_match("1 2", "1 2 3")
    assert not outputs_match("YES", "NO")
    assert not outputs_match("1.1", "1.2")


def test_extract_code():
    assert extract_code("text\n```python\nprint(1)\n```\nmore ```py\nprint(2)\n```") == "print(2)"
    assert extract_code("no code here") is None


def test_tiny_code_task_is_consistent():
    rng = random.Random(0)
    for i in range(50):
        p = code_task.make_problem(i, "train", 7)
        assert p == code_task.make_problem(i, "train", 7)
        assert code_task.safe_verify(p.solution, p)
        wrong = code_task.demonstration(p, 0.999, rng)
        assert wrong != p.solution and not code_task.safe_verify(wrong, p)
    assert code_task.extract_expression("x+1\nimport os") is None
    assert code_task.extract_expression("x+") is None
    assert code_task.safe_eval("__import__('os').getcwd()", 1) is None  # the quick check never runs code


def test_hf_record_parsers_offline():
    apps = {"problem_id": 7, "question": "Add.", "input_output": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})}
    eurus_code = {
        "ability": "code",
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "Sum it."}],
        "reward_model": {"ground_truth": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},
        "extra_info": {"index": 3},
    }
    eurus_math = {
        "ability": "math",
        "prompt": [{"role": "user", "content": "1+1"}],
        "reward_model": {"ground_truth": "2"},
    }
    assert _taco_apps(apps, 0)[:2] == ("7", "Add.")
    assert _eurus(eurus_code, 0)[:2] == ("3", "Sum it.")
    assert _eurus(eurus_math, 1) is None
    call_style = {"question": "f", "input_output": json.dumps({"inputs": [[1]], "outputs": [2], "fn_name": "f"})}
    s = records_to_set(
        "apps",
        "hf://codeparrot/apps:test",
        [apps, call_style, {"question": "q"}],
        CODE_SOURCES["apps"],
        None,
        CodeConfig(),
    )
    assert len(s) == 1 and s.report.n_skipped == 2 and "fn_name" in s.report.skipped[0]
    spec = json.loads(s[0].answer)
    assert spec["style"] == "program" and "Put the complete program" in s[0].problem
    e = records_to_set("eurus_code", "hf://x", [eurus_math, eurus_code], CODE_SOURCES["eurus_code"], None, CodeConfig())
    assert [q.id for q in e] == ["eurus_code/3"]


@needs_sandbox
def test_code_verifiers_record_pass_fail_and_fraction():
    spec = json.dumps({"style": "program", "tests": FUNCTIONAL})
    half = "```python\nclass Solution:\n    def inc(self, a):\n        return 2 if a == 1 else 0\n```"
    full = "```python\nclass Solution:\n    def inc(self, a):\n        return a + 1\n```"
    res = grade_code_responses(["a", "b", "c"], [full, half, "no code"], [spec] * 3, "code")
    assert [r.correct for r in res] == [True, False, False]
    assert [r.fraction for r in res] == [1.0, 0.5, 0.0]
    assert res[2].status == "no_answer"
    p = code_task.make_problem(0, "test", 1)
    tiny = json.dumps({"style": "expression", "tests": json.loads(p.tests)})
    other = p.solution.replace("+", "*") if "+" in p.solution else p.solution.replace("*", "+")
    res = grade_code_responses(["t1", "t2", "t3"], [p.solution, other, "import os"], [tiny] * 3, "code_expr")
    assert [r.correct for r in res] == [True, False, False]


@needs_sandbox
def test_parallel_grading_runs_the_sandboxes_side_by_side_and_keeps_the_order(monkeypatch):
    """Four programs are graded at once: each waits at a barrier of four before its sandbox runs, so a
    serial grader breaks the barrier (no clock is read); the results come back in input order."""
    import threading

    from stages.grade import code as grade_code

    tests = parse_tests([{"input": "", "output": "ok"}])
    codes = ["print('ok')"] * 4 + ["print('no')"]
    ids = [str(i) for i in range(5)]
    together = threading.Barrier(4, timeout=20)
    real = grade_code.grade_program

    def at_the_barrier(sandbox, code, *args, **kwargs):
        if kwargs["item_id"] != "4":  # the four first ones must all be in flight at once
            together.wait()
        return real(sandbox, code, *args, **kwargs)

    monkeypatch.setattr(grade_code, "grade_program", at_the_barrier)
    res = grade_code_batch(ids, codes, [tests] * 5, CodeGradingConfig(max_sandboxes=4))
    assert [r.id for r in res] == ids and [r.correct for r in res] == [True] * 4 + [False]
    assert not together.broken


# ----------------------------------------------------------------- the shipped sets
@needs_sandbox
@pytest.mark.timeout(180)
def test_shipped_reference_solutions_pass_own_tests_and_fail_a_neighbours(data_dir):
    """LeetCode test set, every 8th problem (the one-off full run is in the issue note).
    Known ungradable references are listed with why; Codeforces ships no references,
    so only its tests are checked to parse."""
    lc = json.loads((data_dir / "code_rl_rllm" / "leetcode_test.json").read_text())
    known_bad = {
        126: "needs sortedcontainers (not installed for the sandbox interpreter)",
        127: "reference solution fails its own tests",
        154: "reference solution fails its own tests",
        155: "reference solution fails its own tests",
        171: "reference solution fails its own tests",
    }
    sb = get_sandbox(CodeGradingConfig())
    idx = [i for i in range(0, len(lc), 8) if i not in known_bad]
    entry = [parse_tests(x["tests"]).candidate for x in lc]
    own_fail, neigh_pass = [], []
    cfg = CodeGradingConfig(max_sandboxes=2)
    own = grade_code_batch(
        [str(i) for i in idx], [lc[i]["solutions"] for i in idx], [parse_tests(lc[i]["tests"]) for i in idx], cfg
    )
    own_fail = [g.id for g in own if not g.correct]
    # neighbour: the next problem with another entry point (same-name pairs are one task at two sizes)
    nb = [next(j % len(lc) for j in range(i + 1, i + len(lc)) if entry[j % len(lc)] != entry[i]) for i in idx]
    neigh = grade_code_batch(
        [str(i) for i in idx], [lc[i]["solutions"] for i in idx], [parse_tests(lc[j]["tests"]) for j in nb], cfg
    )
    neigh_pass = [g.id for g in neigh if g.correct]
    assert own_fail == [] and neigh_pass == [], (own_fail, neigh_pass)
    cf = load_code_benchmark("codeforces", data_dir)
    assert len(cf) == 408 and cf.report.n_skipped == 0
    assert (
        grade_program(
            sb, "print(1)", parse_tests(json.loads(cf[0].answer)["tests"]), per_test_s=2, per_sample_s=4
        ).passed
        == 0
    )


# ----------------------------------------------------------------- campaign shape
CODE_MICRO = [
    "task.kind=code_tiny",
    "rollout.max_new_tokens=8",
    "bootstrap.steps=25",
    "bootstrap.noisy_steps=5",
    "bootstrap.switch_loss=0.05",
    "bootstrap.batch_size=16",
    "evaluation.benchmarks=[{name: code_tiny, k: 2, limit: 8, max_new_tokens: 8}]",
    "checkpoint.keep_best_metric=code_tiny/avg@1",
    "code.max_sandboxes=2",
]


@needs_sandbox
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_code_campaign_tables_have_the_math_shape(tmp_path, monkeypatch):
    """Two steps of a code campaign through the stages (sandboxed rewards); every table
    has exactly the stored columns of the contract a math campaign writes."""
    from conftest import micro_config

    from flows.campaign.configuration import dump_config
    from stages.calibrate import run_calibrate
    from stages.context import is_calibration_step, open_run
    from stages.evaluate import run_evaluate
    from stages.rollout import run_rollout
    from stages.runtime.io import read_step
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run
    from storage.tables.schemas import get_table

    monkeypatch.setattr("stages.bootstrap.code.EVAL_SIZE", 16)  # the base-accuracy measurement is not the point here
    cfg = micro_config(*CODE_MICRO)
    create_run(tmp_path, "code", config=dump_config(cfg))
    env, state = open_run(cfg, tmp_path / "code")
    try:
        _, state = run_evaluate(env, state, 0)
        for step in (1, 2):
            _, state = run_rollout(env, state, step)
            summary, state = run_score(env, state, step)
            _, state = run_train(env, state, step)
            if is_calibration_step(cfg, step):
                _, state = run_calibrate(env, state, step)
        _, state = run_evaluate(env, state, 2)
    finally:
        env.close()
    assert env.source.verifier == "code_expr"
    sc = read_step(env, "scores", 2).to_pandas()
    assert sc["tests_passed_fraction"].notna().all()
    assert ((sc["tests_passed_fraction"] == 1.0) == sc["correct"]).all()
    assert 0.0 <= summary["accuracy"] <= 1.0
    es = read_step(env, "eval_scores", 2).to_pandas()
    assert set(es["metric"]) >= {"avg@k", "pass@k"} and set(es["benchmark"]) == {"code_tiny"}
    for t, step in (("rollouts", 1), ("scores", 1), ("token_stats", 1), ("evals", 0), ("eval_scores", 2)):
        names = read_step(env, t, step).schema.names
        stored = get_table(t).column_names
        assert names == stored, (t, names, stored)
