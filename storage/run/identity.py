"""A run is the run it claims to be: its uid, and the config it was made with.

Two facts fixed when a run is created live in ``run.json``:

- ``uid``, 32 random hex digits. The run id is the folder's name, and two
  unrelated runs may share one (``A/base`` and ``B/base``); the uid is written
  into every Parquet part's footer, so a part copied from another run is told
  apart whatever the folders are called. Copying or moving the folder keeps it.
  Runs written before the uid existed still open; readers warn once
  (:func:`no_uid_warning`) since their parts cannot be told apart by it.
- ``config_hash`` and ``config``: the config the run was made with. A resume
  reads ``config.yaml``, so :func:`config_file_drift` compares that file with
  the record; a change taken on purpose (``resume --accept-config-change``) is
  appended to ``run.json``'s ``config_changes`` and becomes the new record.

This module reads only; it imports neither flows nor stages.
"""

from __future__ import annotations

import json
from typing import Any

from storage.run.layout import RunInfo, config_hash


def no_uid_warning(info: RunInfo) -> str:
    """The one line said about a run written before run uids (None-free: call only when ``info.uid`` is None)."""
    return (
        f"run {info.run_id!r} ({info.path}) was written before runs carried a uid: a part copied from another "
        "run of the same name cannot be told apart in it"
    )


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def changed_keys(before: dict, after: dict) -> list[str]:
    """Dotted keys whose values differ, each as ``key (old -> new)``, in the order of ``after``."""
    a, b = _flat(before), _flat(after)
    keys = list(b) + [k for k in a if k not in b]
    return [f"{k} ({json.dumps(a.get(k))} -> {json.dumps(b.get(k))})" for k in keys if a.get(k) != b.get(k)]


def config_file_drift(info: RunInfo, text: str, values: dict | None = None) -> list[str] | None:
    """None if ``config.yaml``'s ``text`` is the config the run records, else what changed.

    ``values``: the file's settings as the loader resolved them (defaults filled in);
    without them the file's own mapping is compared. The changes are ``key (old -> new)``
    items when the run recorded its config, else one item naming the two hashes.
    """
    want = info.current_config_hash
    if want is None or config_hash(text) == want:
        return None
    if values is None:
        import yaml

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError:
            values = None
    recorded = info.current_config
    if recorded is not None and isinstance(values, dict):
        keys = changed_keys(recorded, values)
        return keys or None
    return [f"config hash {config_hash(text)[:12]}… (the run records {want[:12]}…)"]
