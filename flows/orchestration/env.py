"""Prefect's environment for fp8rl, set before Prefect is imported.

Without ``PREFECT_API_URL`` a flow runs on Prefect's temporary local server; we
keep its state under the user's cache, one home per installed Prefect version
(``~/.cache/fp8rl/prefect/<version>``, :func:`default_home`) rather than
``~/.prefect``, turn analytics off, and quiet the temporary server's own logger
(at shutdown it otherwise prints tracebacks of cancelled background flushes,
which are harmless; the server itself writes its errors to its log file,
:mod:`flows.orchestration.server`). With ``PREFECT_API_URL`` set, everything reports
to that server and only the analytics default is touched. Explicit user
settings win.

Why a home per version: the server migrates its database to its own Prefect's
newest schema when it starts, and an older Prefect cannot open a database a
newer one migrated (its server fails at start-up, and Prefect's client waits
out the whole start-up limit). The main venv and the GPU package set
(``.venv-vllm``) hold different Prefect releases, so one shared home broke the
older one after the newer had run once. A home the user chooses
(``PREFECT_HOME``) is checked before the server starts instead
(:mod:`flows.orchestration.preflight`).

The temporary server is a subprocess that inherits this environment. Its
database pool (SQLAlchemy) logs a traceback at ERROR when a connection reset is
cancelled at shutdown on a busy machine; that logger propagates to the root
console handler, and Prefect's ``PREFECT_LOGGING_*`` overrides reach only the
loggers its ``logging.yml`` names. So, unless the user gave a logging file of
their own, we point ``PREFECT_LOGGING_SETTINGS_PATH`` at Prefect's own file with
one addition: the ``sqlalchemy`` logger at CRITICAL.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

# loggers quieted in every process that reads Prefect's logging config (the temporary
# server subprocess included): name -> level
QUIET_LOGGERS = {"sqlalchemy": "CRITICAL", "aiosqlite": "CRITICAL"}


# the temporary server's start-up limit (Prefect's setting; its own default, 20 s, is too short on a busy machine)
STARTUP_LIMIT_ENV, STARTUP_LIMIT_S = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", 120


def fp8rl_cache() -> Path:
    """``$XDG_CACHE_HOME/fp8rl`` (default ``~/.cache/fp8rl``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fp8rl"


def prefect_version() -> str | None:
    """The installed Prefect's version, read from its package metadata (Prefect is not imported)."""
    try:
        return importlib.metadata.version("prefect")
    except importlib.metadata.PackageNotFoundError:
        return None


def default_home() -> Path:
    """fp8rl's Prefect home: ``~/.cache/fp8rl/prefect/<Prefect version>``, one per version (module doc)."""
    home = fp8rl_cache() / "prefect"
    version = prefect_version()
    return home / version if version else home


def configure_prefect_env(*, quiet: bool = True) -> None:
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
        os.environ.setdefault(STARTUP_LIMIT_ENV, str(STARTUP_LIMIT_S))
        os.environ.setdefault("PREFECT_HOME", str(default_home()))
    if os.environ.get("PREFECT_HOME"):
        # Prefect creates its home without parents=True, then times out on its server
        Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
    _quiet_server_loggers()
    if quiet:
        # our own progress lines are the console display; Prefect's per-task INFO
        # lines still reach the server's run logs.
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def _prefect_default_logging_file() -> Path | None:
    spec = importlib.util.find_spec("prefect")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "logging" / "logging.yml"
    return path if path.exists() else None


def _quiet_server_loggers() -> None:
    """Point Prefect at its own logging config plus :data:`QUIET_LOGGERS` (see the module doc)."""
    if os.environ.get("PREFECT_LOGGING_SETTINGS_PATH"):
        return  # the user's own file wins
    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect")).expanduser()
    if (home / "logging.yml").exists():
        return  # Prefect's default location of a user file: it wins too
    default = _prefect_default_logging_file()
    if default is None:
        return
    import yaml  # a Prefect dependency

    config = yaml.safe_load(default.read_text())  # "${SETTING}" templates stay strings
    loggers = config.setdefault("loggers", {})
    for name, level in QUIET_LOGGERS.items():
        loggers.setdefault(name, {})["level"] = level
    text = yaml.safe_dump(config, sort_keys=False)
    cache = fp8rl_cache()
    target = cache / f"prefect-logging-{prefect_version()}.yml"  # each Prefect its own file, as its own home
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_text() != text:
            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, target)  # atomic: concurrent runs read a whole file
    except OSError:
        return  # a read-only cache: keep Prefect's default config
    os.environ["PREFECT_LOGGING_SETTINGS_PATH"] = str(target)


def quiet_third_party() -> None:
    """Silence progress bars and import-time warnings of libraries a run uses.

    transformers prints a progress bar for every ``save_pretrained`` /
    ``from_pretrained`` (each checkpoint, each engine refresh), and torchao warns
    once about Triton on CPU machines; neither is actionable for a user.
    """
    import logging

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("torchao", "torchao.kernel.intmm", "torch._dynamo"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


def quiet_console_failures() -> None:
    """Keep Prefect's failure tracebacks off the console of a CLI run (they still reach the server).

    A failed task logs its traceback at ERROR on every console handler, tens of
    lines; the ``fp8rl`` command prints the one line that says what happened
    (path and cause) instead. Call after Prefect is imported.
    """
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]
    for lg in loggers:
        for h in getattr(lg, "handlers", []):
            if isinstance(h, PrefectConsoleHandler):
                h.setLevel(logging.CRITICAL)
