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
