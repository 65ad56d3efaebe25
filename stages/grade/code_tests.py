"""The tests of a code problem, parsed: stdin/stdout cases or a LeetCode ``check()`` split into calls.

Formats accepted by :func:`parse_tests`: a list of ``{"input", "output"}``
(the shipped data, rLLM); ``{"inputs": [...], "outputs": [...]}`` (APPS,
TACO); ``{"functional": "def check(candidate): ..."}`` (LeetCode); any of them
JSON- or Python-literal-encoded in a string.

A functional test's ``check`` body is split at parse time: each ``assert``
becomes a :class:`FunctionalCase` -- the call, which runs in the program, and
the expected literal, which only the grader ever evaluates
(:mod:`stages.grade.functional`). Shapes other than ``call == literal``,
``is_same_list(call, list_node(literal))`` and ``is_same_tree(call,
tree_node(literal))`` are refused, since they would need the expected value
inside the program.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any, Literal


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
