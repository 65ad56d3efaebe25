"""The functional (LeetCode) test harness: the program the sandbox runs for a ``check()`` test.

It runs as ``/tmp/prog.py`` with three files beside it in its cwd, placed there
by the grader (:func:`stages.grade.functional.functional_run`):

- ``leetcode_prelude.py`` -- :mod:`stages.grade.in_sandbox.leetcode_prelude`,
  run first in the solution's globals;
- ``solution.py`` -- the model's code, run next in the same globals (its own
  prints go to /dev/null: stdout is closed onto it before anything runs);
- ``spec.json`` -- ``statements`` (each statement of ``check``'s body; a
  case's statement is its call only), ``is_case``, ``candidate`` and
  ``setup`` (code binding the candidate), ``per_test_s`` and ``nonce``.

It holds the calls and never an expected value. Setup and each statement run
in a copy of the solution's globals, each under its own timer (``per_test_s``,
``SIGALRM``); each case's return value goes to the result channel (fd 3) as
one line ``<nonce> <case> ok <json>`` -- tagged plain data, :func:`encode` --
or ``<nonce> <case> err <ExceptionName>``. A failing non-case statement fails
the cases after it (``err setup``). The grader decodes the values and decides
equality in its own process; a record here is only a claim.
"""

import json
import os
import signal
import sys

PLAIN = ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F"))
MAX_NODES = 100000


class CaseTimeout(BaseException):
    """A case past ``per_test_s`` (a ``BaseException``: a solution's ``except Exception`` cannot swallow it)."""


def on_alarm(*_):
    raise CaseTimeout()


def encode(v, depth=0):
    """``v`` as tagged plain data: ``["v", None|bool|str]``, ``["i", hex]``, ``["f", repr]``,
    ``["l"|"t"|"S"|"F", items]``, ``["d", [[k, v], ...]]``, a linked list ``["L", values]``
    or a tree ``["T", level-order values]``. Read through the base type's own methods, so a
    subclass's ``__eq__``, ``__iter__`` or ``__str__`` never runs; anything else raises."""
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
    for base, tag in PLAIN:
        if isinstance(v, base):
            return [tag, [encode(x, depth + 1) for x in base.__iter__(v)]]
    if isinstance(v, dict):
        return ["d", [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in dict.items(v)]]
    if hasattr(v, "val") and hasattr(v, "next"):
        out = []
        while v is not None and len(out) <= MAX_NODES:
            out.append(encode(v.val, depth + 1))
            v = v.next
        return ["L", out]
    if hasattr(v, "val") and hasattr(v, "left") and hasattr(v, "right"):
        return ["T", encode_tree(v, depth)]
    raise TypeError("a %s is not plain data" % type(v).__name__)


def encode_tree(root, depth):
    """Level order with ``None`` for a missing child, trailing ``None`` dropped."""
    out, q = [], [root]
    while q and len(out) <= MAX_NODES:
        n = q.pop(0)
        out.append(None if n is None else encode(n.val, depth + 1))
        if n is not None:
            q += [n.left, n.right]
    while out and out[-1] is None:
        out.pop()
    return out


def open_channel():
    """The result channel (fd 3, line-buffered); stdout onto /dev/null; no digit limit on ints."""
    res = os.fdopen(3, "w", buffering=1)
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 1)
    sys.stdout = open(1, "w", closefd=False)
    sys.set_int_max_str_digits(0)
    return res


def read_text(name):
    with open(name, encoding="utf-8") as f:
        return f.read()


def timed(seconds, fn, *args):
    """``fn(*args)`` with ``SIGALRM`` armed for ``seconds``; disarmed however it ends."""
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def run_statement(src, is_case, ns):
    """A case's call, evaluated and encoded (``"ok <json>"``), or a non-case statement, executed."""
    if is_case:
        return "ok " + json.dumps(encode(eval(compile(src, "<test>", "eval"), ns)))
    exec(compile(src, "<test>", "exec"), ns)
    return None


def run_cases(spec, ns, res):
    """Setup and candidate, then every statement; one record per case, in order."""
    per_test_s = spec["per_test_s"]
    try:
        timed(per_test_s, exec, compile(spec["setup"] + "\n" + spec["candidate"], "<setup>", "exec"), ns)
        ok_setup = True
    except BaseException:
        ok_setup = False
    k = 0
    for src, is_case in zip(spec["statements"], spec["is_case"]):
        out = None
        if ok_setup:
            try:
                out = timed(per_test_s, run_statement, src, is_case, ns)
            except BaseException as e:
                out = "err " + type(e).__name__
                ok_setup = ok_setup and is_case
        if is_case:
            res.write("%s %d %s\n" % (spec["nonce"], k, out or "err setup"))
            k += 1
    res.flush()


def main():
    res = open_channel()
    spec = json.loads(read_text("spec.json"))
    prelude, solution = read_text("leetcode_prelude.py"), read_text("solution.py")
    g = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(prelude, "leetcode_prelude.py", "exec"), g)
    exec(compile(solution, "solution.py", "exec"), g)
    signal.signal(signal.SIGALRM, on_alarm)
    run_cases(spec, dict(g), res)


if __name__ == "__main__":
    main()
