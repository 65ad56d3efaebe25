"""The backends of ``fp8rl submit``, as data: what each renders, whether it submits, what it needs.

======== ============================ ========= =====================================================
backend  renders                      submits   needs on the submitting machine
======== ============================ ========= =====================================================
local    nothing (today's fp8rl run)  runs here nothing beyond the project
slurm    an sbatch script             yes       ``sbatch``, ``squeue``, ``scontrol``, ``scancel``, ``sinfo``
k8s      an indexed Job (YAML)        no        nothing: ``--dry-run`` only (the job is not supervised)
======== ============================ ========= =====================================================
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    name: str
    renders: str | None  # what --dry-run prints (None: the local run has no job to render)
    submits: bool  # whether a real (not --dry-run) submission is possible
    needs: tuple[str, ...]  # programs a real submission runs
    why_not: str = ""  # the one line when ``submits`` is False


BACKENDS = {
    b.name: b
    for b in (
        Backend("local", None, True, ()),
        Backend("slurm", "sbatch script", True, ("sbatch", "squeue", "scontrol", "scancel", "sinfo")),
        Backend(
            "k8s",
            "Kubernetes indexed Job",
            False,
            (),
            why_not="the k8s backend renders its Job with --dry-run only; apply it with kubectl yourself "
            "(nothing supervises it)",
        ),
    )
}


def backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"--backend {name!r}: expected one of {', '.join(BACKENDS)}") from None
