"""Code-RL problem loaders, prompts and the sandboxed verifiers' entry point.

Every source becomes :class:`stages.data.benchmarks.BenchmarkProblem` records whose
``answer`` is a *grading spec*: JSON ``{"style": "program"|"expression",
"tests": <tests as parse_tests reads them>}`` — so the rollout, score and
evaluate stages carry it in ``reference_answer`` like a math gold answer, and
the ``"code"`` / ``"code_expr"`` verifiers (:func:`stages.grade.code.grade_code_responses`) run it.
A stdin/stdout problem whose statement accepts answers in any letter case
(:func:`stages.grade.stdio_match.statement_allows_any_case`) carries ``"any_case": true``;
every other comparison is case-exact.

=============  ===================================================  =============================
name           where                                                tests
=============  ===================================================  =============================
leetcode       code_rl_rllm/leetcode_test.json (200)                functional ``check()``
leetcode_train code_rl_rllm/leetcode_train.json (1889)              functional ``check()``
codeforces     code_rl_rllm/codeforces_test.json (408)              stdin/stdout list
taco           HF ``BAAI/TACO`` (test)                              ``input_output`` JSON
apps           HF ``codeparrot/apps`` (test)                        ``input_output`` JSON
eurus_code     HF ``PRIME-RL/Eurus-2-RL-Data`` (train, ability      ``reward_model.ground_truth``
               = code)                                              JSON
code_tiny      generated (fp8rl_core.tasks.code, test split)         hidden inputs, one case
=============  ===================================================  =============================

HF sources are read with ``datasets`` on machines with a network; here their
record parsers are tested on records of the published shapes. A record that
cannot be graded (no tests, call-style ``fn_name`` tests, unparsable tests) is
skipped and reported in the :class:`LoadReport`, never silently dropped.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from fp8rl_core.config.model import CodeConfig, TaskConfig
from fp8rl_core.tasks import code as code_task
from stages.data.benchmarks import (
    BenchmarkProblem,
    BenchmarkSet,
    LoadReport,
    missing_data_file,
    no_data_folder,
    resolve_data_dir,
)
from stages.grade.code_tests import parse_tests
from stages.grade.stdio_match import statement_allows_any_case

log = logging.getLogger(__name__)

SHIPPED_DIR = "code_rl_rllm"


@dataclass(frozen=True)
class CodeSource:
    style: str  # "functional" | "stdio" (for the prompt template)
    relpath: str | None = None  # under the data folder
    hf: tuple[str, str | None, str] | None = None
    parser: Callable[[dict[str, Any], int], tuple[str, str, Any] | None] | None = None  # -> (id, statement, tests)


def _rllm(rec: dict[str, Any], i: int) -> tuple[str, str, Any]:
    if "problem" not in rec or "tests" not in rec:
        raise ValueError("missing 'problem' or 'tests'")
    return str(i), str(rec["problem"]).strip(), rec["tests"]


def _taco_apps(rec: dict[str, Any], i: int) -> tuple[str, str, Any]:
    io = rec.get("input_output")
    if not io:
        raise ValueError("no input_output tests")
    return str(rec.get("problem_id", rec.get("id", i))), str(rec["question"]).strip(), io


def _eurus(rec: dict[str, Any], i: int) -> tuple[str, str, Any] | None:
    if rec.get("ability") != "code":
        return None  # a math record of the mixed set: not a code problem, not an error
    prompt = rec.get("prompt")
    if isinstance(prompt, list):
        text = "\n".join(str(m.get("content", "")) for m in prompt if m.get("role") == "user")
    else:
        text = str(prompt or "")
    gt = (rec.get("reward_model") or {}).get("ground_truth")
    if not gt:
        raise ValueError("no reward_model.ground_truth tests")
    return str((rec.get("extra_info") or {}).get("index", i)), text.strip(), gt


CODE_SOURCES: dict[str, CodeSource] = {
    "leetcode": CodeSource("functional", f"{SHIPPED_DIR}/leetcode_test.json", parser=_rllm),
    "leetcode_train": CodeSource("functional", f"{SHIPPED_DIR}/leetcode_train.json", parser=_rllm),
    "codeforces": CodeSource("stdio", f"{SHIPPED_DIR}/codeforces_test.json", parser=_rllm),
    "taco": CodeSource("stdio", hf=("BAAI/TACO", None, "test"), parser=_taco_apps),
    "apps": CodeSource("stdio", hf=("codeparrot/apps", None, "test"), parser=_taco_apps),
    "eurus_code": CodeSource("stdio", hf=("PRIME-RL/Eurus-2-RL-Data", None, "train"), parser=_eurus),
}
CODE_BENCHMARKS = frozenset(CODE_SOURCES) | {"code_tiny"}


def render_code_prompt(statement: str, style: str, code: CodeConfig) -> str:
    tmpl = code.functional_template if style == "functional" else code.stdio_template
    return tmpl.format(problem=statement)


def records_to_set(
    name: str, path: str, rows: Sequence[dict[str, Any]], source: CodeSource, limit: int | None, code: CodeConfig
) -> BenchmarkSet:
    """Parse raw records (from a file or a HF split) into problems whose answer is the grading spec."""
    report = LoadReport(source=name, path=path)
    out: list[BenchmarkProblem] = []
    assert source.parser is not None
    for i, rec in enumerate(rows):
        if limit is not None and len(out) >= limit:
            break
        where = f"[item {i + 1}]"
        try:
            parsed = source.parser(dict(rec), i)
            if parsed is None:
                continue
            rid, statement, tests = parsed
            parsed_tests = parse_tests(tests)
        except (ValueError, KeyError, TypeError) as exc:
            report.skip(where, str(exc))
            continue
        style = "functional" if parsed_tests.kind == "functional" else "stdio"
        spec_d: dict[str, Any] = {"style": "program", "tests": tests}
        if style == "stdio" and statement_allows_any_case(statement):
            spec_d["any_case"] = True  # the statement accepts letters in any case
        spec = json.dumps(spec_d)
        out.append(
            BenchmarkProblem(
                id=f"{name}/{rid}", problem=render_code_prompt(statement, style, code), answer=spec, source=name
            )
        )
    report.n_records = len(out)
    return BenchmarkSet(name=name, problems=out, report=report)


def load_code_tiny(limit: int | None, task: TaskConfig | None, split: str = "test") -> BenchmarkSet:
    task = task or TaskConfig()
    n = limit if limit is not None else 500
    problems = []
    for i in range(n):
        p = code_task.make_problem(i, split, task.seed)
        spec = json.dumps({"style": "expression", "tests": json.loads(p.tests)})
        problems.append(BenchmarkProblem(id=p.id, problem=p.prompt, answer=spec, source="code_tiny"))
    return BenchmarkSet("code_tiny", problems, LoadReport("code_tiny", f"code_tiny:s{task.seed}:{split}", n_records=n))


def load_code_benchmark(
    name: str,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    *,
    task: TaskConfig | None = None,
    code: CodeConfig | None = None,
    hub: bool = False,
    path: str | Path | None = None,
) -> BenchmarkSet:
    """Load code source ``name`` (one of :data:`CODE_BENCHMARKS`); ``path`` overrides the file."""
    code = code or CodeConfig()
    if name == "code_tiny":
        return load_code_tiny(limit, task)
    if name not in CODE_SOURCES:
        raise KeyError(f"unknown code benchmark {name!r}; valid: {', '.join(sorted(CODE_BENCHMARKS))}")
    src = CODE_SOURCES[name]
    root = resolve_data_dir(data_dir)
    file = Path(path) if path is not None else (root / src.relpath if root is not None and src.relpath else None)
    if file is not None and not file.is_absolute() and root is not None:
        file = root / file
    if file is not None:
        if not file.is_file():
            raise missing_data_file(name, file)
        items = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(items, list):
            raise ValueError(f"{file}: expected a JSON list of objects")
        return records_to_set(name, str(file), items, src, limit, code)
    if src.hf is None or not hub:
        raise no_data_folder(name, src.relpath, hub=src.hf is not None)
    return _load_hf(name, src, limit, code)  # pragma: no cover - needs a network


def _load_hf(name: str, src: CodeSource, limit: int | None, code: CodeConfig) -> BenchmarkSet:  # pragma: no cover
    import datasets

    dataset, config, split = src.hf  # type: ignore[misc]
    rows = datasets.load_dataset(dataset, config, split=split)
    return records_to_set(name, f"hf://{dataset}/{config or ''}:{split}", rows, src, limit, code)


def verifier_of(name: str) -> str:
    return "code_expr" if name == "code_tiny" else "code"
