"""The grader's side of a functional (LeetCode) test: the run it asks for, and the verdict on its records.

:func:`functional_run` builds what the sandbox runs: the harness
(:mod:`stages.grade.in_sandbox.leetcode_harness`) as the program, and beside
it the prelude (:mod:`stages.grade.in_sandbox.leetcode_prelude`), the solution
and a spec of the calls -- read from the modules' files, never an expected
value among them. The harness writes one record per case to the result
channel, ``<nonce> <case> ok <json>`` (the return value as tagged plain data)
or ``<nonce> <case> err <why>``; :func:`read_records` keeps the run's nonce's
records (a case claimed twice has none), :func:`decode_value` turns the tagged
data back into values, and :func:`functional_case_passes` compares them with
the expected literal here, in the grader's process. A record is only a claim
about a return value, checked like any other.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any, Callable

from stages.grade.code_tests import CodeTests, FunctionalCase
from stages.grade.in_sandbox import program_source

RESULT_TAG = "__FP8RL_CASE__"


@dataclass(frozen=True)
class FunctionalRun:
    """What the sandbox runs for one functional test: ``source`` (the harness) and ``files``
    beside it (``leetcode_prelude.py``, ``solution.py``, ``spec.json``)."""

    source: str
    files: dict[str, bytes]


def functional_run(code: str, tests: CodeTests, per_test_s: float, nonce: str = "") -> FunctionalRun:
    """The harness and its files for ``code`` against ``tests``: the calls of each case, never
    an expected value; records go to the result channel (fd 3) prefixed with ``nonce``."""
    spec = {
        "statements": list(tests.statements),
        "is_case": list(tests.is_case),
        "candidate": tests.candidate,
        "setup": tests.setup,
        "per_test_s": per_test_s,
        "nonce": nonce or RESULT_TAG,
    }
    return FunctionalRun(
        program_source("leetcode_harness").decode("utf-8"),
        {
            "leetcode_prelude.py": program_source("leetcode_prelude"),
            "solution.py": code.encode("utf-8"),
            "spec.json": json.dumps(spec).encode("utf-8"),
        },
    )


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
