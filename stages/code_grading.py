"""Grading model-written code against test cases, in the sandbox, in parallel.

Two test styles, as the shipped data sets define them:

- ``stdio`` (Codeforces, TACO, APPS): a list of ``{"input", "output"}`` pairs;
  the program reads ``input`` on stdin, one sandbox run per case, and its
  stdout must equal ``output`` under the usual whitespace rules
  (:func:`outputs_match`: compared token by token, so line breaks, trailing
  spaces and blank lines do not matter; tokens that both parse as numbers also
  match within 1e-6 absolute or relative).
- ``functional`` (LeetCode): a ``check(candidate)`` function of ``assert``
  statements and a last line ``check(Solution().method)``. The solution and a
  harness run in *one* sandbox run: the harness evaluates every statement of
  ``check``'s body in order, each ``assert`` is one test case, each under its
  own timer (``per_test_s``); an exception of any kind -- ``SystemExit``
  included -- fails that case. Results go to a private duplicate of the
  original stdout, one line per case as soon as it is known, so a run killed at
  the wall clock still keeps the cases it finished; the program's own prints go
  to /dev/null.

Limits: ``per_test_s`` for one case, ``per_sample_s`` for all cases of one
response (cases left when it runs out fail), and the batch deadline
(``batch_wall_s`` of :class:`CodeGradingConfig`): :func:`grade_code_batch`
never holds up the step longer than that -- responses not started by then score
0 with status ``"deadline"``, running ones are cut at it.

Known limit (reward hacking, not machine safety): the functional harness runs
in the program's process, so a program written to tamper with the harness
(patch builtins, return objects whose ``__eq__`` is always true, write forged
result lines to the duplicated descriptor) can earn a reward it did not
deserve; it cannot escape the sandbox. The stdio style has no such hole.
"""

from __future__ import annotations

import ast
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from stages.sandbox import Sandbox, SandboxLimits

GradeStatus = Literal["ok", "no_code", "bad_tests", "deadline", "sandbox_error"]
RESULT_TAG = "__FP8RL_CASE__"

_FENCE_RE = re.compile(r"```(?:python|py|Python3|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
    """The last fenced code block of ``response`` (```python ... ```); ``None`` when there is none."""
    blocks = _FENCE_RE.findall(response)
    if not blocks:
        return None
    code = blocks[-1].strip("\n")
    return code if code.strip() else None


# ----------------------------------------------------------------- tests
@dataclass(frozen=True)
class StdioCase:
    input: str
    output: str


@dataclass(frozen=True)
class CodeTests:
    """Parsed tests of one problem. ``stdio``: ``cases``; ``functional``:
    ``statements`` (source of each statement of ``check``'s body, asserts are
    the cases), ``candidate`` (the expression passed to ``check``) and
    ``setup`` (top-level code of the test text other than ``check`` and its call)."""

    kind: Literal["stdio", "functional"]
    cases: tuple[StdioCase, ...] = ()
    statements: tuple[str, ...] = ()
    is_case: tuple[bool, ...] = ()
    candidate: str = ""
    setup: str = ""

    @property
    def n_cases(self) -> int:
        return len(self.cases) if self.kind == "stdio" else sum(self.is_case)


def _literal(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return ast.literal_eval(raw)
    return raw


def parse_tests(raw: Any) -> CodeTests:
    """Tests in the shipped / rLLM / TACO / APPS formats; ``ValueError`` saying why when unusable.

    Accepted: a list of ``{"input", "output"}``; ``{"inputs": [...], "outputs": [...]}`` (APPS, TACO;
    with ``fn_name`` it is a call-style problem, not supported here); ``{"functional": "def check..."}``;
    any of them JSON- or Python-literal-encoded in a string.
    """
    try:
        t = _literal(raw)
    except (ValueError, SyntaxError) as exc:
        raise ValueError(f"tests are not JSON or a Python literal: {exc}") from None
    if isinstance(t, dict) and "functional" in t:
        return _parse_functional(str(t["functional"]))
    if isinstance(t, dict) and "inputs" in t and "outputs" in t:
        if t.get("fn_name"):
            raise ValueError(f"call-style tests (fn_name={t['fn_name']!r}) are not supported")
        ins, outs = t["inputs"], t["outputs"]
        if len(ins) != len(outs):
            raise ValueError(f"{len(ins)} inputs but {len(outs)} outputs")
        t = [{"input": i, "output": o} for i, o in zip(ins, outs)]
    if isinstance(t, list):
        cases = []
        for i, c in enumerate(t):
            if not isinstance(c, dict) or "input" not in c or "output" not in c:
                raise ValueError(f"case {i} has no input/output")
            inp, out = c["input"], c["output"]
            if isinstance(inp, list):
                inp = "\n".join(map(str, inp))
            if isinstance(out, list):
                out = "\n".join(map(str, out))
            cases.append(StdioCase(str(inp), str(out)))
        if not cases:
            raise ValueError("no test cases")
        return CodeTests("stdio", cases=tuple(cases))
    raise ValueError(f"unknown test format ({type(t).__name__})")


def _parse_functional(text: str) -> CodeTests:
    try:
        mod = ast.parse(text)
    except SyntaxError as exc:
        raise ValueError(f"functional tests do not parse: {exc}") from None
    check = next((s for s in mod.body if isinstance(s, ast.FunctionDef) and s.name == "check"), None)
    if check is None or not check.args.args:
        raise ValueError("functional tests have no check(candidate) function")
    arg = check.args.args[0].arg
    call = None
    setup = []
    for s in mod.body:
        if s is check:
            continue
        if (isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Name)
                and s.value.func.id == "check" and s.value.args):
            call = s.value
        else:
            setup.append(ast.unparse(s))
    if call is None:
        raise ValueError("functional tests never call check(...)")
    stmts = tuple(ast.unparse(s) for s in check.body)
    is_case = tuple(isinstance(s, ast.Assert) for s in check.body)
    if not any(is_case):
        raise ValueError("check() has no assert")
    # the candidate is bound to check's parameter name
    return CodeTests("functional", statements=stmts, is_case=is_case,
                     candidate=f"{arg} = {ast.unparse(call.args[0])}", setup="\n".join(setup))


# ----------------------------------------------------------------- comparison
def _num(tok: str) -> float | None:
    try:
        v = float(tok)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def outputs_match(got: str, expected: str) -> bool:
    """Token-wise equality (any whitespace separates tokens); numeric tokens within 1e-6 abs or rel."""
    g, e = got.split(), expected.split()
    if g == e:
        return True
    if len(g) != len(e):
        return False
    for a, b in zip(g, e):
        if a == b:
            continue
        x, y = _num(a), _num(b)
        if x is None or y is None or not math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6):
            return False
    return True


