"""Can Prefect's temporary server start here? Checked before a run's directory exists.

Without ``PREFECT_API_URL`` a campaign starts Prefect's temporary API server
(:mod:`flows.orchestration.server`). Two things make that start fail in ways that cost
a user minutes and a traceback if nothing looks first, and both can be seen
without starting anything:

* **A database another Prefect migrated.** The server migrates its SQLite
  database to its own Prefect's newest schema at start-up, and records the
  schema's revision in the database (``alembic_version``). An older Prefect
  does not know a newer one's revision: its server fails at start-up and
  Prefect's client waits out the whole start-up limit. fp8rl's default home is
  one per Prefect version (:func:`flows.orchestration.env.default_home`), so only a
  home the user gave (``PREFECT_HOME``, or a database URL) can hold one. The
  check reads one row of the database and the revision ids of the installed
  Prefect's migration scripts (about a hundred small files): milliseconds.
* **No free port.** The server listens on 127.0.0.1, on a port of
  ``FP8RL_PREFECT_PORTS`` (default 8000-8999, Prefect's own range). The check
  binds ports of the range until one is free: microseconds when one is.

:func:`check_temporary_server` raises :class:`ServerUnavailable`, one line that names the cause
and the fix; the commands print it and exit 2. The same exception reports a
start that still fails (:mod:`flows.orchestration.server`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import re
import socket
import sqlite3
from pathlib import Path

PORTS_ENV = "FP8RL_PREFECT_PORTS"
DEFAULT_PORTS = range(8000, 9000)  # Prefect's own range for its temporary server
DATABASE_URL_ENVS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


class ServerUnavailable(RuntimeError):
    """Prefect's temporary server cannot start, or stopped: one line that says why and what to do."""


def uses_temporary_server() -> bool:
    """Does a flow here start Prefect's temporary server (no ``PREFECT_API_URL``)?"""
    return not os.environ.get("PREFECT_API_URL")


# ----------------------------------------------------------------------------------------- ports


def port_range() -> range:
    """The ports the temporary server may listen on: ``FP8RL_PREFECT_PORTS`` (``FIRST-LAST``) or 8000-8999."""
    text = os.environ.get(PORTS_ENV, "").strip()
    if not text:
        return DEFAULT_PORTS
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)|(\d+)", text)
    first, last = (int(m[1]), int(m[2])) if m and m[1] else (int(m[3]), int(m[3])) if m else (0, -1)
    if not (1 <= first <= last <= 65535):
        raise ServerUnavailable(f"{PORTS_ENV}={text!r}: give a port range FIRST-LAST within 1-65535, e.g. 8000-8999")
    return range(first, last + 1)


def port_free(port: int) -> bool:
    """Can a server bind ``port`` on 127.0.0.1 now?"""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(ports: range | None = None) -> int:
    """A free port of ``ports`` (default :func:`port_range`), tried in random order; every port is tried
    before :class:`ServerUnavailable` says that none is free."""
    ports = port_range() if ports is None else ports
    order = list(ports)
    random.shuffle(order)  # concurrent runs rarely race for one port
    for port in order:
        if port_free(port):
            return port
    raise ServerUnavailable(
        f"no free port for Prefect's temporary server on 127.0.0.1 in {ports.start}-{ports.stop - 1} "
        f"(all {len(ports)} taken); free one, set {PORTS_ENV}=FIRST-LAST to a free range, "
        "or set PREFECT_API_URL to a Prefect server of your own"
    )


# -------------------------------------------------------------------------------------- database


def database_path() -> tuple[Path | None, str]:
    """The temporary server's SQLite database (None: not SQLite, or in memory) and the setting that
    chose it."""
    for env in DATABASE_URL_ENVS:
        url = os.environ.get(env)
        if url:
            scheme, _, rest = url.partition(":///")
            if not scheme.startswith("sqlite") or not rest or rest.startswith(":memory:"):
                return None, env
            return Path(rest.split("?", 1)[0]).expanduser(), env
    home = os.environ.get("PREFECT_HOME") or str(Path.home() / ".prefect")
    return Path(home).expanduser() / "prefect.db", "PREFECT_HOME"


def database_revision(db: Path) -> str | None:
    """The schema revision ``db`` was last migrated to; None for no database, a database never
    migrated, or one that cannot be read now (the server then says why)."""
    if not db.is_file():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=5)) as con:
            row = con.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        return None
    return str(row[0]) if row else None


def known_revisions() -> set[str] | None:
    """The revision ids of the installed Prefect's SQLite migrations, read from its scripts without
    importing Prefect; None where they are not found (nothing to compare with)."""
    spec = importlib.util.find_spec("prefect")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "server/database/_migrations/versions/sqlite"
    revision = re.compile(r"""^revision\s*(?::[^=]*)?=\s*["'](\w+)["']""", re.M)
    found: set[str] = set()
    for script in folder.glob("*.py"):
        try:
            found.update(revision.findall(script.read_text(errors="replace")))
        except OSError:
            continue
    return found or None


def check_database() -> None:
    """:class:`ServerUnavailable` when the database was migrated by a Prefect this one does not know."""
    db, setting = database_path()
    if db is None:
        return
    revision = database_revision(db)
    known = known_revisions()
    if revision is None or known is None or revision in known:
        return
    from flows.orchestration.env import default_home, prefect_version

    fix = (
        f"unset {setting} (fp8rl then keeps a home per Prefect version, here {default_home()}) or point it "
        "at a folder of this Prefect's own"
        if setting == "PREFECT_HOME"
        else f"point {setting} at a database of this Prefect's own"
    )
    raise ServerUnavailable(
        f"the Prefect database {db} was migrated by another, newer Prefect (schema revision {revision}, "
        f"unknown to the installed Prefect {prefect_version()}), which cannot open it; {fix}"
    )


def check_startup_limit() -> None:
    """The start-up limit must be whole seconds: Prefect would refuse any other value with a traceback."""
    from flows.orchestration.env import STARTUP_LIMIT_ENV, STARTUP_LIMIT_S

    text = os.environ.get(STARTUP_LIMIT_ENV, "").strip()
    if not text.isdigit() or int(text) < 1:
        raise ServerUnavailable(
            f"{STARTUP_LIMIT_ENV}={text!r}: give the temporary server's start-up limit in whole seconds, "
            f"at least 1 (fp8rl's default is {STARTUP_LIMIT_S})"
        )


def check_temporary_server() -> None:
    """Before a run's directory exists: can the temporary server start? :class:`ServerUnavailable` if not.
    Nothing to check when the campaign reports to a configured server (``PREFECT_API_URL``)."""
    from flows.orchestration.env import configure_prefect_env

    configure_prefect_env()  # the home and settings the server will have (Prefect reads them at import)
    if not uses_temporary_server():
        return
    check_startup_limit()
    check_database()
    free_port()
