"""Problem sets by name or path, through Hugging Face ``datasets``.

A :class:`fp8rl_core.config.model.DatasetRef` names where the rows live; this module
reads them with ``datasets`` and maps them to the project's one record type,
:class:`stages.data.benchmarks.BenchmarkProblem`, so training prompts
(``task.kind: dataset``) and evaluation benchmarks
(``evaluation.benchmarks[i].dataset``) come from anything ``datasets`` reads:

================================== ============================================
``source``                         read with
================================== ============================================
``org/name`` (Hub)                 ``load_dataset(name, config, split, revision)``
a folder laid out as a Hub repo    the same call: data files + README ``configs``
a ``save_to_disk`` folder          ``load_from_disk`` (``[split]`` of a DatasetDict)
``*.jsonl`` / ``*.json``           ``load_dataset("json", data_files=...)``
``*.parquet``                      ``load_dataset("parquet", data_files=...)``
================================== ============================================

Relative paths resolve against the data folder (``task.data_dir`` /
``$FP8RL_DATA_DIR``) when they exist there, else against the working folder.
Field mapping: ``question_field``, ``answer_field`` (read per ``answer_format``:
the value, GSM8K's ``#### n`` line, or the last ``\\boxed{}``), ``id_field``.
A row that cannot give a question and an answer is reported (logged and
counted in the :class:`~stages.data.benchmarks.LoadReport`), never silently dropped.
The shipped benchmark files keep their own loaders (``stages.data.benchmarks``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp8rl_core.config.model import DatasetRef
from fp8rl_core.tasks.verifiers import last_boxed
from stages.data.benchmarks import (
    BenchmarkProblem,
    BenchmarkSet,
    LoadReport,
    MalformedRecord,
    _answer_str,
    _gsm8k,
    _text,
    resolve_data_dir,
)


def resolve_source(ref: DatasetRef, data_dir: str | Path | None = None) -> tuple[str, Path | None]:
    """``(kind, path)``: kind ``disk`` (save_to_disk), ``file``, ``folder`` (Hub layout) or ``hub``."""
    candidates = [Path(ref.source)]
    root = resolve_data_dir(data_dir)
    if root is not None and not Path(ref.source).is_absolute():
        candidates.insert(0, root / ref.source)
    for p in candidates:
        if p.is_dir():
            if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
                return "disk", p
            return "folder", p
        if p.is_file():
            return "file", p
    if Path(ref.source).suffix in (".jsonl", ".json", ".parquet") or ref.source.startswith((".", "/")):
        raise FileNotFoundError(f"dataset {ref.source!r} not found (looked in: {', '.join(map(str, candidates))})")
    return "hub", None


def load_rows(ref: DatasetRef, data_dir: str | Path | None = None, *, cache_dir: str | None = None):
    """The split as a ``datasets.Dataset`` (see the table in the module docstring)."""
    import datasets

    kind, path = resolve_source(ref, data_dir)
    if kind == "disk":
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if ref.split not in ds:
                raise ValueError(f"dataset {path}: no split {ref.split!r} (has: {', '.join(ds)})")
            ds = ds[ref.split]
        return ds
    if kind == "file":
        builder = "parquet" if path.suffix == ".parquet" else "json"
        return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
    name = str(path) if kind == "folder" else ref.source
    try:
        return datasets.load_dataset(name, ref.config, split=ref.split, revision=ref.revision, cache_dir=cache_dir)
    except ValueError as err:  # unknown split / config: name the dataset
        raise ValueError(f"dataset {name!r} (config {ref.config!r}, split {ref.split!r}): {err}") from None


def _answer(ref: DatasetRef, rec: dict[str, Any]) -> str:
    if ref.answer_format == "gsm8k":
        return _gsm8k({"question": "-", "answer": rec.get(ref.answer_field)}, 0)[2]
    if ref.answer_format == "boxed":
        boxed = last_boxed(_text(rec, ref.answer_field))
        if boxed is None or not boxed.strip():
            raise MalformedRecord(f"{ref.answer_field} has no \\boxed{{}} answer")
        return boxed.strip()
    return _answer_str(rec.get(ref.answer_field))


def load_problems(
    ref: DatasetRef,
    name: str,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    *,
    cache_dir: str | None = None,
) -> BenchmarkSet:
    """The rows of ``ref`` as :class:`BenchmarkProblem` records of source ``name``."""
    rows = load_rows(ref, data_dir, cache_dir=cache_dir)
    missing = [f for f in (ref.question_field, ref.answer_field, ref.id_field) if f and f not in rows.column_names]
    if missing:
        raise ValueError(
            f"dataset {ref.source!r}: no field(s) {missing} (has: {', '.join(rows.column_names)}); "
            "set question_field / answer_field / id_field"
        )
    cap = min(x for x in (limit, ref.limit, len(rows)) if x is not None)
    report = LoadReport(source=name, path=f"{ref.source}" + (f"[{ref.config}]" if ref.config else "") + f":{ref.split}")
    problems: list[BenchmarkProblem] = []
    for i, rec in enumerate(rows):
        if len(problems) >= cap:
            break
        try:
            question = _text(rec, ref.question_field)
            answer = _answer(ref, rec)
        except MalformedRecord as exc:
            report.skip(f"[item {i + 1}]", str(exc))
            continue
        rid = str(rec[ref.id_field]) if ref.id_field and rec.get(ref.id_field) is not None else str(i)
        problems.append(BenchmarkProblem(id=f"{name}/{rid}", problem=question, answer=answer, source=name))
    report.n_records = len(problems)
    return BenchmarkSet(name=name, problems=problems, report=report)
