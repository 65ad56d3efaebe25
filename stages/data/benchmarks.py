"""Benchmark and training-prompt loaders: one record type for every source.

Every evaluation benchmark becomes a list of :class:`BenchmarkProblem`
``(id, problem, answer, source)``, where ``answer`` is the bare gold answer the
``"math"`` verifier compares against:

=============  ======================================  =======  =====================================
name           file under the data folder              records  gold answer
=============  ======================================  =======  =====================================
aime24         aime24/test.jsonl                       30       ``answer``
aime25         aime25/aime25_from_matharena.DERIVED    30       ``answer`` (the AReaL test.jsonl has
                 .jsonl                                          corrupted escapes; see its SOURCE.txt)
amc23          amc23/test.jsonl                        40       ``answer`` (a JSON float; 27.0 -> "27")
math500        math500/test.jsonl                      500      ``answer``
minerva_math   minerva_math/test.jsonl                 272      the last ``\\boxed{}`` of ``solution``
olympiadbench  olympiadbench/test.jsonl                675      ``final_answer`` list, ``$`` stripped,
                                                                 joined with ", " when several
gsm8k          gsm8k/test.jsonl                        1319     the number after ``####``
synthetic      (generated: the synthetic test split)   limit    :func:`fp8rl_core.tasks.synthetic.make_problem`
=============  ======================================  =======  =====================================

The data folder is the ``data_dir`` argument, else ``$FP8RL_DATA_DIR``. Without
either, ``hub=True`` reads the benchmark's Hugging Face dataset (``Source.hf``)
with ``datasets`` — a path for machines with a network, not exercised here;
otherwise the loader stops with an error that names the variable.

A malformed line (bad JSON, a missing field, no ``\\boxed{}`` or ``####``) is
*reported*: logged with its file and line number, skipped and counted in the
:class:`LoadReport` that travels with the records; it is never silently dropped.

Training prompts (:func:`load_train_prompts`) use the same record: DeepScaleR-
format JSON (a list of ``{problem, answer, ...}``) and GSM8K train.

Prompts: real benchmarks use the usual base-model template (:func:`render_prompt`:
the question + :data:`BOXED_INSTRUCTION`) and the ``"math"`` verifier; the
synthetic task's prompt is already complete and uses the ``"synthetic"`` verifier
(:func:`verifier_for`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from fp8rl_core.config.model import TaskConfig
from fp8rl_core.registry import Registry
from fp8rl_core.tasks.kinds import TASK_KINDS, procedural_task
from fp8rl_core.tasks.verifiers import last_boxed

log = logging.getLogger(__name__)

DATA_DIR_ENV = "FP8RL_DATA_DIR"
# What a data folder holds, said by every message that asks for one.
DATA_FOLDER = (
    "the folder of benchmark files, one subfolder per benchmark "
    "(aime24/test.jsonl, math500/test.jsonl, gsm8k/train.jsonl, code_rl_rllm/leetcode_test.json, ...)"
)
BOXED_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SYNTHETIC_DEFAULT_SIZE = 1000  # problems of the synthetic test split when no limit is given


@dataclass(frozen=True)
class BenchmarkProblem:
    """One problem of any source. ``problem`` is the question text (for the
    synthetic task: the full prompt), ``answer`` the bare gold answer."""

    id: str
    problem: str
    answer: str
    source: str


@dataclass
class LoadReport:
    """What a loader read: records kept, and every line skipped with its reason."""

    source: str
    path: str
    n_records: int = 0
    skipped: list[str] = field(default_factory=list)  # "file:line: reason" or "file[item n]: reason"

    @property
    def n_skipped(self) -> int:
        return len(self.skipped)

    def skip(self, where: str, reason: str) -> None:
        """Record a skipped record; ``where`` is ``"12"`` (a line of a .jsonl
        file) or ``"[item 12]"`` (an element of a JSON list)."""
        msg = f"{self.path}{where}: {reason}" if where.startswith("[") else f"{self.path}:{where}: {reason}"
        self.skipped.append(msg)
        log.warning("skipped malformed record (%s) %s", self.source, msg)


@dataclass
class BenchmarkSet:
    """Records of one source plus the report of their loading (a sequence)."""

    name: str
    problems: list[BenchmarkProblem]
    report: LoadReport

    def __len__(self) -> int:
        return len(self.problems)

    def __iter__(self) -> Iterator[BenchmarkProblem]:
        return iter(self.problems)

    def __getitem__(self, i: int) -> BenchmarkProblem:
        return self.problems[i]


class MalformedRecord(ValueError):
    """A record that cannot give (problem, answer); the message says why."""


# ---------------------------------------------------------------- field parsers
RecordParser = Callable[[dict[str, Any], int], tuple[str, str, str]]  # -> (id, problem, answer)


def _text(rec: dict[str, Any], *keys: str) -> str:
    for key in keys:
        val = rec.get(key)
        if isinstance(val, str) and val.strip():
            return val
    raise MalformedRecord(f"no non-empty text field among {keys}")


def _answer_str(val: Any) -> str:
    """Gold answer as a string; integral floats lose their '.0' (27.0 -> "27")."""
    if isinstance(val, bool) or val is None:
        raise MalformedRecord(f"answer is {val!r}")
    if isinstance(val, float):
        return str(int(val)) if val.is_integer() else repr(val)
    if isinstance(val, int):
        return str(val)
    if isinstance(val, str) and val.strip():
        return val.strip()
    raise MalformedRecord(f"answer is {val!r}")


def _rec_id(rec: dict[str, Any], index: int, *keys: str) -> str:
    for key in keys:
        if rec.get(key) is not None:
            return str(rec[key])
    return str(index)


def _plain(rec: dict[str, Any], index: int) -> tuple[str, str, str]:
    """problem/question + answer (AIME, AMC, MATH-500, DeepScaleR)."""
    return _rec_id(rec, index, "id", "unique_id"), _text(rec, "problem", "question"), _answer_str(rec.get("answer"))


def _minerva(rec: dict[str, Any], index: int) -> tuple[str, str, str]:
    boxed = last_boxed(_text(rec, "solution"))
    if boxed is None or not boxed.strip():
        raise MalformedRecord("solution has no \\boxed{} answer")
    return _rec_id(rec, index, "idx", "id"), _text(rec, "problem", "question"), boxed.strip()


def _olympiad(rec: dict[str, Any], index: int) -> tuple[str, str, str]:
    answers = rec.get("final_answer")
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise MalformedRecord(f"final_answer is not a non-empty list of strings: {answers!r}")
    gold = ", ".join(a.strip().strip("$").strip() for a in answers)
    if not gold:
        raise MalformedRecord("final_answer is empty")
    return _rec_id(rec, index, "id"), _text(rec, "question", "problem"), gold


_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


def _gsm8k(rec: dict[str, Any], index: int) -> tuple[str, str, str]:
    m = _GSM8K_ANSWER.search(_text(rec, "answer"))
    if not m:
        raise MalformedRecord("answer has no '#### n' final line")
    return _rec_id(rec, index, "id"), _text(rec, "question"), m.group(1).replace(",", "").strip()


_DAPO_HEAD = "The last line of your response should be of the form Answer: $Answer"
_DAPO_TAIL = "\n\nRemember to put your answer on its own line after"


def _dapo_math(rec: dict[str, Any], index: int) -> tuple[str, str, str]:
    """DAPO-Math-17K (verl format): prompt = chat messages whose user turn wraps the problem in
    DAPO's answer-format instruction (stripped here: our prompt template asks for its own format);
    answer = reward_model.ground_truth."""
    msgs = rec.get("prompt")
    text = (
        next((m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "user"), None)
        if isinstance(msgs, list)
        else _text(rec, "prompt", "problem")
    )
    if not isinstance(text, str) or not text.strip():
        raise MalformedRecord("no user prompt")
    if _DAPO_HEAD in text.split("\n\n", 1)[0]:
        text = text.split("\n\n", 1)[1] if "\n\n" in text else text
    text = text.split(_DAPO_TAIL, 1)[0].strip()
    truth = (
        (rec.get("reward_model") or {}).get("ground_truth")
        if isinstance(rec.get("reward_model"), dict)
        else rec.get("answer")
    )
    extra = rec.get("extra_info") if isinstance(rec.get("extra_info"), dict) else {}
    rid = str(extra.get("index")) if extra.get("index") is not None else _rec_id(rec, index, "id")
    return rid, text, _answer_str(truth)


# ---------------------------------------------------------------- sources
@dataclass(frozen=True)
class Source:
    """Where a benchmark lives and how its records read."""

    relpath: str  # under the data folder
    parser: RecordParser
    hf: tuple[str, str | None, str] | None = None  # (dataset, config, split) for network machines


SOURCES: Registry[Source] = Registry("benchmark")
SOURCES.register("aime24")(Source("aime24/test.jsonl", _plain, ("HuggingFaceH4/aime_2024", None, "train")))
SOURCES.register("aime25")(
    Source("aime25/aime25_from_matharena.DERIVED.jsonl", _plain, ("math-ai/aime25", None, "test"))
)
SOURCES.register("amc23")(Source("amc23/test.jsonl", _plain, ("math-ai/amc23", None, "test")))
SOURCES.register("math500")(Source("math500/test.jsonl", _plain, ("HuggingFaceH4/MATH-500", None, "test")))
SOURCES.register("minerva_math")(Source("minerva_math/test.jsonl", _minerva, ("math-ai/minervamath", None, "test")))
SOURCES.register("olympiadbench")(
    Source("olympiadbench/test.jsonl", _olympiad, ("math-ai/olympiadbench", None, "test"))
)
SOURCES.register("gsm8k")(Source("gsm8k/test.jsonl", _gsm8k, ("openai/gsm8k", "main", "test")))
TRAIN_SOURCES: Registry[Source] = Registry("training prompt source")
TRAIN_SOURCES.register("deepscaler")(
    Source("deepscaler_train_partial/math.json", _plain, ("agentica-org/DeepScaleR-Preview-Dataset", None, "train"))
)
TRAIN_SOURCES.register("gsm8k")(Source("gsm8k/train.jsonl", _gsm8k, ("openai/gsm8k", "main", "train")))
# DAPO's training set (Yu et al. 2025), by its Hugging Face name; not in the offline data folder
TRAIN_SOURCES.register("dapo_math")(
    Source("dapo_math_17k/train.jsonl", _dapo_math, ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train"))
)

BENCHMARK_NAMES = tuple(SOURCES.names()) + ("synthetic",)


def resolve_data_dir(data_dir: str | Path | None) -> Path | None:
    """``data_dir``, else ``$FP8RL_DATA_DIR``, else ``None`` (no local data)."""
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get(DATA_DIR_ENV)
    return Path(env) if env else None


def _raw_records(path: Path) -> Iterator[tuple[int, str, dict[str, Any] | None, str]]:
    """(1-based number, location, record or None, error) from a .jsonl file
    (location = line number) or a JSON-list file (location = "[item n]")."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        for no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                yield no, str(no), None, f"invalid JSON ({exc.msg} at column {exc.colno})"
                continue
            yield (
                (no, str(no), rec, "") if isinstance(rec, dict) else (no, str(no), None, "record is not a JSON object")
            )
        return
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{exc.lineno}: invalid JSON file ({exc.msg}); expected a list of objects") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of objects, got {type(items).__name__}")
    for no, rec in enumerate(items, start=1):
        where = f"[item {no}]"
        yield (no, where, rec, "") if isinstance(rec, dict) else (no, where, None, "item is not a JSON object")


