"""A Prefect API server for the campaigns a test worker starts as processes.

Without ``PREFECT_API_URL`` every ``fp8rl run`` starts Prefect's temporary server
(``flows.orchestration.server``): about 12 s of wall time and 7 s of CPU a run on a 2-core
machine, half of a micro campaign. The suite starts one ``prefect server start`` per
worker instead (its own ``PREFECT_HOME``, a free port on 127.0.0.1) and exports
``PREFECT_API_URL``, so the campaigns the tests start report to it, as a user's
campaigns report to the server they schedule them on. The temporary server keeps its
own tests: the signal matrix, a SIGKILLed parent, the console of a first run, the
deployment commands without a server; those drop the variable (:func:`without_server`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A port on 127.0.0.1 free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(url: str) -> bool:
    """Does the Prefect API at ``url`` answer its health check?"""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start(python: str, home: Path, log: Path, *, timeout_s: float = 180.0) -> tuple[str, subprocess.Popen] | None:
    """``prefect server start`` under ``python`` (a venv's interpreter) with its database in ``home``;
    (its API URL, the process) once it answers, None if it does not within ``timeout_s`` (then the
    campaigns start their temporary servers, as without this)."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_SERVER_LOGGING_LEVEL="CRITICAL", PREFECT_UI_ENABLED="false")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [python, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if healthy(url):
            return url, proc
        time.sleep(0.5)
    stop(proc)
    return None


def stop(proc: subprocess.Popen | None) -> None:
    """End the server and its children (its own session); SIGKILL after 10 s."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def without_server(env: dict[str, str]) -> dict[str, str]:
    """``env`` without ``PREFECT_API_URL``: the run starts Prefect's temporary server, as by default."""
    return {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
