"""The campaign in this process or under torchrun, ended by a signal in one line (:mod:`flows.shutdown`).

:func:`run_flow` is what ``fp8rl run`` and ``fp8rl resume`` call once the run
directory is locked; :func:`until_signal` is the part every process of a run
shares (the command, each rank): run the body; on SIGINT or SIGTERM end what is
below the process, stop Prefect's temporary server last, print the line (the
command only) and exit 128 + the signal's number.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


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
            if signals.signum is None:
                raise
    shutdown.end_descendants(skip=keep())  # pool workers, sandbox launchers, what a rank left behind
    prefect_server.drain_clients()  # the interrupted flow's last logs and events, while the server lives
    prefect_server.stop(holder.get("server"))  # last
    raise shutdown.RunEnded(signals.signum, line(signals.signum))


def run_flow(run_dir: Path, *, resume: bool, nproc_per_node: int = 1) -> dict:
    """The campaign of ``run_dir`` in this process, or on ``nproc_per_node`` ranks under torchrun."""

    def body(start_server: Callable[[], None]) -> dict:
        if nproc_per_node > 1:  # SPMD under torchrun: rank 0 runs the flow and its server
            from flows.spmd import launch

            return launch(run_dir, resume=resume, nproc_per_node=nproc_per_node)
        from flows.campaign import campaign_flow
        from flows.prefect_env import quiet_console_failures

        start_server()
        quiet_console_failures()  # a failure is one line (flows.cli_campaign), not Prefect's tracebacks
        return campaign_flow(str(run_dir), resume=resume)

    return until_signal(body, resume=resume_command(run_dir, nproc_per_node))