def _load_file(name: str, path: Path, parser: RecordParser, limit: int | None) -> BenchmarkSet:
    if not path.is_file():
        raise missing_data_file(name, path)
    report = LoadReport(source=name, path=str(path))
    problems: list[BenchmarkProblem] = []
    for no, where, rec, error in _raw_records(path):
        if limit is not None and len(problems) >= limit:
            break
        if rec is None:
            report.skip(where, error)
            continue
        try:
            rid, problem, answer = parser(rec, no - 1)
        except MalformedRecord as exc:
            report.skip(where, str(exc))
            continue
        problems.append(BenchmarkProblem(id=f"{name}/{rid}", problem=problem, answer=answer, source=name))
    report.n_records = len(problems)
    return BenchmarkSet(name=name, problems=problems, report=report)


def missing_data_file(name: str, path: Path) -> FileNotFoundError:
    """The error for a file the data folder lacks: which file, and what the folder must hold."""
    return FileNotFoundError(
        f"{name}: data file {path} not found; {DATA_DIR_ENV} (or task.data_dir) must name {DATA_FOLDER}"
    )


def no_data_folder(name: str, relpath: str | None, *, hub: bool = True) -> FileNotFoundError:
    """The error for a loader given no data folder: the variable to set and what the folder must hold
    (``relpath``: the file ``name`` reads there; ``hub``: whether a Hugging Face dataset can stand in)."""
    reads = f" ({name} reads {relpath} there)" if relpath else ""
    online = ", or pass hub=True on a machine with network access" if hub else ""
    return FileNotFoundError(
        f"{name}: no data folder: set {DATA_DIR_ENV} (or task.data_dir) to {DATA_FOLDER}{reads}{online}"
    )


