"""Datasets by name or path through ``datasets``, offline.

A local folder laid out as a Hub dataset repository (sharded Parquet data
files, two configs, plus the README's ``configs`` block) is loaded by name with
``load_dataset``, and must equal the same rows read from a JSONL file and from a
``save_to_disk`` folder; the shipped benchmark files read through the generic
loader equal their bespoke loaders.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8rl_core.config.model import DatasetRef

ROWS = [
    {
        "uid": f"p{i}",
        "question": f"What is {i} + {2 * i}?",
        "solution": f"It is \\boxed{{{3 * i}}}.",
        "final": f"{3 * i}",
    }
    for i in range(12)
]
README = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*.parquet
  - split: test
    path: data/test-*.parquet
- config_name: hard
  data_files:
  - split: train
    path: hard/train-*.parquet
---
# toy-math

A dataset laid out as a Hugging Face Hub repository.
"""


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _hub_repo(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = root / "toy-org" / "toy-math"
    (repo / "data").mkdir(parents=True)
    (repo / "hard").mkdir()
    (repo / "README.md").write_text(README)
    train, test = ROWS[:8], ROWS[8:]
    pq.write_table(pa.Table.from_pylist(train[:4]), repo / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(train[4:]), repo / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(test), repo / "data" / "test-00000-of-00001.parquet")
    pq.write_table(
        pa.Table.from_pylist([r | {"question": r["question"] + " (hard)"} for r in ROWS[:3]]),
        repo / "hard" / "train-00000-of-00001.parquet",
    )
    return repo


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ref(source: str, **kw) -> DatasetRef:
    return DatasetRef(source=source, question_field="question", answer_field="final", id_field="uid", **kw)


def test_hub_layout_folder_equals_jsonl_and_save_to_disk(tmp_path):
    import datasets

    from stages.data.datasets_io import load_problems

    repo = _hub_repo(tmp_path)
    cache = str(tmp_path / "cache")
    by_name = load_problems(_ref(str(repo), split="train"), "toy", cache_dir=cache)
    from_jsonl = load_problems(_ref(str(_jsonl(tmp_path / "train.jsonl", ROWS[:8]))), "toy", cache_dir=cache)
    assert by_name.problems == from_jsonl.problems and len(by_name) == 8
    assert by_name[0].problem == "What is 0 + 0?" and by_name[5].answer == "15" and by_name[5].id == "toy/p5"

    test = load_problems(_ref(str(repo), split="test"), "toy", cache_dir=cache)
    assert [p.id for p in test] == [f"toy/p{i}" for i in range(8, 12)]
    hard = load_problems(_ref(str(repo), config="hard", split="train"), "toy", cache_dir=cache)
    assert [p.problem for p in hard] == [r["question"] + " (hard)" for r in ROWS[:3]]

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:8])}).save_to_disk(str(tmp_path / "saved"))
    from_disk = load_problems(_ref(str(tmp_path / "saved")), "toy")
    assert from_disk.problems == by_name.problems

    boxed = load_problems(
        DatasetRef(
            source=str(repo),
            split="train",
            question_field="question",
            answer_field="solution",
            answer_format="boxed",
            id_field="uid",
            limit=3,
        ),
        "toy",
        cache_dir=cache,
    )
    assert [p.answer for p in boxed] == [p.answer for p in by_name.problems[:3]]


def test_bad_references_fail_clearly(tmp_path):
    from stages.data.datasets_io import load_problems

    repo = _hub_repo(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_problems(_ref(str(tmp_path / "nope.jsonl")), "toy")
    with pytest.raises(ValueError, match="no field"):
        load_problems(DatasetRef(source=str(repo), question_field="prompt"), "toy", cache_dir=str(tmp_path / "c"))
    bad = _jsonl(tmp_path / "bad.jsonl", ROWS[:2] + [{"uid": "x", "question": "?", "final": None}])
    got = load_problems(_ref(str(bad)), "toy", cache_dir=str(tmp_path / "c"))
    assert len(got) == 2 and got.report.n_skipped == 1


def test_training_and_eval_configs_take_a_dataset(tmp_path):
    from flows.campaign.configuration import load_config
    from stages.data.prompts import make_source
    from stages.evaluate import eval_problems

    repo = _hub_repo(tmp_path)
    src = {"source": str(repo), "question_field": "question", "answer_field": "final", "id_field": "uid"}
    cfg = load_config(
        "tiny-cpu",
        [
            "task.kind=dataset",
            f"task.dataset={json.dumps(src | {'split': 'train'})}",
            f"evaluation.benchmarks=[{json.dumps({'name': 'toy', 'k': 1, 'dataset': src | {'split': 'test'}})}]",
        ],
    )
    source = make_source(cfg.task)
    assert len(source) == 8 and source[3].answer == "9" and source[3].prompt.startswith("What is 3 + 6?")
    items, verifier = eval_problems(cfg, cfg.evaluation.benchmarks[0])
    assert [it.prompt_id for it in items] == [f"toy/p{i}" for i in range(8, 12)] and verifier == "math"


@pytest.mark.data
def test_shipped_benchmark_files_read_the_same_through_datasets(data_dir, tmp_path):
    from stages.data.benchmarks import load_benchmark
    from stages.data.datasets_io import load_problems

    ref = DatasetRef(source="gsm8k/test.jsonl", question_field="question", answer_field="answer", answer_format="gsm8k")
    generic = load_problems(ref, "gsm8k", data_dir, limit=50, cache_dir=str(tmp_path / "c"))
    shipped = load_benchmark("gsm8k", data_dir, limit=50)
    assert [(p.problem, p.answer) for p in generic] == [(p.problem, p.answer) for p in shipped]
    ref = DatasetRef(source="math500/test.jsonl", id_field="unique_id")
    generic = load_problems(ref, "math500", data_dir, limit=50, cache_dir=str(tmp_path / "c"))
    assert generic.problems == load_benchmark("math500", data_dir, limit=50).problems
