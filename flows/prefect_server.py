"""Prefect's temporary API server in a session of its own, stopped last.

Without ``PREFECT_API_URL`` Prefect starts a temporary server (a ``uvicorn``
subprocess) the first time a flow needs one. In the caller's process group it
receives a terminal's Ctrl-C together with the ``fp8rl`` process, and stops
first: the flow then retries the dead server while reporting its own end
(tracebacks from httpx, more than a minute). :func:`start` starts the same
server, through Prefect's own class (:class:`prefect.server.api.server.SubprocessASGIServer`,
which every Prefect client asks for the temporary server and which keeps one
instance), with one difference: ``start_new_session``. Signals reach it only
from :func:`stop` (after the run has ended, :mod:`flows.shutdown`) or from
:mod:`flows.child_guard` (when the process that started it died without
stopping it).
"""

from __future__ import annotations

import functools
import subprocess
import types
from typing import Any

from flows import prefect_api  # noqa: F401 (Prefect's environment is set before Prefect is imported)


@functools.cache
def _server_class():
    from prefect.server.api import server as server_module

    class OwnSessionServer(server_module.SubprocessASGIServer):
        """Prefect's temporary server, started in a new session (its command line unchanged)."""

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # the module reaches Popen through its `subprocess` global: give it one that starts a new session
            popen = functools.partial(subprocess.Popen, start_new_session=True)
            server_module.subprocess = types.SimpleNamespace(Popen=popen)
            try:
                return super()._run_uvicorn_command()
            finally:
                server_module.subprocess = subprocess

    return server_module.SubprocessASGIServer, OwnSessionServer


def start():
    """Start the temporary server in its own session; None when Prefect reports to a configured server
    (``PREFECT_API_URL``) or has no temporary one. Idempotent: a running one is returned as it is."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    try:
        if settings.api.url or not settings.server.ephemeral.enabled:
            return None
    except AttributeError:  # another Prefect's settings: leave the server to Prefect
        return None
    base, own = _server_class()
    if not (isinstance(getattr(base, "_instances", None), dict) and hasattr(base, "_run_uvicorn_command")):
        return None  # a Prefect without them starts its own server, in this process group, as before
    existing = base._instances.get(None)
    if existing is not None and existing.running:
        return existing if isinstance(existing, own) else None
    base._instances.pop(None, None)
    server = own()
    server.start()
    return server


def pid(server) -> int | None:
    """The server's process id, or None."""
    proc = getattr(server, "server_process", None)
    return None if proc is None else proc.pid


def drain_clients(timeout_s: float = 2.0) -> None:
    """Send what Prefect's log and event workers still hold, waiting at most ``timeout_s`` each (they
    would otherwise try at exit, after the server has stopped)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=timeout_s)
        except Exception:  # a flush is a courtesy to the server's records; never fail the shutdown on it
            pass


def stop(server) -> None:
    """Stop the server (SIGTERM, SIGKILL after 5 s: Prefect's own stop); nothing for None."""
    if server is not None and server.running:
        server.stop()
