"""Benchmark loaders (counts, malformed lines) and gold-answer grading of every
shipped benchmark through the process pool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8rl_core.config.model import TaskConfig
from stages.data.benchmarks import (
    BOXED_INSTRUCTION,
    SOURCES,
    load_benchmark,
    load_train_prompts,
    render_prompt,
    verifier_for,
)
from stages.grade.pool import grade_batch
from tests.conftest import BENCHMARK_SIZES as EXPECTED
from tests.conftest import DATA_DIR, needs_data


def test_every_benchmark_has_a_count():
    assert set(SOURCES.names()) == set(EXPECTED)


@needs_data
@pytest.mark.data
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_record_counts(name):
    bench = load_benchmark(name, DATA_DIR)
    assert len(bench) == EXPECTED[name]
    assert bench.report.n_skipped == 0 and bench.report.n_records == EXPECTED[name]
    assert len({p.id for p in bench}) == len(bench)
    assert all(p.problem.strip() and p.answer.strip() and p.source == name for p in bench)


@needs_data
@pytest.mark.data
def test_gold_answer_forms():
    assert load_benchmark("amc23", DATA_DIR)[0].answer == "27"  # JSON 27.0
    assert load_benchmark("gsm8k", DATA_DIR)[0].answer == "18"
    assert load_benchmark("minerva_math", DATA_DIR)[0].answer == "1.6"
    assert load_benchmark("math500", DATA_DIR)[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert load_benchmark("aime25", DATA_DIR)[0].answer == "70"
    assert load_benchmark("olympiadbench", DATA_DIR, limit=3)[0].answer == "2"
    assert len(load_benchmark("math500", DATA_DIR, limit=7)) == 7


@needs_data
@pytest.mark.data
def test_train_prompt_loaders():
    assert len(load_train_prompts("gsm8k", data_dir=DATA_DIR)) == 7473
    deepscaler = load_train_prompts("deepscaler", data_dir=DATA_DIR)
    # 4 of the 7474 items have no answer (None or ""): reported with their item number, skipped
    assert len(deepscaler) == 7470 and deepscaler.report.n_skipped == 4
    assert deepscaler.report.skipped[0].endswith("math.json[item 887]: answer is None")
    aime = load_train_prompts("deepscaler", "deepscaler_train_partial/aime.json", data_dir=DATA_DIR)
    assert len(aime) == 975


def _next_different(golds: list[str]) -> list[str]:
    """Each problem's partner: the next problem whose gold differs as a string
    (AMC 2023 repeats answers such as 36 and 7 in neighbouring problems)."""
    n = len(golds)
    return [next(golds[(i + j) % n] for j in range(1, n) if golds[(i + j) % n] != g) for i, g in enumerate(golds)]


def _check_gold_grading(name: str, limit: int | None) -> None:
    bench = load_benchmark(name, DATA_DIR, limit=limit)
    ids = [p.id for p in bench]
    golds = [p.answer for p in bench]
    own = grade_batch(ids, [f"\\boxed{{{g}}}" for g in golds], golds, timeout_s=10)
    assert sum(r.correct for r in own) >= 0.99 * len(bench), (name, [r.id for r in own if not r.correct])
    cross = grade_batch(ids, [f"\\boxed{{{o}}}" for o in _next_different(golds)], golds, timeout_s=10)
    assert sum(not r.correct for r in cross) >= 0.98 * len(bench), (name, [r.id for r in cross if r.correct])


@needs_data
@pytest.mark.data
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gold_grading_first_problems(name):
    """\\boxed{gold} grades correct for >= 99%; the next problem's (different)
    gold grades wrong for >= 98% — on the first 60 problems of each benchmark."""
    _check_gold_grading(name, limit=60)


@needs_data
@pytest.mark.data
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gold_grading_every_problem(name):
    """The same check over every problem (~30-70 s on 2 busy cores; sympy-bound)."""
    _check_gold_grading(name, limit=None)


def _write_jsonl(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def test_malformed_lines_are_reported_skipped_and_counted(tmp_path, caplog):
    good = json.dumps({"question": "What is 2+2?", "answer": "2+2=4\n#### 4"})
    _write_jsonl(
        tmp_path / "gsm8k" / "test.jsonl",
        [good, "{not json", json.dumps({"question": "q", "answer": "no final line"}), "", json.dumps(["a list"]), good],
    )
    with caplog.at_level("WARNING"):
        bench = load_benchmark("gsm8k", tmp_path)
    assert len(bench) == 2 and [p.answer for p in bench] == ["4", "4"]
    assert bench.report.n_skipped == 3
    path = str(tmp_path / "gsm8k" / "test.jsonl")
    assert [s.split(": ")[0] for s in bench.report.skipped] == [f"{path}:2", f"{path}:3", f"{path}:5"]
    assert "invalid JSON" in bench.report.skipped[0] and "####" in bench.report.skipped[1]
    assert f"{path}:2" in caplog.text


def test_minerva_needs_a_boxed_answer(tmp_path):
    _write_jsonl(
        tmp_path / "minerva_math" / "test.jsonl",
        [
            json.dumps({"problem": "p", "solution": "so \\boxed{\\frac{1}{2}} m", "idx": 0}),
            json.dumps({"problem": "p", "solution": "none", "idx": 1}),
        ],
    )
    bench = load_benchmark("minerva_math", tmp_path)
    assert [p.answer for p in bench] == ["\\frac{1}{2}"] and bench.report.n_skipped == 1


def test_olympiad_list_answers(tmp_path):
    _write_jsonl(
        tmp_path / "olympiadbench" / "test.jsonl",
        [
            json.dumps({"id": 1, "question": "q", "final_answer": ["$3$", "$5$"]}),
            json.dumps({"id": 2, "question": "q", "final_answer": []}),
        ],
    )
    bench = load_benchmark("olympiadbench", tmp_path)
    assert [p.answer for p in bench] == ["3, 5"] and bench.report.n_skipped == 1


def test_missing_file_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="FP8RL_DATA_DIR"):
        load_benchmark("aime24", tmp_path)
    monkeypatch.delenv("FP8RL_DATA_DIR", raising=False)
    with pytest.raises(FileNotFoundError, match="FP8RL_DATA_DIR"):  # no folder, no hub: an error, not a download
        load_benchmark("gsm8k")
    with pytest.raises(FileNotFoundError, match="FP8RL_DATA_DIR"):
        load_train_prompts("deepscaler")
    with pytest.raises(KeyError, match="valid"):
        load_benchmark("aime99", tmp_path)


def test_synthetic_benchmark_and_prompts():
    bench = load_benchmark("synthetic", limit=5, task=TaskConfig(difficulty=2, seed=3))
    assert len(bench) == 5 and all(p.source == "synthetic" for p in bench)
    assert render_prompt(bench[0]) == bench[0].problem and verifier_for(bench[0]) == "synthetic"
    assert len(load_benchmark("synthetic")) == 1000


@needs_data
@pytest.mark.data
def test_base_model_template():
    p = load_benchmark("aime24", DATA_DIR)[0]
    assert render_prompt(p) == p.problem.strip() + " " + BOXED_INSTRUCTION
    assert BOXED_INSTRUCTION == "Let's think step by step and output the final answer within \\boxed{}."
    assert verifier_for(p) == "math"
