"""Stage time limits every rank enforces alike, and the way a rank ends when a stage fails.

**A limit is a deadline on every rank** (:func:`stage_deadline`). Each rank arms
a timer when it enters a stage (``timeouts.<stage>_s``, the same on every rank)
and disarms it when the stage returns. A stage still running when its timer
fires ends the process at once: one line on stderr, exit status
:data:`STAGE_TIMEOUT_EXIT`. Not an exception: a stage past its limit is often
inside a collective or inside vLLM's engine loop, where the other ranks wait
for this one (vLLM's data-parallel replicas all-reduce at every engine step),
and an exception on one rank would leave them waiting, while the requests it
abandoned stay queued in the engine. A process that ends is what every rank
can see: ``torchrun`` stops the others, gloo's peers fail their next
collective, and the others' own timers, armed at the same stage, fire too.
The ledger keeps the stage unfinished, so ``fp8rl resume`` redoes it.

**A failure ends a rank in one line** (:func:`end_rank`). Under several ranks a
stage that fails on one rank fails on all (``stages.runtime.rank_outcome``);
each rank then writes its traceback to ``rank<r>-failure.txt`` in the run
directory, says one line on stderr naming the file, and exits, rather than
unwinding through code that would call a collective its peers no longer
reach.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

STAGE_TIMEOUT_EXIT = 124  # as coreutils' timeout
RANK_FAILURE_EXIT = 1


def _say_and_exit(line: str, status: int) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    finally:
        os._exit(status)


def timeout_line(stage: str, step: int, seconds: float, rank: int) -> str:
    """What a rank says when ``stage`` of ``step`` outlives its limit."""
    return (
        f"error: rank {rank}: {stage} of step {step} ran past its limit of {seconds:g} s "
        f"(timeouts.{stage}_s), so every rank stops; `fp8rl resume RUN_DIR` redoes the stage"
    )


@contextmanager
def stage_deadline(
    stage: str,
    step: int,
    seconds: float,
    *,
    rank: int,
    expire: Callable[[str, int], None] = _say_and_exit,
) -> Iterator[None]:
    """Within the block, the stage may run ``seconds``; then ``expire(line, status)`` (default: say the
    line and end the process with :data:`STAGE_TIMEOUT_EXIT`)."""
    line = timeout_line(stage, step, seconds, rank)
    timer = threading.Timer(seconds, expire, args=(line, STAGE_TIMEOUT_EXIT))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def end_rank(err: BaseException, *, rank: int, run_dir: str | Path, where: str) -> None:
    """End this rank after ``err``: the traceback to ``rank<r>-failure.txt`` in ``run_dir``, one line on
    stderr, exit status :data:`RANK_FAILURE_EXIT`. Never returns."""
    first = f"{type(err).__name__}: {err}".splitlines()[0]
    path = Path(run_dir) / f"rank{rank}-failure.txt"
    try:
        path.write_text("".join(traceback.format_exception(err)))
        told = f" (traceback in {path})"
    except OSError:
        told = ""
    _say_and_exit(f"error: rank {rank}: {where} failed: {first}; every rank stops{told}", RANK_FAILURE_EXIT)
