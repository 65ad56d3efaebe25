"""Grading model-written code against test cases, in the sandbox, in parallel.

Two test styles, as the shipped data sets define them:

- ``stdio`` (Codeforces, TACO, APPS): a list of ``{"input", "output"}`` pairs;
  the program reads ``input`` on stdin -- one sandbox launch per response, a
  fresh process per case (:meth:`stages.grade.sandbox.Sandbox.run_cases`) -- and its
  stdout must equal ``output`` token by token (:func:`outputs_match`: line
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
  The program holds the solution and a harness that evaluates the *calls*,
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
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Literal, Sequence

from stages.grade.sandbox import Sandbox, SandboxLimits

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
class FunctionalCase:
    """One ``assert`` of a ``check()``: ``call`` runs in the program (it mentions the
    candidate); ``expected`` is the source of the value it must equal, evaluated only by
    the grader; ``compare``: ``"eq"`` (Python ``==`` on plain data), ``"list"``
    (``is_same_list(call, list_node(expected))``) or ``"tree"`` (``is_same_tree``, ``tree_node``)."""

    call: str
    expected: str
    compare: Literal["eq", "list", "tree"] = "eq"


@dataclass(frozen=True)
class CodeTests:
    """Parsed tests of one problem. ``stdio``: ``cases`` (``case_insensitive``: letters
    compare in any case, where the statement says so); ``functional``: ``statements``
    (source of each statement of ``check``'s body; a case's statement is its call only),
    ``is_case``, ``functional_cases`` (one per assert, in order), ``candidate`` (the
    expression passed to ``check``) and ``setup`` (top-level code of the test text other
    than ``check`` and its call)."""

    kind: Literal["stdio", "functional"]
    cases: tuple[StdioCase, ...] = ()
    statements: tuple[str, ...] = ()
    is_case: tuple[bool, ...] = ()
    candidate: str = ""
    setup: str = ""
    functional_cases: tuple[FunctionalCase, ...] = ()
    case_insensitive: bool = False

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
        if (
            isinstance(s, ast.Expr)
            and isinstance(s.value, ast.Call)
            and isinstance(s.value.func, ast.Name)
            and s.value.func.id == "check"
            and s.value.args
        ):
            call = s.value
        else:
            setup.append(ast.unparse(s))
    if call is None:
        raise ValueError("functional tests never call check(...)")
    stmts, is_case, fcases = [], [], []
    for s in check.body:
        if isinstance(s, ast.Assert):
            fc = _split_assert(s.test)
            fcases.append(fc)
            stmts.append(fc.call)
        else:
            stmts.append(ast.unparse(s))
        is_case.append(isinstance(s, ast.Assert))
    if not fcases:
        raise ValueError("check() has no assert")
    # the candidate is bound to check's parameter name
    return CodeTests(
        "functional",
        statements=tuple(stmts),
        is_case=tuple(is_case),
        functional_cases=tuple(fcases),
        candidate=f"{arg} = {ast.unparse(call.args[0])}",
        setup="\n".join(setup),
    )


def _split_assert(test: ast.expr) -> FunctionalCase:
    """``call == literal``, ``is_same_list(call, list_node(literal))`` or ``is_same_tree(call,
    tree_node(literal))``; anything else would need its expected value inside the program."""

    def literal(node: ast.expr) -> str:
        src = ast.unparse(node)
        try:
            ast.literal_eval(src)
        except (ValueError, SyntaxError, TypeError):
            raise ValueError(f"assert's expected value is not a literal: {src[:80]}") from None
        return src

    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        return FunctionalCase(ast.unparse(test.left), literal(test.comparators[0]))
    if (
        isinstance(test, ast.Call)
        and isinstance(test.func, ast.Name)
        and len(test.args) == 2
        and test.func.id in ("is_same_list", "is_same_tree")
    ):
        exp = test.args[1]
        build = "list_node" if test.func.id == "is_same_list" else "tree_node"
        if isinstance(exp, ast.Call) and isinstance(exp.func, ast.Name) and exp.func.id == build and len(exp.args) == 1:
            return FunctionalCase(
                ast.unparse(test.args[0]), literal(exp.args[0]), "list" if build == "list_node" else "tree"
            )
    raise ValueError(f"assert of an unsupported shape: {ast.unparse(test)[:80]}")


# ----------------------------------------------------------------- comparison
_INT_RE = re.compile(r"[+-]?\d+")
_FRACTION_RE = re.compile(r"([+-]?\d+)/(\d+)")
_ANY_CASE_RE = re.compile(r"\bin any (?:case|register)\b|\bany (?:letter )?case\b|\bcase[- ]insensitive\b", re.I)
FLOAT_TOL = 1e-6


def statement_allows_any_case(statement: str) -> bool:
    """Whether a problem statement accepts letters in any case ("You may print each letter
    in any case", "case-insensitive", Codeforces' "in any register"); default: exact."""
    return bool(_ANY_CASE_RE.search(statement))


def _number(tok: str) -> Fraction | float | None:
    """A token's value as a number: integer, ``p/q`` or a finite float literal; ``None`` otherwise."""
    if _INT_RE.fullmatch(tok):
        return Fraction(int(tok))
    m = _FRACTION_RE.fullmatch(tok)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
    try:
        v = float(tok)
    except ValueError:
        return None
    return v if math.isfinite(v) and tok.lower().lstrip("+-") not in ("inf", "nan", "infinity") else None


def tokens_match(got: str, expected: str, case_insensitive: bool = False) -> bool:
    """One token by the expected token's kind: an integer matches only an integer of the same
    value; a float or ``p/q`` matches any number within 1e-6 absolute or relative (computed
    exactly for two fractions); any other token matches exactly (or ignoring case, when allowed)."""
    if got == expected:
        return True
    if _INT_RE.fullmatch(expected):
        return bool(_INT_RE.fullmatch(got)) and int(got) == int(expected)
    e = _number(expected)
    if e is not None:
        g = _number(got)
        if g is None:
            return False
        if isinstance(g, Fraction) and isinstance(e, Fraction):
            diff = abs(g - e)
            return diff <= Fraction(FLOAT_TOL) or diff <= Fraction(FLOAT_TOL) * abs(e)
        return math.isclose(float(g), float(e), rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL)
    return case_insensitive and got.casefold() == expected.casefold()


def outputs_match(got: str, expected: str, case_insensitive: bool = False) -> bool:
    """Token-wise equality (any whitespace separates tokens) under :func:`tokens_match`."""
    g, e = got.split(), expected.split()
    if g == e:
        return True
    return len(g) == len(e) and all(tokens_match(a, b, case_insensitive) for a, b in zip(g, e))


# ----------------------------------------------------------------- LeetCode harness
LEETCODE_PRELUDE = """
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
"""

_HARNESS_HEAD = """import os as __os, sys as __sys
__res = __os.fdopen(3, "w", buffering=1)
__null = __os.open("/dev/null", __os.O_WRONLY)
__os.dup2(__null, 1)
__sys.stdout = open(1, "w", closefd=False)
__sys.set_int_max_str_digits(0)
"""

_HARNESS_TAIL = """
import signal as __sig, json as __json
class __CaseTimeout(BaseException):
    pass
def __alarm(*_):
    raise __CaseTimeout()
__sig.signal(__sig.SIGALRM, __alarm)
def __enc(v, depth=0):
    # plain data only, read through the base type's own methods (a subclass's __eq__, __iter__
    # or __str__ never runs); the grader decodes it and decides equality in its own process
    if depth > 100:
        raise ValueError("nested too deep")
    if v is None or v is True or v is False:
        return ["v", v]
    if isinstance(v, str):
        return ["v", str.__str__(v)]
    if isinstance(v, int):
        return ["i", hex(int.__index__(v))]
    if isinstance(v, float):
        return ["f", float.__repr__(v)]
    for base, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
        if isinstance(v, base):
            return [tag, [__enc(x, depth + 1) for x in base.__iter__(v)]]
    if isinstance(v, dict):
        return ["d", [[__enc(k, depth + 1), __enc(x, depth + 1)] for k, x in dict.items(v)]]
    if hasattr(v, "val") and hasattr(v, "next"):
        out = []
        while v is not None and len(out) <= 100000:
            out.append(__enc(v.val, depth + 1)); v = v.next
        return ["L", out]
    if hasattr(v, "val") and hasattr(v, "left") and hasattr(v, "right"):
        out, q = [], [v]
        while q and len(out) <= 100000:
            n = q.pop(0)
            out.append(None if n is None else __enc(n.val, depth + 1))
            if n is not None:
                q += [n.left, n.right]
        while out and out[-1] is None:
            out.pop()
        return ["T", out]
    raise TypeError("a %s is not plain data" % t.__name__)
__ns = dict(globals())
__spec = __json.loads(__SPEC)
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
    __out = None
    if __ok_setup:
        try:
            __sig.setitimer(__sig.ITIMER_REAL, __spec["per_test_s"])
            if __case:
                __out = "ok " + __json.dumps(__enc(eval(compile(__src, "<test>", "eval"), __ns)))
            else:
                exec(compile(__src, "<test>", "exec"), __ns)
        except BaseException as __e:
            __out = "err " + type(__e).__name__
            if not __case:
                __ok_setup = False
        finally:
            __sig.setitimer(__sig.ITIMER_REAL, 0)
    if __case:
        __res.write("%s %d %s\\n" % (__spec["nonce"], __k, __out or "err setup"))
        __k += 1
__res.flush()
"""


def leetcode_program(code: str, tests: CodeTests, per_test_s: float, nonce: str = "") -> str:
    """One program: harness head, prelude, the solution, the harness that runs each case's call.
    It holds the calls and never an expected value; each call's return value goes to the result
    channel (fd 3) as tagged plain data, one line ``<nonce> <case> ok <json>`` per case."""
    spec = json.dumps(
        {
            "statements": list(tests.statements),
            "is_case": list(tests.is_case),
            "candidate": tests.candidate,
            "setup": tests.setup,
            "per_test_s": per_test_s,
            "nonce": nonce or RESULT_TAG,
        }
    )
    return _HARNESS_HEAD + LEETCODE_PRELUDE + "\n" + code + "\n\n__SPEC = " + repr(spec) + "\n" + _HARNESS_TAIL


# ----------------------------------------------------------------- the grader's side of a functional case
@dataclass(frozen=True)
class _Linked:
    """A decoded linked list or tree (level order): equal only to another of the same kind."""

    kind: str
    values: tuple


def decode_value(x: Any) -> Any:
    """Plain data back from the program's tagged JSON; ``ValueError`` on anything else."""
    if not isinstance(x, list) or len(x) != 2 or x[0] not in _DECODERS:
        raise ValueError("not a tagged value")
    return _DECODERS[x[0]](x[1])


def _dec_scalar(v: Any) -> Any:
    if v is None or isinstance(v, (bool, str)):
        return v
    raise ValueError("bad scalar")


def _dec_int(v: Any) -> int:
    if not isinstance(v, str):
        raise ValueError("bad int")
    return int(v, 16)


def _dec_float(v: Any) -> float:
    if not isinstance(v, str):
        raise ValueError("bad float")
    return float(v)


def _dec_items(v: Any) -> list:
    if not isinstance(v, list):
        raise ValueError("bad sequence")
    return [decode_value(x) for x in v]


def _dec_dict(v: Any) -> dict:
    if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 for p in v):
        raise ValueError("bad dict")
    return {decode_value(k): decode_value(x) for k, x in v}