def _load_hf(name: str, source: Source, limit: int | None) -> BenchmarkSet:  # pragma: no cover - needs a network
    if source.hf is None:
        raise FileNotFoundError(f"{name}: no Hugging Face dataset is known for this source")
    import datasets

    dataset, config, split = source.hf
    rows = datasets.load_dataset(dataset, config, split=split)
    report = LoadReport(source=name, path=f"hf://{dataset}/{config or ''}:{split}")
    problems: list[BenchmarkProblem] = []
    for i, rec in enumerate(rows):
        if limit is not None and len(problems) >= limit:
            break
        try:
            rid, problem, answer = source.parser(dict(rec), i)
        except MalformedRecord as exc:
            report.skip(f"[item {i + 1}]", str(exc))
            continue
        problems.append(BenchmarkProblem(id=f"{name}/{rid}", problem=problem, answer=answer, source=name))
    report.n_records = len(problems)
    return BenchmarkSet(name=name, problems=problems, report=report)


def load_synthetic(limit: int | None = None, task: TaskConfig | None = None) -> BenchmarkSet:
    """The synthetic test split as benchmark records (``limit`` problems,
    default :data:`SYNTHETIC_DEFAULT_SIZE`), at ``task``'s difficulty and seed."""
    task = task if task is not None else TaskConfig()
    n = limit if limit is not None else SYNTHETIC_DEFAULT_SIZE
    problems = []
    kind = task.kind if TASK_KINDS.get(task.kind).procedural else "synthetic"  # a procedural kind: its own split
    make = procedural_task(kind).make_problem
    for i in range(n):
        p = make(i, "test", task.difficulty, task.seed)
        problems.append(BenchmarkProblem(id=p.id, problem=p.prompt, answer=p.answer, source="synthetic"))
    report = LoadReport(source="synthetic", path=f"{kind}:d{task.difficulty}:s{task.seed}:test", n_records=n)
    return BenchmarkSet(name="synthetic", problems=problems, report=report)


