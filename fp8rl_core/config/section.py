"""The base of every configuration section: frozen, unknown keys refused, finite numbers only."""

from __future__ import annotations

from typing import Iterable

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


def known_name(name: str, kind: str, valid: Iterable[str], *, key: str | None = None) -> str:
    """``name`` when ``valid`` lists it, else ``ValueError``: ``unknown <kind> 'name'; valid: a, b``
    (prefixed ``<key>: `` where a model validator checks a field of its own)."""
    valid = tuple(valid)
    if name not in valid:
        where = f"{key}: " if key else ""
        raise ValueError(f"{where}unknown {kind} {name!r}; valid: {', '.join(valid)}")
    return name
