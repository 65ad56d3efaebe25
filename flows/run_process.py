"""The campaign in this process or under torchrun, ended by a signal in one line (:mod:`flows.shutdown`).

:func:`run_flow` is what ``fp8rl run`` and ``fp8rl resume`` call once the run
directory is locked; :func:`until_signal` is the part every process of a run
shares (the command, each rank): run the body; on SIGINT or SIGTERM end what is
below the process, stop Prefect's temporary server last, print the line (the
command only) and exit 128 + the signal's number.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
FORWARD_WAIT_S = 7.0  # how long the launcher waits for torchrun to end the ranks after forwarding a signal


def resume_command(run_dir: Path, nproc_per_node: int = 1) -> str:
    """The command that continues ``run_dir``."""
    return f"fp8rl resume {run_dir}" + (f" --nproc-per-node {nproc_per_node}" if nproc_per_node > 1 else "")


def until_signal(
    body: Callable[[Callable[[], None]], T],
    *,
    resume: str | None,
    deadline_s: float | None = None,
) -> T:
    """``body(start_server)``, ended in order by SIGINT or SIGTERM (see :mod:`flows.shutdown`).

    ``body`` calls ``start_server()`` where Prefect would start its temporary
    server (in its own session, stopped here last). ``resume``: the command
    named in the one line (None: say nothing, as a rank does). Raises
    :class:`flows.shutdown.RunEnded` when a signal ended the run, for the
    process's entry point to end it with (:func:`flows.shutdown.exit_now`)."""
    from flows import child_guard, prefect_server, shutdown

    holder: dict = {}

    def keep() -> list[int]:
        guard = holder.get("guard")
        return [p for p in (guard.pid if guard else None, prefect_server.pid(holder.get("server"))) if p]

    def line(signum: int) -> str | None:
        return None if resume is None else shutdown.interrupted_line(signum, resume)

    def start_server() -> None:
        holder["guard"] = child_guard.start()  # the server dies with this process, even on SIGKILL
        holder["server"] = prefect_server.start()

    def on_deadline(signum: int) -> None:
        shutdown.force_end(signum, line(signum), keep=keep())

    shutdown.become_subreaper()
    with shutdown.signals_end_the_run(on_deadline, deadline_s or shutdown.DEADLINE_S) as signals:
        try:
            return body(start_server)
        except BaseException:
            if signals.settle() is None:  # not a signal's doing (a peer's end by one included)
                raise
    shutdown.end_descendants(skip=keep())  # pool workers, sandbox launchers, what a rank left behind
    prefect_server.drain_clients()  # the interrupted flow's last logs and events, while the server lives
    prefect_server.stop(holder.get("server"))  # last
    raise shutdown.RunEnded(signals.signum, line(signals.signum))


def run_flow(run_dir: Path, *, resume: bool, nproc_per_node: int = 1) -> dict:
    """The campaign of ``run_dir`` in this process, or on ``nproc_per_node`` ranks under torchrun."""

    def body(start_server: Callable[[], None]) -> dict:
        if nproc_per_node > 1:  # SPMD under torchrun: rank 0 runs the flow and its server
            return launch(run_dir, resume=resume, nproc_per_node=nproc_per_node)
        from flows.campaign import campaign_flow
        from flows.prefect_env import quiet_console_failures

        start_server()
        quiet_console_failures()  # a failure is one line (flows.cli_campaign), not Prefect's tracebacks
        return campaign_flow(str(run_dir), resume=resume)

    return until_signal(body, resume=resume_command(run_dir, nproc_per_node))


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """torchrun gets SIGTERM (and forwards it to the ranks) if the launcher dies, even by SIGKILL."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _torchrun(cmd: list[str], env: dict) -> int:
    """torchrun's exit status; a signal that interrupts the wait is forwarded to it (it forwards it to
    every rank's process group) and re-raised once torchrun has ended (at most ``FORWARD_WAIT_S``)."""
    from flows.shutdown import Interrupted

    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        return proc.wait()
    except Interrupted as err:
        proc.send_signal(err.signum)
        try:
            proc.wait(timeout=FORWARD_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # the ranks left are ended by the launcher (flows.shutdown.end_descendants)
            proc.wait()
        raise


def launch(run_dir: Path, *, resume: bool, nproc_per_node: int) -> dict:
    """Run the campaign in ``run_dir`` on ``nproc_per_node`` local ranks via torchrun; rank 0's summary."""
    result = run_dir / ".spmd-result.json"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "flows.torchrun",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        "-m",
        "flows.spmd",
        str(run_dir),
        "--result",
        str(result),
    ] + (["--resume"] if resume else [])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    from storage.lock import LAUNCHER_ENV

    env[LAUNCHER_ENV] = str(Path(run_dir).resolve())  # this process holds the run's lock for the ranks
    code = _torchrun(cmd, env)
    if code != 0:  # torchrun already printed which rank failed and why
        raise SystemExit(
            f"error: torchrun exited with {code} (a rank failed; all ranks were stopped); "
            f"`fp8rl resume {run_dir} --nproc-per-node N` continues from the last checkpoint"
        )
    return json.loads(result.read_text())
