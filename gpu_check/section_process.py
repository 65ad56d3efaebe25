"""One gpu-check section in a process of its own, stopped at its deadline from inside and, failing that, killed.

A section runs as ``python gpu_check/main.py --section NAME --seconds S``: the child arms an alarm
at ``S`` seconds around the section's work (``main.alarm_at``), so the deadline is enforced inside
the work, not only between its items, and a section stopped there exits with what it printed. Its
process group is killed :data:`GRACE_S` seconds after the deadline if it is still running (a kernel,
a compilation or an engine start-up that does not return to Python for the alarm). A section's
CUDA context, its compiled kernels, a CUDA error that poisons the context and a half-built vLLM
engine all end with its process: the next section starts clean.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

GRACE_S = 5.0  # after a section's deadline, before its process group is killed
STOPPED_EXIT = 3  # the child's exit status when its own alarm stopped the section
MAIN = Path(__file__).resolve().parent / "main.py"


def section_argv(name: str, seconds: float, cpu: bool = False) -> list[str]:
    """The command that runs section ``name`` (its CPU rehearsal when ``cpu``) with ``seconds`` to go, in
    this interpreter."""
    return [sys.executable, str(MAIN), "--section", name, "--seconds", f"{seconds:.1f}", *(["--cpu"] if cpu else [])]


def run_in_process(
    name: str, deadline: float, emit: Callable[[str], None], argv: list[str] | None = None
) -> int | None:
    """Run section ``name`` (or ``argv``) in a new process group until ``deadline`` (``time.monotonic()``);
    its lines print as they come (inherited stdout). Returns its exit status, None when it was killed."""
    seconds = max(deadline - time.monotonic(), 0.0)
    proc = subprocess.Popen(argv or section_argv(name, seconds), start_new_session=True)
    try:
        rc = proc.wait(timeout=seconds + GRACE_S)
    except subprocess.TimeoutExpired:
        emit(f"    {name}: killed {GRACE_S:.0f} s after its deadline (its own alarm did not stop it)")
        return None
    finally:
        if proc.poll() is None:  # timed out, or the parent's own alarm rang while it waited
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if rc == STOPPED_EXIT:
        emit(f"    {name}: stopped at its deadline")
    elif rc != 0:
        emit(f"    {name}: its process exited with status {rc}")
    return rc
