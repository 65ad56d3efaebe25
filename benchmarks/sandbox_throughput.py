"""Graded programs per second in the sandbox, against bare ``python3 -c`` doing the same work.

The unit is one *graded program with all its cases*, of two kinds:

- stdio: ``print(sum(map(int, input().split())))`` against 3 stdin/stdout cases.
  Sandboxed = :func:`stages.grade.code.grade_program` (one sandbox launch,
  a fresh process per case: namespaces, minimal filesystem view, throw-away
  uid, seccomp, rlimits, init and reaping, token comparison by the problem's rules). Bare = for each
  case ``subprocess.run([python, "-I", "-S", "-c", program], input=case)`` and the
  same :func:`~stages.grade.stdio_match.outputs_match`.
- functional: a LeetCode-style ``Solution`` against a ``check()`` of 3 asserts.
  Sandboxed = ``grade_program`` (one sandbox run: harness, result channel,
  the grader's decoding and comparison). Bare = one ``python -I -S -c`` of the
  prelude, the solution and the test text with its asserts, passed when it exits 0.

Both sides use the same interpreter (the sandbox's), run ``--parallel`` programs
at a time (1 = sequential, 2 = pooled by default; both are measured), and are
interleaved in rounds so machine load hits both alike. Prints the rates and the
ratio sandboxed/bare for each mode (goal: >= 0.5).

    python benchmarks/sandbox_throughput.py [--n 40] [--rounds 2] [--pool 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.grade.code import CodeGradingConfig, get_sandbox, grade_program  # noqa: E402
from stages.grade.code_tests import parse_tests  # noqa: E402
from stages.grade.in_sandbox import program_source  # noqa: E402
from stages.grade.sandbox_launch import sandbox_python  # noqa: E402
from stages.grade.stdio_match import outputs_match  # noqa: E402

STDIO_CODE = "print(sum(map(int, input().split())))\n"
STDIO_TESTS = [
    {"input": "1 2\n", "output": "3"},
    {"input": "40 2\n", "output": "42"},
    {"input": "-5 5\n", "output": "0"},
]
FUNC_CODE = "class Solution:\n    def add(self, a, b):\n        return a + b\n"
FUNC_TEXT = (
    "def check(candidate):\n    assert candidate(a=1, b=2) == 3\n    assert candidate(a=40, b=2) == 42\n"
    "    assert candidate(a=-5, b=5) == 0\n\ncheck(Solution().add)\n"
)


def bare_stdio(py: str) -> bool:
    ok = True
    for case in STDIO_TESTS:
        r = subprocess.run(
            [py, "-I", "-S", "-c", STDIO_CODE], input=case["input"].encode(), capture_output=True, timeout=10
        )
        ok = ok and r.returncode == 0 and outputs_match(r.stdout.decode(), case["output"])
    return ok


def bare_functional(py: str) -> bool:
    r = subprocess.run(
        [py, "-I", "-S", "-c", program_source("leetcode_prelude").decode() + "\n" + FUNC_CODE + "\n" + FUNC_TEXT],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=10,
    )
    return r.returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40, help="graded programs per kind, side and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pool", type=int, default=2, help="programs at a time in the pooled mode")
    args = ap.parse_args()
    sb = get_sandbox(CodeGradingConfig())
    py = sandbox_python()
    stdio, func = parse_tests(STDIO_TESTS), parse_tests({"functional": FUNC_TEXT})

    def sandboxed(kind: str) -> bool:
        code, tests = (STDIO_CODE, stdio) if kind == "stdio" else (FUNC_CODE, func)
        return grade_program(sb, code, tests, per_test_s=4.0, per_sample_s=20.0).correct

    def bare(kind: str) -> bool:
        return bare_stdio(py) if kind == "stdio" else bare_functional(py)

    print(
        f"isolation: {sb.isolation} ({sb.isolation_reason}); interpreter {py}; cpus {os.cpu_count()}; "
        f"{args.n} programs per kind x {args.rounds} rounds per side; pooled = {args.pool} at a time"
    )
    for width in (1, args.pool):
        totals = {"bare": 0.0, "sandbox": 0.0}
        with ThreadPoolExecutor(width) as pool:
            for _ in range(args.rounds):
                for side, fn in (("bare", bare), ("sandbox", sandboxed)):
                    t0 = time.perf_counter()
                    ok = list(pool.map(fn, ["stdio", "functional"] * args.n))
                    totals[side] += time.perf_counter() - t0
                    assert all(ok), f"{side}: {ok.count(False)} programs graded wrong"
        n = 2 * args.n * args.rounds
        rb, rs = n / totals["bare"], n / totals["sandbox"]
        mode = "sequential" if width == 1 else f"pooled x{width}"
        print(
            f"{mode:12s} bare: {rb:6.1f} programs/s; sandboxed: {rs:6.1f} programs/s; "
            f"ratio sandboxed/bare = {rs / rb:.2f} (goal >= 0.5)"
        )


if __name__ == "__main__":
    main()