def _dec_linked(kind: str) -> Callable[[Any], "_Linked"]:
    def dec(v: Any) -> _Linked:
        if not isinstance(v, list):
            raise ValueError("bad " + kind)
        return _Linked(kind, tuple(None if x is None else decode_value(x) for x in v))

    return dec


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "v": _dec_scalar,
    "i": _dec_int,
    "f": _dec_float,
    "l": _dec_items,
    "t": lambda v: tuple(_dec_items(v)),
    "S": lambda v: set(_dec_items(v)),
    "F": lambda v: frozenset(_dec_items(v)),
    "d": _dec_dict,
    "L": _dec_linked("list"),
    "T": _dec_linked("tree"),
}


def _tree_level_order(values: list) -> tuple:
    """The canonical level order of ``tree_node(values)`` (the shape the harness encodes)."""
    if not values or values[0] is None:
        return ()
    root: list = [values[0], None, None]
    q, i = [root], 1
    while q and i < len(values):
        node = q.pop(0)
        for side in (1, 2):
            if i < len(values) and values[i] is not None:
                node[side] = [values[i], None, None]
                q.append(node[side])
            i += 1
    out, q = [], [root]
    while q:
        n = q.pop(0)
        out.append(None if n is None else n[0])
        if n is not None:
            q += [n[1], n[2]]
    while out and out[-1] is None:
        out.pop()
    return tuple(out)


