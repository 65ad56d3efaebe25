"""The programs that run inside the sandbox are real modules, and running them shows nothing of the project.

The namespace's init, the unisolated launcher, the LeetCode harness and its
prelude compile, import without acting, and work on their own (the harness's
encoding round-trips through the grader's decoding). A program run the way
the grader runs the harness finds copies of its files in its own /tmp and
nothing of the tree they came from.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from stages.grade.code import grade_program
from stages.grade.code_tests import parse_tests
from stages.grade.functional import decode_value, functional_case_passes, functional_run, read_records
from stages.grade.in_sandbox import PROGRAMS, program_source
from stages.grade.in_sandbox import leetcode_harness as harness
from stages.grade.in_sandbox import leetcode_prelude as prelude
from stages.grade.sandbox import Sandbox, probe_isolation
from stages.grade.sandbox_limits import SandboxLimits

pytestmark = pytest.mark.timeout(60)
PROJECT = Path(__file__).resolve().parents[3]
LEVEL, REASON = probe_isolation()
needs_sandbox = pytest.mark.skipif(LEVEL != "namespaces+uid", reason=f"full sandbox isolation unavailable: {REASON}")
# a uid band of its own, apart from the graders' and the attack tests'
LIM = SandboxLimits(wall_s=5.0, cpu_s=5, memory_mb=512, nproc=16, uid_range=(1_990_000, 1_999_000))


@pytest.mark.parametrize("name", PROGRAMS)
def test_each_program_is_a_module_that_compiles_and_imports_without_acting(name):
    src = program_source(name)
    compile(src, f"{name}.py", "exec")
    mod = importlib.import_module(f"stages.grade.in_sandbox.{name}")
    assert Path(mod.__file__).read_bytes() == src
    if name != "leetcode_prelude":
        assert callable(mod.main)  # acts only as __main__


def test_unknown_program_is_refused_with_the_list():
    with pytest.raises(ValueError, match="leetcode_harness"):
        program_source("prog")


def test_prelude_builds_and_compares_lists_and_trees():
    assert prelude.is_same_list(prelude.list_node([1, 2, 3]), prelude.list_node([1, 2, 3]))
    assert not prelude.is_same_list(prelude.list_node([1, 2]), prelude.list_node([1, 2, 3]))
    t = prelude.tree_node([1, None, 2, 3])
    assert t.left is None and t.right.val == 2 and t.right.left.val == 3
    assert prelude.is_same_tree(t, prelude.tree_node([1, None, 2, 3]))
    assert not prelude.is_same_tree(t, prelude.tree_node([1, 2]))
    assert prelude.Counter.__module__ == "collections"  # collections' Counter, not typing's alias


@pytest.mark.parametrize(
    "value",
    [None, True, 3, -(10**40), 0.1, "x", [1, (2, 3)], {1, 2}, frozenset({4}), {"a": [1]}, (), []],
)
def test_harness_encoding_round_trips_through_the_grader(value):
    back = decode_value(harness.encode(value))
    assert back == value and type(back) is type(value)


def test_harness_encodes_lists_and_trees_by_value_and_refuses_other_objects():
    linked = decode_value(harness.encode(prelude.list_node([1, 2])))
    tree = decode_value(harness.encode(prelude.tree_node([1, None, 2])))
    assert (linked.kind, linked.values, tree.kind, tree.values) == ("list", (1, 2), "tree", (1, None, 2))

    class Yes:
        __eq__ = lambda s, o: True

    with pytest.raises(TypeError, match="a Yes is not plain data"):
        harness.encode(Yes())


def test_refuses_file_names_of_the_launch_itself():
    sb = Sandbox(LIM, allow_unisolated=True)
    for name in ("prog.py", "init.py", "../x", "put"):
        with pytest.raises(ValueError, match="sandbox file name"):
            sb.run("pass", files={name: b""})


def test_the_unisolated_fallback_gives_the_harness_its_files(monkeypatch):
    import stages.grade.sandbox as S

    monkeypatch.setattr(S, "probe_isolation", lambda python=None: ("none", "probe patched out"))
    sb = S.Sandbox(LIM, allow_unisolated=True)
    check = "def check(candidate):\n    assert candidate(a=1) == 2\n\ncheck(Solution().inc)"
    tests = parse_tests({"functional": check})
    good = "class Solution:\n    def inc(self, a):\n        return a + 1"
    assert grade_program(sb, good, tests, per_test_s=2, per_sample_s=4).correct
    assert grade_program(sb, good.replace("+ 1", "+ 2"), tests, per_test_s=2, per_sample_s=4).passed == 0


LOOK = f"""
import os
PROJECT = {str(PROJECT)!r}

def readable(p):
    try:
        with open(p, 'rb') as f:
            f.read(1)
        return True
    except OSError:
        return False

class Solution:
    def look(self):
        try:
            cmd = open('/proc/1/cmdline', 'rb').read().split(b'\\0')
        except OSError:
            cmd = []
        init = cmd[cmd.index(b'-S') + 1].decode() if b'-S' in cmd else ''
        with open('prog.py', 'rb') as f:
            harness = f.read()
        return [os.getcwd(), sorted(os.listdir('.')), init, readable(init), os.path.exists(PROJECT),
                readable(PROJECT + '/stages/grade/code.py'), harness.decode()]
"""


@needs_sandbox
def test_the_harness_runs_from_a_copy_that_shows_nothing_of_the_project():
    tests = parse_tests({"functional": "def check(candidate):\n    assert candidate() == 0\n\ncheck(Solution().look)"})
    run = functional_run(LOOK, tests, 2.0, "n0nce")
    res = Sandbox(LIM).run(run.source, channel=True, files=run.files)
    assert res.status == "ok", res
    record = read_records(res.channel, "n0nce", 1)[0]
    cwd, files, init, init_readable, project, code_py, harness_text = decode_value(eval_ok(record))
    assert cwd == "/tmp" and files == ["leetcode_prelude.py", "prog.py", "solution.py", "spec.json"]
    assert harness_text == program_source("leetcode_harness").decode()
    assert init.endswith("/init.py") and not init_readable  # the init's copy lies outside the program's root
    assert not project and not code_py
    assert not functional_case_passes(tests.functional_cases[0], record)


def eval_ok(record: str | None) -> list:
    assert record and record.startswith("ok "), record
    return json.loads(record[3:])
