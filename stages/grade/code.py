"""Grading model-written code against test cases, in the sandbox, in parallel.

Two test styles, as the shipped data sets define them:

- ``stdio`` (Codeforces, TACO, APPS): a list of ``{"input", "output"}`` pairs;
  the program reads ``input`` on stdin -- one sandbox launch per response, a
  fresh process per case (:meth:`stages.grade.sandbox.Sandbox.run_cases`) -- and its
  stdout must equal ``output`` token by token
  (:func:`stages.grade.stdio_match.outputs_match`: line
  breaks, trailing spaces and blank lines do not matter). Each token is
  compared by the *expected* token's kind: an integer exactly (only an integer
  of the same value matches); a float or ``p/q`` within 1e-6 absolute or
  relative (``0.333333333`` matches ``1/3``, ``5e-1`` matches ``0.5``); any
  other token exactly, or ignoring letter case when the statement says answers
  may be printed in any case (``"any_case"`` in the grading spec).
- ``functional`` (LeetCode): a ``check(candidate)`` function of ``assert``
  statements and a last line ``check(Solution().method)``. Each assert is split
  at parse time into the call (``candidate(...)``) and the expected literal
  (``== literal``, ``is_same_list(call, list_node(literal))``,
  ``is_same_tree(call, tree_node(literal))``; any other shape is refused).
  The sandbox runs a harness (:mod:`stages.grade.in_sandbox.leetcode_harness`)
  with the solution beside it; the harness evaluates the *calls*,
  each under its own timer (``per_test_s``); the expected values never enter
  the program's process. Each return value crosses to the grader as tagged
  plain data (ints, floats, strings, containers, linked lists and trees by
  value) on the result channel -- fd 3, a pipe the sandbox opens before the
  program starts -- one line per case, prefixed with a per-run nonce; the
  grader decodes it and decides equality in its own process. An object that
  is not plain data (a custom ``__eq__``) fails its case; a forged record is
  only a claim about a return value, which the grader checks like any other;
  a case claimed twice fails. The program's own prints go to /dev/null.

What a run's outcome means (one meaning each):

- exit status 0 (the program's own, reported by its namespace's init): the
  only clean exit; a stdio case counts only after one.
- non-zero exit or any signal, its own ``SIGKILL`` included: the case fails
  (stdio); for functional tests the cases recorded before it keep their
  verdict (a run killed at the wall clock keeps the cases it finished).
- stdout past ``output_bytes``: the program is killed and the case fails; a
  truncated output is never compared.

Limits: ``per_test_s`` for one case, ``per_sample_s`` for all cases of one
response (cases left when it runs out fail), and the batch deadline
(``batch_wall_s`` of :class:`CodeGradingConfig`): :func:`grade_code_batch`
never holds up the step longer than that -- responses not started by then score
0 with status ``"deadline"``, running ones are cut at it. docs/sandbox.md has
the table of what the sandbox guarantees and what it does not.

The modules: :mod:`stages.grade.code_tests` (parsing tests),
:mod:`stages.grade.stdio_match` (stdout against a case),
:mod:`stages.grade.functional` (the harness run and its verdicts), this one
(grading a response and a batch).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Literal, Sequence

from fp8rl_core.config.model import CodeConfig
from fp8rl_core.tasks import code as code_task
from stages.grade.code_tests import CodeTests, parse_tests
from stages.grade.functional import functional_case_passes, functional_run, read_records
from stages.grade.result import GradeResult
from stages.grade.sandbox import Sandbox
from stages.grade.sandbox_limits import SandboxLimits
from stages.grade.stdio_match import outputs_match

GradeStatus = Literal["ok", "no_code", "bad_tests", "deadline", "sandbox_error"]

_FENCE_RE = re.compile(r"```(?:python|py|Python3|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The last fenced code block of ``response`` (```python ... ```); ``None`` when there is none."""
    blocks = _FENCE_RE.findall(response)
    if not blocks:
        return None
    code = blocks[-1].strip("\n")
    return code if code.strip() else None


