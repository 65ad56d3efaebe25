"""Named SQL queries shipped with fp8rl (``fp8rl query ROOT --named NAME``).

Each ``*.sql`` file here is one query over the catalog's views. Its header —
the leading ``--`` comment lines — documents it::

    -- name: entropy-bins
    -- description: one line shown by `fp8rl query --list`
    -- param: bin_width = 0.25 : width of an entropy bin (nats)
    --
    -- Free text: what the columns mean, how to read the result.

Parameters are DuckDB variables: the query reads ``getvariable('bin_width')``;
the runner sets each declared default, overridden by ``--param bin_width=0.5``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.errors import StorageError

QUERY_DIR = Path(__file__).resolve().parent
_PARAM = re.compile(r"^(?P<name>[A-Za-z_]\w*)\s*=\s*(?P<default>[^:]*?)\s*(?::\s*(?P<doc>.*))?$")


@dataclass(frozen=True)
class NamedQuery:
    """A shipped query: its name, one-line description, parameters (name -> (default, doc)), SQL."""

    name: str
    description: str
    sql: str
    path: Path
    params: dict[str, tuple[Any, str]] = field(default_factory=dict)
    notes: str = ""


def parse_value(text: str) -> Any:
    """'10' -> 10, '0.5' -> 0.5, 'true' -> True, quoted or other text -> str."""
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def _parse(path: Path) -> NamedQuery:
    text = path.read_text(encoding="utf-8")
    header, fields, notes, params = [], {}, [], {}
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        header.append(line[2:].strip())
    for line in header:
        key, sep, value = line.partition(":")
        if sep and key in ("name", "description"):
            fields[key] = value.strip()
        elif sep and key == "param":
            m = _PARAM.match(value.strip())
            if m is None:
                raise StorageError(f"{path}: bad param line {line!r}; expected 'param: name = default : doc'")
            params[m["name"]] = (parse_value(m["default"]), m["doc"] or "")
        else:
            notes.append(line)
    name = fields.get("name", path.stem)
    if name != path.stem:
        raise StorageError(f"{path}: header name {name!r} differs from the file name")
    return NamedQuery(name, fields.get("description", ""), text, path, params, "\n".join(notes).strip())


def list_queries() -> list[NamedQuery]:
    """Every shipped query, by name."""
    return [_parse(p) for p in sorted(QUERY_DIR.glob("*.sql"))]


def get_query(name: str) -> NamedQuery:
    """The shipped query ``name``; an unknown name lists the known ones."""
    path = QUERY_DIR / f"{name}.sql"
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name) or not path.is_file():
        known = ", ".join(q.name for q in list_queries())
        raise StorageError(f"unknown named query {name!r}; known: {known} (see `fp8rl query --list`)")
    return _parse(path)