def functional_case_passes(case: FunctionalCase, record: str | None) -> bool:
    """Whether a case's record (``ok <json>``) carries a value equal to the expected one."""
    if record is None or not record.startswith("ok "):
        return False
    try:
        got = decode_value(json.loads(record[3:]))
        expected = ast.literal_eval(case.expected)
        if case.compare == "eq":
            return type(got) is not _Linked and bool(got == expected)
        want = tuple(expected) if case.compare == "list" else _tree_level_order(list(expected))
        return (got is None and not want) or got == _Linked(case.compare, want)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError, OverflowError):
        return False


def read_records(channel: bytes, nonce: str, total: int) -> dict[int, str | None]:
    """Case records of the run's nonce; a case claimed twice has no valid record (``None``)."""
    out: dict[int, str | None] = {}
    for line in channel.decode("utf-8", "replace").splitlines():
        head, _, rest = line.partition(" ")
        num, _, record = rest.partition(" ")
        if head != nonce or not num.isdigit() or not 0 <= int(num) < total:
            continue
        k = int(num)
        out[k] = None if k in out else record
    return out


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
    prog = leetcode_program(code, tests, per_test_s, nonce)
    wall = min(end - time.monotonic(), per_test_s * (len(tests.statements) + 1) + 2.0)
    res = sandbox.run(prog, b"", wall_s=max(0.1, wall), cpu_s=max(1, math.ceil(wall)), channel=True)
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
