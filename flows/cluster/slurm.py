"""Slurm's own commands, as the supervisor uses them: submit, ask, cancel.

Every call runs the scheduler's command-line tools (``sbatch``, ``squeue``, ``scontrol``,
``scancel``, ``sinfo``, ``sacct``); nothing talks to slurmctld directly. A job's end is
read from ``scontrol show job`` while the controller still holds the job (``MinJobAge``,
300 s by default), then from ``sacct`` where accounting is configured; a job neither
knows is taken as ended with an unknown state.

A failed call of a tool is :class:`SlurmError` with the tool's own first line: the
supervisor retries those (a busy controller answers "Socket timed out"), and the
command line shows the last one.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Job states in which the job no longer runs anything (Slurm's JOB_STATE_BASE names)
ENDED = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
    "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT",
}  # fmt: skip
WAITING = {"PENDING", "REQUEUED", "CONFIGURING", "RESV_DEL_HOLD", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED"}
UNKNOWN = "UNKNOWN"


class SlurmError(RuntimeError):
    """A Slurm tool failed; the message is its first line."""


@dataclass(frozen=True)
class JobState:
    state: str  # RUNNING, PENDING, COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, ... or UNKNOWN
    exit_code: str | None = None  # "code:signal" as Slurm writes it, once ended
    nodes: str | None = None  # the node list, once allocated
    reason: str | None = None

    @property
    def ended(self) -> bool:
        return self.state in ENDED or self.state == UNKNOWN

    @property
    def running(self) -> bool:
        return self.state in ("RUNNING", "COMPLETING")

    @property
    def succeeded(self) -> bool:
        return self.state == "COMPLETED" and (self.exit_code or "0:0") == "0:0"


def missing_tools(tools: tuple[str, ...]) -> list[str]:
    return [t for t in tools if shutil.which(t) is None]


def _run(*cmd: str, timeout: float = 60, env: dict | None = None) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{cmd[0]} did not answer in {timeout:g} s") from None
    except OSError as err:
        raise SlurmError(f"{cmd[0]}: {err.strerror}") from None
    if r.returncode != 0:
        first = next((line for line in (r.stderr or r.stdout).splitlines() if line.strip()), f"exit {r.returncode}")
        raise SlurmError(f"{cmd[0]}: {first.strip()}")
    return r.stdout


def submit(script: Path, env: dict | None = None) -> str:
    """Submit ``script`` (the job inherits ``env``, else this process's environment); its job id."""
    out = _run("sbatch", "--parsable", str(script), env=env)
    return out.strip().split(";")[0]


def partition_nodes(partition: str | None) -> tuple[str, int]:
    """(the partition's name, how many nodes it has); the default partition when None."""
    out = _run("sinfo", "-h", "-o", "%P %D", *(["-p", partition] if partition else []))
    rows = [line.split() for line in out.splitlines() if line.strip()]
    if partition is None:
        rows = [r for r in rows if r[0].endswith("*")]
    if not rows:
        raise SlurmError(f"sinfo: no partition {partition!r}" if partition else "sinfo: no default partition")
    return rows[0][0].rstrip("*"), sum(int(r[1]) for r in rows)


def _fields(text: str) -> dict[str, str]:
    out = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def state(job_id: str) -> JobState:
    """The job's state now: from ``scontrol``, else ``sacct``, else UNKNOWN (taken as ended)."""
    try:
        f = _fields(_run("scontrol", "-o", "show", "job", job_id))
    except SlurmError as err:
        if "Invalid job id" not in str(err):
            raise
    else:
        nodes = f.get("NodeList")
        return JobState(f.get("JobState", UNKNOWN), f.get("ExitCode"), None if nodes in (None, "(null)") else nodes,
                        f.get("Reason"))  # fmt: skip
    if shutil.which("sacct"):
        try:
            out = _run("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode,NodeList")
        except SlurmError:
            out = ""  # no accounting storage configured
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) == 3:
                return JobState(parts[0].split()[0], parts[1], parts[2] or None)
    return JobState(UNKNOWN)


def cancel(job_id: str) -> None:
    _run("scancel", job_id)
