"""Prefect's environment: the temporary server's database-pool tracebacks stay off the console.

Under CPU contention the temporary server subprocess (which inherits our
environment and reads the same logging config) logged a SQLAlchemy pool
traceback (a cancelled connection reset) on the campaign's console. Each check
runs a fresh interpreter, because Prefect configures logging once, at import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

_EMIT = """
import logging, sys
from flows.orchestration.env import configure_prefect_env
configure_prefect_env()
from prefect.logging.configuration import setup_logging
setup_logging()  # what the temporary server's create_app and `from prefect import flow` both call
try:
    raise RuntimeError("cancelled during reset")
except RuntimeError:
    logging.getLogger("sqlalchemy.pool.impl.AsyncAdaptedQueuePool").error("Exception during reset", exc_info=True)
    logging.getLogger("some.library").warning("a library warning users should still see")
print("level", logging.getLogger("prefect").getEffectiveLevel())
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    e = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PREFECT_LOGGING") and k not in ("PREFECT_API_URL", "PREFECT_HOME")
    }
    e.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable, "-c", _EMIT], capture_output=True, text=True, env=e, timeout=120)


def test_the_database_pool_traceback_is_quiet_and_other_warnings_are_not(tmp_path):
    r = _run(tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Exception during reset" not in r.stderr, r.stderr
    assert "a library warning users should still see" in r.stderr  # the root console handler still works
    assert "level 30" in r.stdout  # Prefect's own WARNING default (quiet=True) still applies
    from flows.orchestration.env import prefect_version

    written = tmp_path / "cache" / "fp8rl" / f"prefect-logging-{prefect_version()}.yml"  # each Prefect its own
    assert written.exists() and "${PREFECT_LOGGING_LEVEL}" in written.read_text()  # templates kept for Prefect


@pytest.mark.parametrize("where", ["settings-path", "prefect-home"])
def test_a_users_own_logging_file_wins(tmp_path, where):
    own = tmp_path / "own"
    own.mkdir()
    (own / "logging.yml").write_text(
        "version: 1\ndisable_existing_loggers: false\n"
        "handlers: {err: {class: logging.StreamHandler, stream: 'ext://sys.stderr'}}\n"
        "root: {level: WARNING, handlers: [err]}\n"
    )
    env = (
        {"PREFECT_LOGGING_SETTINGS_PATH": str(own / "logging.yml")}
        if where == "settings-path"
        else {"PREFECT_HOME": str(own)}
    )
    r = _run(tmp_path, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Exception during reset" in r.stderr  # their config has no quiet sqlalchemy logger
    assert not list((tmp_path / "cache" / "fp8rl").glob("prefect-logging*.yml"))
