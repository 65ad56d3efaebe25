"""The supervising flow: submit the job, watch the run's ledger as its heartbeat, resubmit to resume.

One Prefect flow run per ``fp8rl submit``, on the submitting machine (a login node), on CPU;
the ranks run in the scheduler's job. For each attempt, at most ``retries.job + 1``:

1. render the sbatch script (``--resume`` once the ledger holds a finished stage) into
   ``RUN_DIR/cluster/attempt-<n>.sbatch`` and submit it (:func:`submit_job`, a task that Prefect
   retries when the scheduler does not answer);
2. watch (:func:`watch_job`): while the job waits in the queue nothing is counted; once it runs, a
   change of ``ledger.jsonl`` (a stage started, finished or failed, on any rank that writes it) is a
   beat. A running job silent for ``timeouts.heartbeat_s`` is cancelled (``scancel``): the per-stage
   limits end a hung stage on every rank by themselves, so a silence longer than any of them means
   what no rank can report, ranks stopped or stuck outside a stage, a node that vanished;
3. a job that ended with a failure (any state but COMPLETED with exit 0:0, or no summary from rank 0)
   is cancelled too, in case a step of it lingers, and the supervisor waits until the scheduler
   reports the job ended (``scontrol``/``sacct``) before anything else touches the run directory;
4. the attempt is recorded (:mod:`flows.cluster.attempts`): ledger and ``run.json``;
5. a completed job ends the flow with rank 0's summary; a failed one is resubmitted with ``--resume``
   while attempts remain, and the flow fails with the last reason once none do.

The supervisor never runs two jobs of one run at a time: it submits the next only after the
scheduler reports the previous one ended, which is what keeps the run single-writer when the run
directory is on a network file system (``docs/cluster.md``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from prefect import flow, get_run_logger, task

from flows.campaign.configuration import load_config
from flows.cluster import slurm
from flows.cluster.attempts import COMPLETED, JobAttempt, record, recorded, resumed_from
from flows.cluster.slurm_script import JOB_DIR, RESULT_FILE, render

END_WAIT_S = 300.0  # how long a cancelled job may take to be reported ended before the supervisor gives up
INTERRUPT_WAIT_S = 5.0  # the same when the supervisor itself was stopped (flows.process.shutdown ends it within 8 s)


class JobsFailed(RuntimeError):
    """Every attempt failed; the message is the last one's reason."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def project_root() -> Path:
    """The checkout the job runs from (``--chdir``): it holds the ``flows`` package."""
    return Path(__file__).resolve().parents[2]