# ----------------------------------------------------------------- LeetCode harness
LEETCODE_PRELUDE = '''
from typing import *
from collections import *
from itertools import *
from functools import *
from heapq import *
from bisect import *
from math import *
import math, heapq, bisect, itertools, functools, collections, string, re, random, operator
inf = float("inf")

class ListNode:
    def __init__(self, val=0, next=None):
        self.val = val
        self.next = next

class TreeNode:
    def __init__(self, val=0, left=None, right=None):
        self.val = val
        self.left = left
        self.right = right

def list_node(values):
    head = cur = ListNode()
    for v in values:
        cur.next = ListNode(v)
        cur = cur.next
    return head.next

def is_same_list(a, b):
    while a and b:
        if a.val != b.val:
            return False
        a, b = a.next, b.next
    return a is None and b is None

def tree_node(values):
    if not values:
        return None
    root = TreeNode(values[0])
    q, i = deque([root]), 1
    while q and i < len(values):
        node = q.popleft()
        if i < len(values) and values[i] is not None:
            node.left = TreeNode(values[i]); q.append(node.left)
        i += 1
        if i < len(values) and values[i] is not None:
            node.right = TreeNode(values[i]); q.append(node.right)
        i += 1
    return root

def is_same_tree(a, b):
    if a is None or b is None:
        return a is b
    return a.val == b.val and is_same_tree(a.left, b.left) and is_same_tree(a.right, b.right)
'''

_HARNESS_HEAD = '''import os as __os, sys as __sys
__res = __os.fdopen(__os.dup(1), "w", buffering=1)
__null = __os.open("/dev/null", __os.O_WRONLY)
__os.dup2(__null, 1)
__sys.stdout = open(1, "w", closefd=False)
'''

_HARNESS_TAIL = '''
import signal as __sig, json as __json
class __CaseTimeout(BaseException):
    pass
def __alarm(*_):
    raise __CaseTimeout()
__sig.signal(__sig.SIGALRM, __alarm)
__ns = dict(globals())
__spec = __json.loads(__SPEC)
def __run(src):
    exec(compile(src, "<test>", "exec"), __ns)
try:
    __sig.setitimer(__sig.ITIMER_REAL, __spec["per_test_s"])
    exec(compile(__spec["setup"] + "\\n" + __spec["candidate"], "<setup>", "exec"), __ns)
    __sig.setitimer(__sig.ITIMER_REAL, 0)
    __ok_setup = True
except BaseException as __e:
    __sig.setitimer(__sig.ITIMER_REAL, 0)
    __ok_setup = False
__k = 0
for __src, __case in zip(__spec["statements"], __spec["is_case"]):
    __ok = __ok_setup
    if __ok:
        try:
            __sig.setitimer(__sig.ITIMER_REAL, __spec["per_test_s"])
            __run(__src)
        except BaseException:
            __ok = False
        finally:
            __sig.setitimer(__sig.ITIMER_REAL, 0)
    if __case:
        __res.write("%s %d %d\\n" % (__spec["tag"], __k, 1 if __ok else 0))
        __k += 1
    elif not __ok:
        __ok_setup = False
__res.flush()
'''


