"""Prefect's temporary API server in a session of its own, watched, stopped last.

Without ``PREFECT_API_URL`` Prefect starts a temporary server (a ``uvicorn``
subprocess) the first time a flow needs one. :func:`start` starts it first,
through Prefect's own class (:class:`prefect.server.api.server.SubprocessASGIServer`,
which every Prefect client asks for the temporary server and which keeps one
instance) and with its command line unchanged, but in our own way:

* **In a session of its own.** In the caller's process group a terminal's
  Ctrl-C reached it together with the ``fp8rl`` process, and it stopped first:
  the flow then retried the dead server while reporting its own end (tracebacks
  from httpx, more than a minute). Signals reach it only from :func:`stop`
  (after the run has ended, :mod:`flows.process.shutdown`) or from
  :mod:`flows.process.child_guard` (when the process that started it died without
  stopping it).
* **Its output in a log file** (``$PREFECT_HOME/temporary-server-<pid>.log``),
  not on the run's console; removed when the server stops cleanly, kept and
  named when it failed.
* **A start that fails is one line.** Prefect's own start waits out the whole
  start-up limit when the server process has already exited (and restarts it
  forever when it exits with code 3, which a failed migration gives), then
  raises a ``RuntimeError`` with the server's output in it. Here the wait ends
  as soon as the process exits, and any failure (no free port, a process that
  exits, no answer within the limit) raises
  :class:`flows.orchestration.preflight.ServerUnavailable`: the cause (the last error
  line of the log), the log file, the limit's setting. The process is ended
  first; nothing is left.
* **Its death is noticed.** A thread (:class:`Watch`) polls the process; if it
  exits before :func:`stop`, the run is ended through the one shutdown path
  (:func:`flows.campaign.launch.until_signal`) instead of retrying a dead server
  for minutes a step.

Before any of this, :func:`flows.orchestration.preflight.check_temporary_server` has looked at the
database and the ports, before the run's directory exists.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import signal
import subprocess
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable

from flows.orchestration import api as prefect_api  # noqa: F401 (Prefect's environment is set before Prefect is imported)
from flows.orchestration.env import STARTUP_LIMIT_ENV, STARTUP_LIMIT_S
from flows.orchestration.preflight import PORTS_ENV, ServerUnavailable, free_port

PORT_TRIES = 3  # another process may bind the port between our check and the server's bind
WATCH_POLL_S = 0.1  # a waitpid a poll


def startup_limit_s() -> float:
    """How long the server may take to answer: Prefect's ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``
    (fp8rl's default 120 s, :mod:`flows.orchestration.env`)."""
    from prefect.settings import get_current_settings

    try:
        return float(get_current_settings().server.ephemeral.startup_timeout_seconds)
    except (AttributeError, TypeError, ValueError):  # another Prefect's settings
        return float(os.environ.get(STARTUP_LIMIT_ENV) or STARTUP_LIMIT_S)


def log_cause(log: Path) -> str:
    """The cause a server's log gives for its end: its last exception line (else its last line), one line."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    error = re.compile(r"^([\w.]+(Error|Exception|Exit|Interrupt)|[\w.]+\.exc\.\w+)\b.*:")
    cause = next((ln for ln in reversed(lines) if error.match(ln)), lines[-1] if lines else "")
    cause = " ".join(cause.split())
    return cause if len(cause) <= 300 else cause[:297] + "..."


def exit_status(code: int) -> str:
    """A process's exit status in words."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _new_log() -> Path:
    """An empty log file for a server this process starts, in the Prefect home."""
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    log = home / f"temporary-server-{os.getpid()}.log"
    try:
        home.mkdir(parents=True, exist_ok=True)
        log.write_bytes(b"")
    except OSError as err:
        raise ServerUnavailable(
            f"Prefect's temporary server cannot write its log in {home}: {err.strerror or err}"
        ) from None
    return log


class LockWaitedOut(ServerUnavailable):
    """Another process's server was still starting in this home at the start-up limit."""


@contextlib.contextmanager
def one_start_at_a_time(log: Path, deadline: float, limit_s: float):
    """Hold the Prefect home's start-up lock while a server starts: a first start migrates the home's
    database, and two servers migrating one database at once fail (Alembic's version row, a column
    added twice), as two campaigns started together in one home would. Waits at most to ``deadline``."""
    import fcntl

    with open(log.parent / "temporary-server.start.lock", "a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LockWaitedOut(
                        f"Prefect's temporary server waited {limit_s:.0f} s for another process's server to "
                        f"start in {log.parent} (the start-up limit, {STARTUP_LIMIT_ENV})"
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _wait_healthy(server, deadline: float, limit_s: float) -> int | None:
    """None once ``server`` answers its health check; its process's exit code if that exits first; past
    ``deadline`` (``limit_s`` after the start) the server is stopped and :class:`ServerUnavailable` raised."""
    import httpx

    with httpx.Client() as client:
        while True:
            code = server.server_process.poll()
            if code is not None:
                return code
            try:
                if client.get(f"{server.api_url}/health", timeout=2).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                server._fail(
                    f"did not answer within {limit_s:.0f} s (the start-up limit, "
                    f"{STARTUP_LIMIT_ENV}; raise it on a busy machine)"
                )
            time.sleep(0.1)


@functools.cache
def _server_class():
    from prefect.server.api import server as server_module

    class OwnSessionServer(server_module.SubprocessASGIServer):
        """Prefect's temporary server: its command line unchanged, started as the module doc says."""

        log: Path | None = None
        watch: Watch | None = None

        def find_available_port(self) -> int:
            return free_port()  # the range of FP8RL_PREFECT_PORTS, every port of it tried

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # the module reaches Popen through its `subprocess` global: give it one that starts a new
            # session with its output in the log
            def popen(*args, **kwargs):
                kwargs.update(start_new_session=True, stdin=subprocess.DEVNULL)
                env = kwargs.get("env")
                if env is not None and env.get("PREFECT_SERVER_LOGGING_LEVEL", "").upper() == "CRITICAL":
                    # fp8rl's default keeps the console quiet; the log keeps errors (a failed start says why)
                    kwargs["env"] = {**env, "PREFECT_SERVER_LOGGING_LEVEL": "ERROR"}
                kwargs.setdefault("stdout", out)
                kwargs.setdefault("stderr", subprocess.STDOUT)
                return subprocess.Popen(*args, **kwargs)

            with open(self.log, "ab") as out:
                server_module.subprocess = types.SimpleNamespace(Popen=popen)
                try:
                    return super()._run_uvicorn_command()
                finally:
                    server_module.subprocess = subprocess

        def start(self, timeout: int | None = None) -> None:
            if self.running:
                return
            self.log = _new_log()
            limit_s = float(timeout or startup_limit_s())
            deadline = time.monotonic() + limit_s
            atexit.register(self.stop)
            try:
                with one_start_at_a_time(self.log, deadline, limit_s):
                    for _ in range(PORT_TRIES):
                        try:
                            self.port = self.find_available_port()
                        except ServerUnavailable:
                            if self.server_process is None:  # nothing started: nothing to read in a log
                                self.log.unlink(missing_ok=True)
                            raise
                        self.running = True
                        self.server_process = self._run_uvicorn_command()
                        code = _wait_healthy(self, deadline, limit_s)
                        if code is None:
                            return
                        if "address already in use" not in self.log.read_text(errors="replace").lower():
                            self._fail(f"exited at start-up ({exit_status(code)}): {log_cause(self.log)}")
            except LockWaitedOut:
                self.log.unlink(missing_ok=True)  # nothing started: nothing to read in a log
                raise
            self._fail(f"found its port taken at each of {PORT_TRIES} starts (ports: {PORTS_ENV})")

        def _fail(self, what: str) -> None:
            self.stop()
            raise ServerUnavailable(f"Prefect's temporary server {what}; its log: {self.log}")

    return server_module.SubprocessASGIServer, OwnSessionServer


class Watch:
    """Calls ``on_death(exit_code)`` once, from a thread, if ``process`` exits before :meth:`stop`."""

    def __init__(self, process: subprocess.Popen, on_death: Callable[[int], None]) -> None:
        self.exit_code: int | None = None  # the process's, once it ended before stop()
        self.fired = False  # on_death was called (and has returned, once stop() has)
        self._process, self._on_death = process, on_death
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefect-server-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(WATCH_POLL_S):
            code = self._process.poll()
            if code is not None:
                self.exit_code, self.fired = code, True
                self._on_death(code)
                return

    def stop(self) -> int | None:
        """No call after this returns; the exit code of a process that ended meanwhile (noticed by the
        thread or, if it has not looked since, here), else None."""
        if not self._stopped.is_set():
            self._stopped.set()
            if self._thread is not threading.current_thread():
                self._thread.join()
            if self.exit_code is None:
                self.exit_code = self._process.poll()
        return self.exit_code


def start(on_death: Callable[[int], None] | None = None):
    """Start the temporary server as the module doc says; None when Prefect reports to a configured server
    (``PREFECT_API_URL``) or has no temporary one. Idempotent: a running one is returned as it is.

    ``on_death(exit_code)`` is called from a thread if the server's process exits before :func:`stop`.
    A start that fails raises :class:`ServerUnavailable` (nothing of the server left)."""
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
    try:
        server.start()
    finally:
        if not server.running:
            base._instances.pop(None, None)  # a later start begins afresh
    if on_death is not None:
        server.watch = Watch(server.server_process, on_death)
    atexit.register(stop, server)  # before Prefect's own stop of it (atexit runs last-in first): the log goes
    return server


def pid(server) -> int | None:
    """The server's process id, or None."""
    proc = getattr(server, "server_process", None)
    return None if proc is None else proc.pid


def lost(server) -> int | None:
    """The exit code of a server whose process ended before :func:`stop` (or :func:`stop_watch`), else None."""
    watch = getattr(server, "watch", None)
    return None if watch is None else watch.exit_code


def stop_watch(server) -> tuple[int | None, bool]:
    """Stop watching the server: (its exit code if its process has ended, else None; whether ``on_death``
    was called)."""
    watch = getattr(server, "watch", None)
    return (None, False) if watch is None else (watch.stop(), watch.fired)


def lost_line(server) -> str:
    """What the run says when its server ended under it (the resume command is the caller's)."""
    code = lost(server)
    return (
        f"Prefect's temporary server stopped during the run ({exit_status(code if code is not None else 0)}; "
        f"its log: {getattr(server, 'log', None)}); the stage in flight stays unfinished"
    )


def quiet_clients() -> None:
    """Once the server has gone: keep Prefect's clients off the console. Its log worker writes an error
    for each batch it cannot send (while ``logging.raiseExceptions``), its event worker logs one for each
    event; the run's own line says what happened."""
    logging.raiseExceptions = False
    for name in ["prefect", *(n for n in list(logging.root.manager.loggerDict) if n.startswith("prefect."))]:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


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
    """Stop the server (SIGTERM, SIGKILL after 5 s: Prefect's own stop); nothing for None. The log of a
    server that ran and stopped here is removed; one that died or failed keeps its log."""
    if server is None:
        return
    watch = getattr(server, "watch", None)
    if watch is not None:
        watch.stop()
    if server.running:
        server.stop()
    log = getattr(server, "log", None)
    if log is not None and lost(server) is None:
        log.unlink(missing_ok=True)