def write_script(run_dir: Path, attempt: int, *, resume: bool) -> Path:
    cfg = load_config(run_dir / "config.yaml")
    text = render(cfg, run_dir, python=sys.executable, workdir=project_root(), resume=resume)
    path = run_dir / JOB_DIR / f"attempt-{attempt}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def job_environment(user_api_url: str | None) -> dict:
    """What the job inherits (sbatch --export=ALL): this process's environment, with ``PREFECT_API_URL``
    only where the user set one (a temporary server of the supervisor is on 127.0.0.1 here, which a
    compute node cannot reach: rank 0 then starts its own, as ``fp8rl run`` does)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    if user_api_url:
        env["PREFECT_API_URL"] = user_api_url
    return env


@task(retries=3, retry_delay_seconds=10, retry_condition_fn=lambda t, r, s: _is_slurm_error(s))
def submit_job(script: str, env: dict) -> str:
    """``sbatch`` the script; its job id. Retried when the scheduler does not answer."""
    return slurm.submit(Path(script), env=env)


def _is_slurm_error(state) -> bool:
    try:
        state.result()
    except slurm.SlurmError:
        return True
    except BaseException:
        return False
    return False


def _ledger_mark(run_dir: Path) -> tuple[int, int]:
    try:
        st = (run_dir / "ledger.jsonl").stat()
        return st.st_size, st.st_mtime_ns
    except FileNotFoundError:
        return (0, 0)


def watch_job(run_dir: Path, job_id: str, *, heartbeat_s: float, poll_s: float) -> tuple[slurm.JobState, str]:
    """Watch ``job_id`` until it ends or misses its heartbeat; (its last state, the supervisor's reason).

    The reason is ``completed``, ``job <STATE> (exit <code>)`` or ``heartbeat missed: ...``."""
    log = get_run_logger()
    mark, beat, seen_running = _ledger_mark(run_dir), None, False
    while True:
        st = _state(job_id)
        if st.ended:
            if st.succeeded and (run_dir / RESULT_FILE).exists():
                return st, COMPLETED
            return st, f"job {st.state} (exit {st.exit_code or '?'})"
        now = time.monotonic()
        new = _ledger_mark(run_dir)
        if not st.running:  # queued, or suspended by the scheduler: nothing is counted
            beat = None
        elif beat is None or new != mark:
            beat = now
            if not seen_running:
                seen_running = True
                log.info(f"job {job_id} runs on {st.nodes}")
        mark = new
        if beat is not None and now - beat > heartbeat_s:
            log.warning(f"job {job_id}: the ledger was silent for {now - beat:.0f} s; cancelling it")
            return st, f"heartbeat missed: ledger silent for {now - beat:.0f} s (timeouts.heartbeat_s={heartbeat_s:g})"
        time.sleep(poll_s)


def _state(job_id: str, tries: int = 5) -> slurm.JobState:
    """The job's state; a scheduler that does not answer is asked again (a busy slurmctld times out)."""
    for i in range(tries):
        try:
            return slurm.state(job_id)
        except slurm.SlurmError:
            if i == tries - 1:
                raise
            time.sleep(2.0 * (i + 1))
    raise AssertionError("unreachable")


def end_job(job_id: str, *, wait_s: float = END_WAIT_S) -> slurm.JobState:
    """Cancel ``job_id`` (harmless when it has ended) and wait up to ``wait_s`` until the scheduler reports
    it ended; its last state either way."""
    try:
        slurm.cancel(job_id)
    except slurm.SlurmError:
        pass  # already gone; its state below says so
    deadline = time.monotonic() + wait_s
    while True:
        st = _state(job_id)
        if (st.ended and st.state != "COMPLETING") or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def _ended(job_id: str) -> slurm.JobState:
    st = end_job(job_id)
    if not st.ended:
        raise JobsFailed(f"job {job_id} was cancelled but is still {st.state} after {END_WAIT_S:g} s; see squeue")
    return st


@flow(name="fp8rl-cluster-supervisor", log_prints=False)
def supervise_flow(run_dir: str, user_api_url: str | None = None) -> dict:
    """Submit ``run_dir``'s job, watch it, resubmit it to resume up to ``retries.job`` times."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    log = get_run_logger()
    env = job_environment(user_api_url)
    reason = "no attempt"
    first = len(recorded(run_dir)) + 1  # a resubmitted run (fp8rl submit RUN_DIR) numbers on
    for attempt in range(first, first + cfg.retries.job + 1):
        start_step = resumed_from(run_dir)
        script = write_script(run_dir, attempt, resume=start_step is not None)
        (run_dir / RESULT_FILE).unlink(missing_ok=True)
        submitted = _now()
        job_id = submit_job(str(script), env)
        log.info(f"attempt {attempt}: job {job_id} submitted ({script.name})")
        try:
            st, reason = watch_job(run_dir, job_id, heartbeat_s=cfg.timeouts.heartbeat_s, poll_s=cfg.cluster.poll_s)
        except BaseException:  # interrupted: the job goes with the supervisor, the run stays resumable
            # (within the seconds a signal leaves this process: the record keeps Slurm's state then, e.g. RUNNING)
            st = end_job(job_id, wait_s=INTERRUPT_WAIT_S)
            reason = "interrupted: the supervisor was stopped; the job was cancelled"
            with contextlib.suppress(Exception):  # the interruption is what this process reports
                _record(run_dir, attempt, job_id, st, reason, start_step, submitted, locked=st.ended)
            raise
        if reason != COMPLETED:
            ended = _ended(job_id)
            st = slurm.JobState(ended.state, ended.exit_code, ended.nodes or st.nodes)
        _record(run_dir, attempt, job_id, st, reason, start_step, submitted)
        if reason == COMPLETED:
            return json.loads((run_dir / RESULT_FILE).read_text())
        log.warning(f"attempt {attempt}: {reason}")
    raise JobsFailed(f"{cfg.retries.job + 1} job attempt(s) failed, the last: {reason}")


def _record(run_dir, attempt, job_id, st, reason, start_step, submitted, *, locked: bool = True) -> None:
    record(
        run_dir,
        JobAttempt(attempt, "slurm", job_id, st.nodes, st.state, reason, start_step, submitted, _now()),
        locked=locked,
    )