def leetcode_program(code: str, tests: CodeTests, per_test_s: float) -> str:
    """One program: harness head, prelude, the solution, the harness that runs the asserts."""
    spec = json.dumps({"statements": list(tests.statements), "is_case": list(tests.is_case), "candidate": tests.candidate,
                       "setup": tests.setup, "per_test_s": per_test_s, "tag": RESULT_TAG})
    return (_HARNESS_HEAD + LEETCODE_PRELUDE + "\n" + code + "\n\n__SPEC = " + repr(spec) + "\n" + _HARNESS_TAIL)


# ----------------------------------------------------------------- grading
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


def grade_program(sandbox: Sandbox, code: str | None, tests: CodeTests, *, per_test_s: float, per_sample_s: float,
                  item_id: str = "", deadline: float | None = None) -> CodeGrade:
    """Run ``code`` against ``tests``; see the module docstring for the limits."""
    t0 = time.monotonic()
    end = t0 + per_sample_s if deadline is None else min(t0 + per_sample_s, deadline)
    total = tests.n_cases
    if code is None:
        return CodeGrade(item_id, 0, total, "no_code", 0.0, "no code block")
    if tests.kind == "functional":
        prog = leetcode_program(code, tests, per_test_s)
        wall = min(end - time.monotonic(), per_test_s * (len(tests.statements) + 1) + 2.0)
        res = sandbox.run(prog, b"", wall_s=max(0.1, wall), cpu_s=max(1, math.ceil(wall)))
        if res.status == "sandbox_error":
            return CodeGrade(item_id, 0, total, "sandbox_error", time.monotonic() - t0, res.stderr[-300:])
        ok = set()
        for line in res.stdout.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == RESULT_TAG and parts[2] == "1":
                ok.add(int(parts[1]))
        passed = len({k for k in ok if 0 <= k < total})
        detail = res.status if res.status != "ok" else ""
        if res.stderr and passed < total:
            detail = (detail + " " + res.stderr.strip().splitlines()[-1][:200]).strip() if res.stderr.strip() else detail
        return CodeGrade(item_id, passed, total, "ok", time.monotonic() - t0, detail)
    passed = 0
    detail = ""
    for i, case in enumerate(tests.cases):
        left = end - time.monotonic()
        if left <= 0:
            detail = detail or f"per-sample limit reached after {i} of {total} cases"
            break
        res = sandbox.run(code, case.input, wall_s=min(per_test_s, left))
        if res.status == "sandbox_error":
            return CodeGrade(item_id, passed, total, "sandbox_error", time.monotonic() - t0, res.stderr[-300:])
        if res.status == "ok" and outputs_match(res.stdout, case.output):
            passed += 1
        elif not detail:
            tail = res.stderr.strip().splitlines()[-1][:200] if res.stderr.strip() else ""
            detail = " ".join(x for x in (f"case {i}:", res.status, res.detail, tail) if x)
    return CodeGrade(item_id, passed, total, "ok", time.monotonic() - t0, detail)


@dataclass(frozen=True)
class CodeGradingConfig:
    """Grading limits (mirrors ``fp8rl_core.config.CodeConfig``; defaults: our choice)."""

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
    lim = SandboxLimits(wall_s=max(cfg.per_test_s, 0.1) + 1.0, cpu_s=max(1, math.ceil(cfg.per_test_s)),
                        memory_mb=cfg.memory_mb, output_bytes=cfg.output_bytes, nproc=cfg.nproc)
    key = (lim, cfg.allow_unisolated)
    if key not in _SANDBOXES:
        _SANDBOXES[key] = Sandbox(lim, allow_unisolated=cfg.allow_unisolated)
    return _SANDBOXES[key]


def grade_code_batch(ids: Sequence[str], codes: Sequence[str | None], tests: Sequence[CodeTests],
                     cfg: CodeGradingConfig | None = None) -> list[CodeGrade]:
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
        return grade_program(sandbox, codes[i], tests[i], per_test_s=cfg.per_test_s, per_sample_s=cfg.per_sample_s,
                             item_id=ids[i], deadline=deadline)

    if len(ids) <= 1 or cfg.max_sandboxes <= 1:
        return [one(i) for i in range(len(ids))]
    with ThreadPoolExecutor(max_workers=cfg.max_sandboxes, thread_name_prefix="fp8rl-sandbox") as pool:
        return list(pool.map(one, range(len(ids))))