def load_benchmark(
    name: str,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    *,
    task: TaskConfig | None = None,
    hub: bool = False,
) -> BenchmarkSet:
    """Load benchmark ``name`` (one of :data:`BENCHMARK_NAMES`).

    Files come from ``data_dir`` or ``$FP8RL_DATA_DIR``; with neither set and
    ``hub=True``, from the Hugging Face Hub. ``limit`` keeps the first N
    problems. ``task`` sets the difficulty and seed of ``"synthetic"`` (ignored
    otherwise).
    """
    if name == "synthetic":
        return load_synthetic(limit, task)
    source = SOURCES.get(name)
    root = resolve_data_dir(data_dir)
    if root is None:
        if not hub:
            raise no_data_folder(name, source.relpath, hub=source.hf is not None)
        return _load_hf(name, source, limit)
    return _load_file(name, root / source.relpath, source.parser, limit)


def load_train_prompts(
    kind: str,
    path: str | Path | None = None,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    *,
    hub: bool = False,
) -> BenchmarkSet:
    """Training prompts of ``kind`` (``"deepscaler"`` or ``"gsm8k"``).

    ``path`` is a file (absolute, or relative to the data folder) or a Hugging
    Face dataset name (with ``hub=True``); ``None`` takes the default file of
    the kind (the partial DeepScaleR MATH split, GSM8K train).
    """
    source = TRAIN_SOURCES.get(kind)
    root = resolve_data_dir(data_dir)
    if path is not None:
        p = Path(path)
        if not p.is_absolute() and root is not None:
            p = root / p
        if p.is_file():
            return _load_file(kind, p, source.parser, limit)
        if hub and not p.suffix:  # pragma: no cover - a hub name on a network machine
            return _load_hf(kind, Source(source.relpath, source.parser, (str(path), None, "train")), limit)
        raise FileNotFoundError(f"{kind}: training prompt file {p} not found")
    if root is None:
        if not hub:
            raise no_data_folder(kind, source.relpath, hub=source.hf is not None)
        return _load_hf(kind, source, limit)
    return _load_file(kind, root / source.relpath, source.parser, limit)


def render_prompt(problem: BenchmarkProblem) -> str:
    """The model input for ``problem``: the synthetic prompt as is; otherwise the
    question followed by the step-by-step / ``\\boxed{}`` instruction."""
    if problem.source == "synthetic":
        return problem.problem
    return f"{problem.problem.strip()} {BOXED_INSTRUCTION}"


def verifier_for(problem: BenchmarkProblem) -> str:
    """Name of the verifier (in ``fp8rl_core.tasks.verifiers.VERIFIERS``) that grades it."""
    return "synthetic" if problem.source == "synthetic" else "math"
