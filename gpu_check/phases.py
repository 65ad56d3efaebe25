"""A section's phases and their times, so that a slow machine can be told from a wrong one.

Each section runs its work in named phases (``import``, ``engine start``, ``first JIT``, ``sync``,
``step`` ...): ``with phase("engine start"):`` prints ``    phase engine start: 41.2 s`` when it ends.
A section stopped at its deadline says which phase it was in and for how long (:func:`stopped_in`):
an engine start that was still loading at 90 s on a cold machine reads differently from a step that
never returned. Pure Python: the check runs without pydantic.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

_STACK: list[tuple[str, float]] = []  # the phases open now, outermost first: (name, start)
_STOPPED: dict[str, object] = {}  # where the last exception (the deadline's alarm, say) left a phase


def _print(line: str) -> None:
    print(line, flush=True)


@contextlib.contextmanager
def phase(name: str, emit: Callable[[str], None] | None = _print) -> Iterator[None]:
    """Time the block as phase ``name`` and print its time when it ends normally (``emit`` None: track it
    only, where the section prints its own line per item); an exception (the deadline, an error) leaves
    :func:`stopped_in` naming the innermost phase it interrupted."""
    start = time.monotonic()
    _STACK.append((name, start))
    try:
        yield
    except BaseException as err:
        if _STOPPED.get("error") is not err:  # the innermost phase sees it first: the outer ones keep its record
            _STOPPED.update(error=err, path=" > ".join(n for n, _ in _STACK), seconds=time.monotonic() - start)
        raise
    else:
        if emit is not None:
            emit(f"    phase {name}: {time.monotonic() - start:.1f} s")
    finally:
        _STACK.pop()


def stopped_in() -> tuple[str, float] | None:
    """The phase path (``outer > inner``) an exception last interrupted and the seconds spent in its innermost
    phase; None where no phase was interrupted."""
    return (str(_STOPPED["path"]), float(_STOPPED["seconds"])) if _STOPPED else None


def current() -> tuple[str, float] | None:
    """The phase path open now and the seconds in its innermost phase (None outside every phase)."""
    if not _STACK:
        return None
    return " > ".join(n for n, _ in _STACK), time.monotonic() - _STACK[-1][1]


def reset() -> None:
    _STACK.clear()
    _STOPPED.clear()
