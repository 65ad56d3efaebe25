"""How the ledger's events fold into records: one :class:`StageRecord` per (step, stage, attempt, variant).

Events of one (step, stage, attempt, variant) fold into a record whose status
is 'running' (start seen, no outcome: in progress or crashed), 'done' or
'failed'. The *current* record of a (step, stage, variant) is the one touched
last. ``set_aside`` events hide earlier records from a point on (``resume
--from``); ``config_change`` events are kept in order. A line that does not
parse is noted: a torn record of a crash (:func:`looks_torn`) or a damaged one.
:class:`storage.ledger.events.Ledger` reads the file and folds it incrementally with
:func:`fold_line`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from storage.tables.spec import MAIN_VARIANT

RUNNING, DONE, FAILED = "running", "done", "failed"


@dataclass
class StageRecord:
    """The folded state of one (step, stage, attempt, variant)."""

    run_id: str
    step: int
    stage: str
    attempt: int
    variant: str
    status: str = RUNNING
    started_at: datetime | None = None
    finished_at: datetime | None = None
    outputs: list[str] = field(default_factory=list)
    error: str | None = None
    info: dict = field(default_factory=dict)
    host: str | None = None
    pid: int | None = None
    seq: int = 0  # line number of the last event touching it

    @property
    def seconds(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


@dataclass
class LedgerFold:
    """What a :class:`storage.ledger.events.Ledger` has folded so far: the file up to ``offset`` (whole lines only)."""

    inode: int = -1
    offset: int = 0
    lines: int = 0
    recs: dict = field(default_factory=dict)  # live (step, stage, attempt, variant) -> record, touch order
    hidden: list = field(default_factory=list)  # records hidden by set_aside events
    current: dict = field(default_factory=dict)  # (variant, step) -> {stage: record touched last}
    attempts: dict = field(default_factory=dict)  # (step, stage, variant) -> highest attempt, set aside included
    bad: list = field(default_factory=list)  # line numbers that did not parse
    damaged: dict = field(default_factory=dict)  # line number -> bytes, of bad lines that are not torn records
    config_changes: list = field(default_factory=list)  # config edits accepted at resume (events, in order)
    job_attempts: list = field(default_factory=list)  # cluster jobs of the run, recorded as each ended (events)
    mark: bytes = b""  # the last line folded (its newline included)


def parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def fold_line(fold: LedgerFold, line: bytes, seq: int, run_id: str) -> None:
    """Fold one whole line (line number ``seq``) into ``fold``; a line that does not parse is noted as bad."""
    ev = parse_event(line)
    if ev is None:
        fold.bad.append(seq)
        if not looks_torn(line):
            fold.damaged[seq] = line[:80]
        return
    kind = ev["event"]
    if kind == "config_change":
        fold.config_changes.append(ev)
        return
    if kind == "job_attempt":
        fold.job_attempts.append(ev)
        return
    if kind == "set_aside":
        for key, r in list(fold.recs.items()):
            if (ev.get("variant") in (None, r.variant)) and set_aside_hides(r, ev["from_step"], ev.get("stages")):
                fold.hidden.append(fold.recs.pop(key))
                stages = fold.current.get((r.variant, r.step), {})
                if stages.get(r.stage) is r:
                    del stages[r.stage]
        return
    try:
        key = (int(ev["step"]), ev["stage"], int(ev["attempt"]), ev.get("variant", MAIN_VARIANT))
    except (KeyError, TypeError, ValueError):
        return
    r = fold.recs.pop(key, None)  # re-inserted last: the dict stays in touch order
    if r is None:
        r = StageRecord(ev.get("run_id", run_id), *key)
    fold.recs[key] = r
    fold.current.setdefault((key[3], key[0]), {})[key[1]] = r
    akey = (key[0], key[1], key[3])
    fold.attempts[akey] = max(fold.attempts.get(akey, -1), key[2])
    r.seq = seq
    fold_event(r, kind, ev)


def parse_event(line: bytes) -> dict | None:
    """The event of one ledger line, or None if it does not parse as one."""
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) and "event" in ev else None


def fold_event(r: StageRecord, kind: str, ev: dict) -> None:
    """Apply a start, finish or fail event to its record."""
    at = parse_time(ev.get("at"))
    if kind == "start":
        r.status, r.started_at, r.host, r.pid = RUNNING, at, ev.get("host"), ev.get("pid")
        r.finished_at, r.error = None, None
        r.info = dict(ev.get("info") or {})
    elif kind in ("finish", "fail"):
        r.status, r.finished_at = (DONE if kind == "finish" else FAILED), at
        r.outputs = list(ev.get("outputs") or [])
        r.error = ev.get("error")
        r.info = dict(ev.get("info") or {})


def looks_torn(line: bytes) -> bool:
    """A line that is the start of a ledger record cut short (a crash while appending), not garbage."""
    line = line.strip()
    return line.startswith(b'{"event":') and not line.endswith(b"}") and parse_event(line) is None


def set_aside_hides(r: StageRecord, from_step: int, stages: Iterable[str] | None) -> bool:
    """Whether a ``set_aside`` from ``from_step`` (for ``stages``; all if None) hides ``r``."""
    if r.step > from_step:
        return True
    return r.step == from_step and (stages is None or r.stage in set(stages))
