"""Each job of a cluster campaign, recorded once it has ended: in the ledger and in ``run.json``.

A record says which attempt it was (1 for the first job), the scheduler's job id, the
nodes it ran on, how it ended (the scheduler's state and the supervisor's reason: the
job failed, its heartbeat was missed, it completed) and the step it resumed from (the
step of the ledger's last finished stage when it was submitted; None for a fresh run).
``fp8rl query RUN "SELECT * FROM job_attempts"`` reads them back.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from pathlib import Path

from storage.ledger.events import Ledger
from storage.run import lock
from storage.run.layout import RUN_FILE, update_run_info


@dataclass(frozen=True)
class JobAttempt:
    attempt: int
    backend: str
    job_id: str
    nodes: str | None
    state: str
    exit_reason: str
    resumed_from_step: int | None
    submitted_at: str
    ended_at: str

    @property
    def succeeded(self) -> bool:
        return self.exit_reason == COMPLETED


COMPLETED = "completed"


def resumed_from(run_dir: Path) -> int | None:
    """The step a job submitted now resumes from: that of the ledger's last finished stage (None: fresh)."""
    last = Ledger(run_dir).last_finished()
    return None if last is None else last[0]


def record(run_dir: Path, attempt: JobAttempt, *, locked: bool = True) -> None:
    """Append ``attempt`` to the ledger and to ``run.json``'s ``job_attempts``, under the run's lock
    (the job has ended: nothing else writes the run now). ``locked=False``: the job may still be ending
    (the supervisor was stopped); the ledger's own append lock still orders the record."""
    import json

    with lock.run_lock(run_dir) if locked else contextlib.nullcontext():
        Ledger(run_dir).job_attempt(asdict(attempt))
        data = json.loads((run_dir / RUN_FILE).read_text(encoding="utf-8"))
        update_run_info(run_dir, job_attempts=[*(data.get("job_attempts") or []), asdict(attempt)])


def recorded(run_dir: Path) -> list[dict]:
    return Ledger(run_dir).job_attempts()
