"""Programs that run inside the code sandbox, kept as real modules.

Each is a standalone script of the standard library only (the sandbox's
interpreter runs with ``-I -S``: no site, no project on ``sys.path``). The host
never mounts this folder into a sandbox: it reads a script's bytes
(:func:`program_source`) and writes a copy into the
run's own scratch folder, so a graded program sees that one file and nothing
of the tree it came from.

- :mod:`~stages.grade.in_sandbox.init` -- the namespace's init (pid 1): builds
  the minimal root, drops privileges, installs the seccomp filter, forks the
  program and reports its exit status.
- :mod:`~stages.grade.in_sandbox.unisolated` -- the launcher of the explicitly
  allowed unisolated fallback.
- :mod:`~stages.grade.in_sandbox.leetcode_harness` and
  :mod:`~stages.grade.in_sandbox.leetcode_prelude` -- the functional (LeetCode)
  test harness and the names a LeetCode solution expects to find.

Importing any of them runs nothing: each acts only as ``__main__``.
"""

from __future__ import annotations

import functools
from pathlib import Path

PROGRAMS = ("init", "unisolated", "leetcode_harness", "leetcode_prelude")


@functools.lru_cache(maxsize=None)
def program_source(name: str) -> bytes:
    """The bytes of the in-sandbox program ``name`` (one of :data:`PROGRAMS`), read once per process."""
    if name not in PROGRAMS:
        raise ValueError(f"no in-sandbox program {name!r}; there are {', '.join(PROGRAMS)}")
    return Path(__file__).with_name(name + ".py").read_bytes()