@dataclass(frozen=True)
class CodeGrade:
    """Outcome of one response: ``passed`` of ``total`` cases (reward: pass/fail over all)."""

    id: str
    passed: int
    total: int
    status: GradeStatus
    seconds: float
    detail: str = ""

    @property
    def correct(self) -> bool:
        return self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


def grade_program(
    sandbox: Sandbox,
    code: str | None,
    tests: CodeTests,
    *,
    per_test_s: float,
    per_sample_s: float,
    item_id: str = "",
    deadline: float | None = None,
) -> CodeGrade:
    """Run ``code`` against ``tests``; see the module docstring for the limits."""
    t0 = time.monotonic()
    end = t0 + per_sample_s if deadline is None else min(t0 + per_sample_s, deadline)
    total = tests.n_cases
    if code is None:
        return CodeGrade(item_id, 0, total, "no_code", 0.0, "no code block")
    if tests.kind == "functional":
        return _grade_functional(sandbox, code, tests, per_test_s, end, item_id, t0)
    left = end - time.monotonic()
    results = sandbox.run_cases(
        code, [c.input for c in tests.cases], case_wall_s=per_test_s, total_wall_s=max(0.1, left)
    )
    passed, detail = 0, ""
    for i, (case, res) in enumerate(zip(tests.cases, results)):
        if res is None:
            detail = detail or f"per-sample limit reached after {i} of {total} cases"
            break
        if res.status == "sandbox_error":
            return CodeGrade(
                item_id,
                0,
                total,
                "sandbox_error",
                time.monotonic() - t0,
                (res.detail + " " + res.stderr[-300:]).strip(),
            )
        if res.status == "ok" and outputs_match(res.stdout, case.output, tests.case_insensitive):
            passed += 1
        elif not detail:
            tail = res.stderr.strip().splitlines()[-1][:200] if res.stderr.strip() else ""
            detail = " ".join(x for x in (f"case {i}:", res.status, res.detail, tail) if x)
    return CodeGrade(item_id, passed, total, "ok", time.monotonic() - t0, detail)


def _grade_functional(
    sandbox: Sandbox, code: str, tests: CodeTests, per_test_s: float, end: float, item_id: str, t0: float
) -> CodeGrade:
    """One sandbox run for all cases; a case passes when its record arrived on the result
    channel and its value equals the expected one, decided here. The run's exit status adds
    detail only: cases recorded before a crash or the wall clock keep their verdict."""
    total = tests.n_cases
    nonce = secrets.token_hex(8)
    run = functional_run(code, tests, per_test_s, nonce)
    wall = min(end - time.monotonic(), per_test_s * (len(tests.statements) + 1) + 2.0)
    res = sandbox.run(
        run.source, b"", wall_s=max(0.1, wall), cpu_s=max(1, math.ceil(wall)), channel=True, files=run.files
    )
    if res.status == "sandbox_error":
        return CodeGrade(
            item_id, 0, total, "sandbox_error", time.monotonic() - t0, (res.detail + " " + res.stderr[-300:]).strip()
        )
    records = read_records(res.channel, nonce, total)
    verdicts = [functional_case_passes(c, records.get(k)) for k, c in enumerate(tests.functional_cases)]
    passed = sum(verdicts)
    detail = res.status if res.status != "ok" else ""
    if passed < total:
        k = verdicts.index(False)
        detail = " ".join(x for x in (detail, f"case {k}: {(records.get(k) or 'no record')[:120]}") if x)
        if res.stderr.strip():
            detail += " " + res.stderr.strip().splitlines()[-1][:200]
    return CodeGrade(item_id, passed, total, "ok", time.monotonic() - t0, detail)


@dataclass(frozen=True)
class CodeGradingConfig:
    """Grading limits (mirrors ``fp8rl_core.config.model.CodeConfig``; defaults: our choice)."""

    per_test_s: float = 4.0
    per_sample_s: float = 20.0
    batch_wall_s: float = 120.0
    max_sandboxes: int = 4
    memory_mb: int = 1024
    output_bytes: int = 1 << 20
    nproc: int = 32
    allow_unisolated: bool = False


