"""The tiny code task: write a one-line Python expression mapping inputs to outputs.

A problem is a hidden function ``f(x) = x + k`` or ``f(x) = x * k`` (k in 2..9).
The prompt shows it on x = 0 and x = 1; the response is a Python expression in
``x``; the reward comes from *running* it (``stages.grade.code``, in the
sandbox) on hidden inputs::

    problem   f(x) = x * 7
    prompt    C:f(0)=0,f(1)=7;f=?A:
    response  x*7<eos>

Reading the examples: ``f(0) = 0`` means a product (its factor is ``f(1)``),
otherwise a sum (its addend is ``f(0)``). The noisy teacher of the bootstrap
writes the wrong family with probability ``slip`` (the other operator with the
same constant: ``x+7`` for ``x * 7``), so the cloned
policy is right about ``1 - slip`` of the time and RL has one behaviour to fix.

The grader's program (:func:`program_for`) reads one integer per line and
prints the expression's value for each; the tests (:func:`tests_for`) are one
stdin/stdout case over :data:`HIDDEN_INPUTS`, so a response is one sandbox run.
A response that is not a single line is not code (``None``), never spliced.

Pure: no files, no processes; :func:`safe_eval` evaluates an expression of
this grammar without ``eval`` (for the bootstrap's quick accuracy measurement,
which must not run model output outside the sandbox).
"""

from __future__ import annotations

import ast
import json
import random
from dataclasses import dataclass

OPS = ("+", "*")
CONSTANTS = tuple(range(2, 10))
HIDDEN_INPUTS = (2, 3, 5, 11, 40)
SPLITS = ("train", "test")


@dataclass(frozen=True)
class CodeProblem:
    id: str
    prompt: str
    solution: str  # the reference expression
    tests: str  # JSON stdin/stdout tests of stages.grade.code_tests.parse_tests


def reference(op: str, k: int) -> str:
    return f"x{op}{k}"


def apply(op: str, k: int, x: int) -> int:
    return x + k if op == "+" else x * k


def format_prompt(op: str, k: int) -> str:
    return f"C:f(0)={apply(op, k, 0)},f(1)={apply(op, k, 1)};f=?A:"


def tests_for(op: str, k: int) -> str:
    case = {
        "input": "\n".join(map(str, HIDDEN_INPUTS)),
        "output": "\n".join(str(apply(op, k, x)) for x in HIDDEN_INPUTS),
    }
    return json.dumps([case])


def make_problem(index: int, split: str, seed: int) -> CodeProblem:
    """Problem ``index`` of ``split``: (op, k) drawn from a stream seeded by all three
    arguments. The function space is small (16), so train and test share functions;
    the test split is a fixed seeded sample (evaluation measures the policy, not
    generalisation to unseen functions)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {SPLITS}")
    rng = random.Random(f"fp8rl-code-tiny:{seed}:{split}:{index}")
    op, k = rng.choice(OPS), rng.choice(CONSTANTS)
    return CodeProblem(
        id=f"code-s{seed}-{split}-{index}",
        prompt=format_prompt(op, k),
        solution=reference(op, k),
        tests=tests_for(op, k),
    )


def demonstration(problem: CodeProblem, slip: float, rng: random.Random) -> str:
    """The noisy teacher: the reference, or with probability ``slip`` the other operator."""
    if not 0.0 <= slip < 1.0:
        raise ValueError(f"slip must be in [0, 1), got {slip}")
    if rng.random() < slip:
        op = "*" if "+" in problem.solution else "+"
        return problem.solution.replace("+", op) if "+" in problem.solution else problem.solution.replace("*", op)
    return problem.solution


def extract_expression(response: str) -> str | None:
    """The response as an expression: stripped, one line, parseable; else ``None``."""
    text = response.strip()
    if not text or "\n" in text or "\r" in text:
        return None
    try:
        ast.parse(text, mode="eval")
    except SyntaxError:
        return None
    return text


def program_for(expression: str) -> str:
    """The program the sandbox runs for a response."""
    return f"import sys\nfor _line in sys.stdin.read().split():\n    x = int(_line)\n    print({expression})\n"


_ALLOWED = (
    ast.Expression,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.FloorDiv,
    ast.Mod,
    ast.Constant,
    ast.Name,
    ast.Load,
    ast.UnaryOp,
    ast.USub,
)


def safe_eval(expression: str, x: int) -> int | None:
    """Value of ``expression`` at ``x`` if it uses only ``x``, integer constants and + - * // %; else None."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if (
            not isinstance(node, _ALLOWED)
            or (isinstance(node, ast.Name) and node.id != "x")
            or (isinstance(node, ast.Constant) and (not isinstance(node.value, int) or abs(node.value) > 10**6))
        ):
            return None

    def ev(n: ast.AST) -> int:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.Name):
            return x
        if isinstance(n, ast.UnaryOp):
            return -ev(n.operand)
        a, b = ev(n.left), ev(n.right)
        if isinstance(n.op, ast.Add):
            return a + b
        if isinstance(n.op, ast.Sub):
            return a - b
        if isinstance(n.op, ast.Mult):
            return a * b
        return a // b if isinstance(n.op, ast.FloorDiv) else a % b

    try:
        return ev(tree)
    except (ZeroDivisionError, RecursionError, OverflowError):
        return None


def safe_verify(response: str, problem: CodeProblem) -> bool:
    """In-process check without running code (bootstrap measurement only)."""
    expr = extract_expression(response)
    if expr is None:
        return False
    cases = json.loads(problem.tests)[0]
    want = cases["output"].split()
    got = [safe_eval(expr, int(v)) for v in cases["input"].split()]
    return all(g is not None for g in got) and [str(g) for g in got] == want
