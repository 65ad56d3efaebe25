"""The campaign in this process or under torchrun, ended by a signal in one line (:mod:`flows.process.shutdown`).

:func:`run_flow` is what ``fp8rl run`` and ``fp8rl resume`` call once the run
directory is locked; :func:`until_signal` is the part every process of a run
shares (the command, each rank): run the body; on SIGINT or SIGTERM end what is
below the process, stop Prefect's temporary server last, print the line (the
command only) and exit 128 + the signal's number.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
FORWARD_WAIT_S = 7.0  # how long the launcher waits for torchrun to end the ranks after forwarding a signal
# from the temporary server's death to the run's forced end: the flow's own end would retry the dead server
# (minutes); the stage in flight stays unfinished either way, and resume redoes it
SERVER_LOST_DEADLINE_S = 2.0


def resume_command(run_dir: Path, nproc_per_node: int = 1) -> str:
    """The command that continues ``run_dir``."""
    return f"fp8rl resume {run_dir}" + (f" --nproc-per-node {nproc_per_node}" if nproc_per_node > 1 else "")


def until_signal(
    body: Callable[[Callable[[], None]], T],
    *,
    resume: str | None,
    deadline_s: float | None = None,
) -> T:
    """``body(start_server)``, ended in order by SIGINT or SIGTERM (see :mod:`flows.process.shutdown`), or by
    Prefect's temporary server failing.

    ``body`` calls ``start_server()`` where Prefect would start its temporary
    server (in its own session, watched, stopped here last). ``resume``: the
    command named in the one line (None: say nothing, as a rank does). Raises
    :class:`flows.process.shutdown.RunEnded` when a signal ended the run, for the
    process's entry point to end it with (:func:`flows.process.shutdown.exit_now`).

    A server that cannot start, or dies, ends the run this way with exit 2 and its
    own line (cause, log, ``resume``): a death is sent as SIGTERM to the main thread,
    so the stage in flight unwinds as at a signal (the flow would retry the dead server)."""
    from flows.orchestration import server as prefect_server
    from flows.orchestration.preflight import ServerUnavailable
    from flows.process import child_guard, shutdown

    holder: dict = {}

    def keep() -> list[int]:
        guard = holder.get("guard")
        return [p for p in (guard.pid if guard else None, prefect_server.pid(holder.get("server"))) if p]

    def server_failure() -> str | None:
        """Why the server failed the run (it could not start, or its process ended), else None."""
        if holder.get("failure") is None and prefect_server.lost(holder.get("server")) is not None:
            holder["failure"] = prefect_server.lost_line(holder["server"])
        return holder.get("failure")

    def ending(signum: int | None) -> shutdown.RunEnded:
        """The run's end: its server's failure and exit 2, else a signal's line and 128 + its number."""
        failure = server_failure()
        if failure is None:
            return shutdown.RunEnded(signum, None if resume is None else shutdown.interrupted_line(signum, resume))
        tail = "" if resume is None else f"; the run stays resumable: `{resume}`"
        return shutdown.RunEnded(signum, f"error: {failure}{tail}", code=2)

    def on_server_death(_code: int) -> None:  # (the watch's thread) the run ends by the signal path
        prefect_server.quiet_clients()  # no error line per log batch the dead server cannot take
        holder["signals"].end_within(SERVER_LOST_DEADLINE_S, signal.SIGTERM)  # Prefect's clients would retry
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    def start_server() -> None:
        holder["guard"] = child_guard.start()  # the server dies with this process, even on SIGKILL
        holder["server"] = prefect_server.start(on_server_death)

    def on_deadline(signum: int) -> None:
        end = ending(signum)
        shutdown.force_end(signum, end.line, keep=keep(), code=end.code)

    shutdown.become_subreaper()
    with shutdown.signals_end_the_run(on_deadline, deadline_s or shutdown.DEADLINE_S) as signals:
        holder["signals"] = signals
        try:
            out = body(start_server)
            if prefect_server.stop_watch(holder.get("server"))[1]:  # died as the run ended: its deadline ends it
                signals.arrived(within_s=1.0)
                signals.settle()
            return out  # a server that ends from here on ends after the run
        except ServerUnavailable as err:  # the server could not start: nothing of it is left
            holder["failure"] = str(err)
            signals.settle()
        except BaseException:
            died, fired = prefect_server.stop_watch(holder.get("server"))
            if fired:
                signals.arrived(within_s=1.0)  # the watch's SIGTERM, taken as handled below
            elif died is not None:  # the flow failed on the dead server before the watch saw it die
                prefect_server.quiet_clients()
            if signals.settle() is None and died is None:  # not a signal's doing, nor the server's
                raise
    shutdown.end_descendants(skip=keep())  # pool workers, sandbox launchers, what a rank left behind
    if server_failure() is None:
        prefect_server.drain_clients()  # the interrupted flow's last logs and events, while the server lives
    prefect_server.stop(holder.get("server"))  # last
    raise ending(signals.signum)


def run_flow(run_dir: Path, *, resume: bool, nproc_per_node: int = 1) -> dict:
    """The campaign of ``run_dir`` in this process, or on ``nproc_per_node`` ranks under torchrun."""

    def body(start_server: Callable[[], None]) -> dict:
        if nproc_per_node > 1:  # SPMD under torchrun: rank 0 runs the flow and its server
            return launch(run_dir, resume=resume, nproc_per_node=nproc_per_node)
        from flows.campaign.flow import campaign_flow
        from flows.orchestration.env import quiet_console_failures

        start_server()
        quiet_console_failures()  # a failure is one line (flows.commands.run), not Prefect's tracebacks
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
    from flows.process.shutdown import Interrupted

    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
    try:
        return proc.wait()
    except Interrupted as err:
        proc.send_signal(err.signum)
        try:
            proc.wait(timeout=FORWARD_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()  # the ranks left are ended by the launcher (flows.process.shutdown.end_descendants)
            proc.wait()
        raise


def launch(run_dir: Path, *, resume: bool, nproc_per_node: int) -> dict:
    """Run the campaign in ``run_dir`` on ``nproc_per_node`` local ranks via torchrun; rank 0's summary."""
    result = run_dir / ".spmd-result.json"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "flows.process.torchrun",
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
    from storage.run.lock import LAUNCHER_ENV

    env[LAUNCHER_ENV] = str(Path(run_dir).resolve())  # this process holds the run's lock for the ranks
    code = _torchrun(cmd, env)
    if code != 0:  # torchrun already printed which rank failed and why
        raise SystemExit(
            f"error: torchrun exited with {code} (a rank failed; all ranks were stopped); "
            f"`fp8rl resume {run_dir} --nproc-per-node N` continues from the last checkpoint"
        )
    return json.loads(result.read_text())
