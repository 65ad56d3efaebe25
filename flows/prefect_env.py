"""Prefect's environment for fp8rl, set before Prefect is imported.

Without ``PREFECT_API_URL`` a flow runs on Prefect's temporary local server; we
keep its state under the user's cache (``~/.cache/fp8rl/prefect``) rather than
``~/.prefect``, turn analytics off, and quiet the temporary server's own logger
(at shutdown it otherwise prints tracebacks of cancelled background flushes,
which are harmless). With ``PREFECT_API_URL`` set, everything reports to that
server and only the analytics default is touched. Explicit user settings win.

The temporary server is a subprocess that inherits this environment. Its
database pool (SQLAlchemy) logs a traceback at ERROR when a connection reset is
cancelled at shutdown on a busy machine; that logger propagates to the root
console handler, and Prefect's ``PREFECT_LOGGING_*`` overrides reach only the
loggers its ``logging.yml`` names. So, unless the user gave a logging file of
their own, we point ``PREFECT_LOGGING_SETTINGS_PATH`` at Prefect's own file with
one addition: the ``sqlalchemy`` logger at CRITICAL.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# loggers quieted in every process that reads Prefect's logging config (the temporary
# server subprocess included): name -> level
QUIET_LOGGERS = {"sqlalchemy": "CRITICAL", "aiosqlite": "CRITICAL"}


def configure_prefect_env(*, quiet: bool = True) -> None:
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
        # the temporary server's 20 s start-up limit is too short on a busy machine
        os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fp8rl" / "prefect"
        os.environ.setdefault("PREFECT_HOME", str(cache))
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
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fp8rl"
    target = cache / "prefect-logging.yml"
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
