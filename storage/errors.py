"""Errors raised by ``storage``: one line each, naming the path and what to do.

They all derive from :class:`StorageError` (a ``ValueError``), so the CLI can
catch one type and print ``error: <message>`` without a traceback. Driver
errors that are not the user's fault (an I/O error on a disk) are not wrapped.
"""

from __future__ import annotations


class StorageError(ValueError):
    """Base class: a storage problem whose message is one actionable line."""


class NotARunDirectory(StorageError):
    """A path that is neither a run directory (with ``run.json``) nor a folder of them."""


class UnknownRun(StorageError):
    """A run id that no run directory under the root carries."""


class SchemaError(StorageError):
    """Rows that do not fit a table's schema (missing required column, bad type, bad name)."""


class SchemaVersionError(StorageError):
    """Data written with a schema version this code cannot read."""


class CheckpointError(StorageError):
    """A checkpoint that is missing, incomplete or does not match its manifest."""


class DuplicateRun(StorageError):
    """Two run directories under one root carry the same run id (e.g. a ``cp -a`` backup)."""


class RunLocked(StorageError):
    """Another live process is writing this run directory."""


class CorruptFile(StorageError):
    """A Parquet file that cannot be read; the message names it."""


def os_error_line(err: OSError, path: str | None = None) -> str:
    """One line for an I/O failure: the path and the cause (``no space left on device``, ...).

    The path is the error's own filename when it has one, else ``path``.
    """
    import errno as _errno

    where = err.filename if getattr(err, "filename", None) else path
    cause = {
        _errno.ENOSPC: "no space left on device",
        _errno.EROFS: "read-only file system",
        _errno.ENOTDIR: "a path component is a file, not a directory",
        _errno.EEXIST: "exists and is not a directory",
        _errno.EACCES: "permission denied",
        _errno.EPERM: "operation not permitted",
        _errno.EDQUOT: "disk quota exceeded",
    }.get(err.errno) or (err.strerror or str(err)).lower()
    return f"{where}: {cause}" if where else cause