_SANDBOXES: dict[tuple, Sandbox] = {}


def get_sandbox(cfg: CodeGradingConfig) -> Sandbox:
    """One :class:`Sandbox` per distinct limits (the isolation probe runs once)."""
    lim = SandboxLimits(
        wall_s=max(cfg.per_test_s, 0.1) + 1.0,
        cpu_s=max(1, math.ceil(cfg.per_test_s)),
        memory_mb=cfg.memory_mb,
        output_bytes=cfg.output_bytes,
        nproc=cfg.nproc,
    )
    key = (lim, cfg.allow_unisolated)
    if key not in _SANDBOXES:
        _SANDBOXES[key] = Sandbox(lim, allow_unisolated=cfg.allow_unisolated)
    return _SANDBOXES[key]


def grade_code_batch(
    ids: Sequence[str], codes: Sequence[str | None], tests: Sequence[CodeTests], cfg: CodeGradingConfig | None = None
) -> list[CodeGrade]:
    """Grade many responses with up to ``cfg.max_sandboxes`` sandboxes at once;
    returns in input order, within ``cfg.batch_wall_s`` (plus the kill time)."""
    cfg = cfg or CodeGradingConfig()
    if not len(ids) == len(codes) == len(tests):
        raise ValueError(f"grade_code_batch: {len(ids)} ids, {len(codes)} codes, {len(tests)} tests")
    sandbox = get_sandbox(cfg)
    deadline = time.monotonic() + cfg.batch_wall_s

    def one(i: int) -> CodeGrade:
        if time.monotonic() >= deadline:
            return CodeGrade(ids[i], 0, tests[i].n_cases, "deadline", 0.0, f"batch limit {cfg.batch_wall_s}s reached")
        return grade_program(
            sandbox,
            codes[i],
            tests[i],
            per_test_s=cfg.per_test_s,
            per_sample_s=cfg.per_sample_s,
            item_id=ids[i],
            deadline=deadline,
        )

    if len(ids) <= 1 or cfg.max_sandboxes <= 1:
        return [one(i) for i in range(len(ids))]
    with ThreadPoolExecutor(max_workers=cfg.max_sandboxes, thread_name_prefix="fp8rl-sandbox") as pool:
        return list(pool.map(one, range(len(ids))))


# ----------------------------------------------------------------- the "code" and "code_expr" verifiers
def grading_config(code: CodeConfig | None) -> CodeGradingConfig:
    """The grading limits of ``code`` (defaults: :class:`CodeConfig`'s): each field of
    :class:`CodeGradingConfig` takes the value of the section's field of that name."""
    c = code or CodeConfig()
    return CodeGradingConfig(**{f.name: getattr(c, f.name) for f in fields(CodeGradingConfig)})


def grade_code_responses(
    ids: Sequence[str], responses: Sequence[str], specs: Sequence[str], verifier: str, code: CodeConfig | None = None
) -> list[GradeResult]:
    """Grade responses against grading specs in the sandbox: correct = every test passed;
    ``fraction`` = share passed; ``extracted`` = the program run (``None``: no code)."""
    codes: list[str | None] = []
    tests = []
    extracted: list[str | None] = []
    for resp, spec in zip(responses, specs):
        s = json.loads(spec)
        tests.append(replace(parse_tests(s["tests"]), case_insensitive=bool(s.get("any_case"))))
        if verifier == "code_expr" or s.get("style") == "expression":
            expr = code_task.extract_expression(resp)
            extracted.append(expr)
            codes.append(code_task.program_for(expr) if expr is not None else None)
        else:
            prog = extract_code(resp)
            extracted.append(prog)
            codes.append(prog)
    grades = grade_code_batch(list(ids), codes, tests, grading_config(code))
    out = []
    for g, ex in zip(grades, extracted):
        status = (
            "no_answer"
            if g.status == "no_code"
            else ("timeout" if g.status == "deadline" else ("error" if g.status != "ok" else "ok"))
        )
        out.append(GradeResult(g.id, g.correct, ex, status, g.seconds, g.detail, fraction=g.fraction))
    return out
