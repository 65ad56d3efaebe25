"""The stage ledger: which stage of which step started, finished or failed.

Resume trusts the ledger, not Prefect's cache. It is an append-only JSON-lines
file, ``RUN_DIR/ledger.jsonl``, one event per line::

    {"event": "start",  "run_id": ..., "step": 3, "stage": "train", "attempt": 0, "variant": "main",
     "at": "...", "host": ..., "pid": ...}
    {"event": "finish", ..., "outputs": ["tables/steps/run=r/step=3/part-....parquet"], "info": {...}}
    {"event": "fail",   ..., "error": "RuntimeError: ..."}
    {"event": "set_aside", "from_step": 3, "stages": ["train", "calibrate"], "variant": "main", "at": "..."}
    {"event": "config_change", "keys": ["calibration.max_delta (0.05 -> 0.1)"], "from_hash": ..., "to_hash": ...,
     "after_step": 2, "at": "..."}
    {"event": "job_attempt", "attempt": 1, "job_id": "4711", "backend": "slurm", "nodes": "n[1-2]",
     "state": "FAILED", "exit_reason": "...", "resumed_from_step": 2, "submitted_at": ..., "ended_at": ..., "at": ...}

Durability: each event is one ``write()`` on an ``O_APPEND`` descriptor
followed by ``fsync``, so it is on disk before the stage goes on. A crash can at
worst tear the *last* line; readers skip lines that do not parse. The next
append repairs it: the torn bytes go to ``ledger.quarantine.jsonl`` with a
record of the repair (when, at which offset, how many bytes), then the ledger
is truncated to its last whole record. (Versions before that started the next
record on a fresh line, leaving the torn one in the middle; ``fp8rl doctor``
recognizes such a line as a repaired torn record.)

Reading is incremental: a :class:`Ledger` keeps the offset of the last whole
line it folded and, on each query, reads only what was appended since, so a
query's cost per step does not grow with the ledger's length. A file that
shrank or was replaced is read again from the start.

Folding (:mod:`storage.ledger.records`): events of one (step, stage, attempt,
variant) fold into a record whose status is 'running', 'done' or 'failed';
``set_aside`` events hide earlier records from a point on (``resume --from``);
they stay in the file as history.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa

from storage.ledger.records import (
    DONE,
    LedgerFold,
    StageRecord,
    fold_line,
    parse_event,
    set_aside_hides,
)
from storage.run.layout import RunLayout, read_run_info
from storage.tables.schemas import LEDGER
from storage.tables.spec import MAIN_VARIANT, STAGE_NAME, VARIANT_NAME, check_name

QUARANTINE_FILE = "ledger.quarantine.jsonl"


@dataclass
class StageRun:
    """Handle yielded by :meth:`Ledger.stage`: add the outputs and info to record."""

    outputs: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _last_line_start(fd: int, size: int) -> int:
    """Offset just after the last newline in the first ``size`` bytes of ``fd`` (0 if none)."""
    end = size
    while end > 0:
        start = max(0, end - (1 << 16))
        i = os.pread(fd, end - start, start).rfind(b"\n")
        if i >= 0:
            return start + i + 1
        end = start
    return 0


class Ledger:
    """Append and query the stage ledger of one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.layout = RunLayout(Path(run_dir))
        self.run_id = read_run_info(self.layout.root).run_id
        self.path = self.layout.ledger
        self.quarantine = self.layout.root / QUARANTINE_FILE
        self._fold = LedgerFold()
        self.bytes_read = 0  # ledger bytes read by queries so far (reading is incremental)

    # -- writing -------------------------------------------------------------------------

    def _append(self, event: dict[str, Any]) -> None:
        line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # appenders in turn: a line being written is never taken for a torn one
            size = os.fstat(fd).st_size
            if size and os.pread(fd, 1, size - 1) != b"\n":
                self._repair_torn_tail(fd, size)
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _repair_torn_tail(self, fd: int, size: int) -> None:
        """Move a torn last line to the quarantine file (with a record of the repair), then truncate
        the ledger to its last whole record."""
        start = _last_line_start(fd, size)
        torn = os.pread(fd, size - start, start)
        rec = {
            "repair": "torn_tail",
            "at": _now().isoformat(),
            "ledger": self.path.name,
            "offset": start,
            "length": len(torn),
            "bytes": torn.decode("utf-8", "backslashreplace"),
            "why": "a crash while appending tore the last record; the ledger was truncated to its last whole one",
        }
        qfd = os.open(self.quarantine, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(qfd, (json.dumps(rec) + "\n").encode())
            os.fsync(qfd)
        finally:
            os.close(qfd)
        os.ftruncate(fd, start)
        os.fsync(fd)

    def repairs(self) -> list[dict]:
        """The torn-tail repairs recorded in the quarantine file (a torn last record of its own ignored)."""
        try:
            raw = self.quarantine.read_bytes()
        except FileNotFoundError:
            return []
        out = []
        for line in raw.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def _event(self, kind: str, step: int, stage: str, attempt: int, variant: str, **extra: Any) -> None:
        check_name("stage", stage, STAGE_NAME)
        check_name("variant", variant, VARIANT_NAME)
        if int(step) < 0 or int(attempt) < 0:
            raise ValueError(f"step and attempt must be >= 0, got step={step}, attempt={attempt}")
        self._append(
            {
                "event": kind,
                "run_id": self.run_id,
                "step": int(step),
                "stage": stage,
                "attempt": int(attempt),
                "variant": variant,
                "at": _now().isoformat(),
                **extra,
            }
        )

    def start(
        self, step: int, stage: str, *, attempt: int = 0, variant: str = MAIN_VARIANT, info: dict | None = None
    ) -> None:
        """Mark running. ``info``: what the stage decided before doing it (a crash keeps it for recovery)."""
        extra = {"info": info} if info else {}
        self._event("start", step, stage, attempt, variant, host=socket.gethostname(), pid=os.getpid(), **extra)

    def finish(
        self,
        step: int,
        stage: str,
        *,
        attempt: int = 0,
        variant: str = MAIN_VARIANT,
        outputs: Iterable[str | Path] = (),
        info: dict | None = None,
    ) -> None:
        """Mark done. ``outputs``: files written (absolute or relative to the run dir)."""
        rel = [self.layout.relative(p) if Path(p).is_absolute() else Path(p).as_posix() for p in outputs]
        self._event("finish", step, stage, attempt, variant, outputs=rel, info=info or {})

    def fail(
        self, step: int, stage: str, *, attempt: int = 0, variant: str = MAIN_VARIANT, error: str | BaseException = ""
    ) -> None:
        if isinstance(error, BaseException):
            error = f"{type(error).__name__}: {error}"
        self._event("fail", step, stage, attempt, variant, error=str(error).splitlines()[0] if error else "")

    @contextmanager
    def stage(
        self, step: int, stage: str, *, attempt: int = 0, variant: str = MAIN_VARIANT, info: dict | None = None
    ) -> Iterator[StageRun]:
        """``with ledger.stage(3, "train") as run: ...; run.outputs.append(path)``.

        Records start (with ``info``, if given), then finish (with the outputs
        and ``run.info``, which starts as ``info``) or fail (and re-raises).
        """
        self.start(step, stage, attempt=attempt, variant=variant, info=info)
        run = StageRun(info=dict(info or {}))
        try:
            yield run
        except BaseException as err:
            self.fail(step, stage, attempt=attempt, variant=variant, error=err)
            raise
        self.finish(step, stage, attempt=attempt, variant=variant, outputs=run.outputs, info=run.info)

    def set_aside(
        self, *, from_step: int, stages: Iterable[str] | None = None, variant: str | None = MAIN_VARIANT
    ) -> int:
        """Hide records of steps > ``from_step``, and of ``from_step`` for ``stages`` (all if None).

        For ``resume --from STAGE --step N``: pass N and the stages from STAGE
        on. ``variant=None`` affects every variant. Returns how many records were hidden.
        """
        stages = None if stages is None else sorted(set(stages))
        hidden = [r for r in self.records(variant=variant) if set_aside_hides(r, from_step, stages)]
        self._append(
            {
                "event": "set_aside",
                "run_id": self.run_id,
                "from_step": int(from_step),
                "stages": stages,
                "variant": variant,
                "at": _now().isoformat(),
            }
        )
        return len(hidden)

    def config_change(self, change: dict) -> None:
        """Record a config edit accepted at resume (``run.json`` holds it too); stage records are unchanged."""
        self._append({"event": "config_change", "run_id": self.run_id, **change, "at": _now().isoformat()})

    def job_attempt(self, attempt: dict) -> None:
        """Record one cluster job of the run once it has ended (``fp8rl submit``'s supervisor; ``run.json``
        holds it too); stage records are unchanged."""
        self._append({"event": "job_attempt", "run_id": self.run_id, **attempt, "at": _now().isoformat()})

    # -- reading -------------------------------------------------------------------------

    def damage(self) -> list[tuple[int, str, str]]:
        """The ledger's one reading of its bad lines: ``(line, severity, what)``, severity "error" or "warning".

        ``fp8rl doctor``, ``fp8rl query`` and ``fp8rl resume`` all take their verdict
        from here. A torn last record (a crash while appending; the next append moves
        it to the quarantine file) and a torn record an older version left in the
        middle are warnings: nothing was recorded there. Any other line that does not
        parse is an error: a record was damaged after it was written, and what the
        stage it belonged to did cannot be read back.
        """
        fold = self._refresh()
        out = []
        for seq in fold.bad:
            if seq in fold.damaged:
                out.append((seq, "error", "unparseable record (damaged after it was written)"))
            else:
                what = "torn record of a crash, repaired (the next record starts a fresh line); ignored"
                out.append((seq, "warning", what))
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return out
        if size > fold.offset:  # a last line without its newline: torn by a crash while appending
            out.append((fold.lines + 1, "warning", "torn last record (crash while appending); ignored"))
        return out

    def config_changes(self) -> list[dict]:
        """The config edits accepted at resume, oldest first (``config_change`` events)."""
        return list(self._refresh().config_changes)

    def job_attempts(self) -> list[dict]:
        """The run's cluster jobs, in the order they ended (``job_attempt`` events)."""
        return list(self._refresh().job_attempts)

    def events(self) -> tuple[list[dict], list[int]]:
        """All parseable events in order, and the line numbers (1-based) that did not parse.

        Reads the whole file (for ``fp8rl doctor``); queries fold incrementally instead."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return [], []
        events, bad = [], []
        for i, line in enumerate(raw.split(b"\n"), start=1):
            if not line.strip():
                continue
            ev = parse_event(line)
            if ev is None:
                bad.append(i)
                continue
            ev["_seq"] = i
            events.append(ev)
        return events, bad

    def _refresh(self) -> LedgerFold:
        """Fold the whole lines appended since the last call (all of them if the file shrank or changed)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            self._fold = LedgerFold()
            return self._fold
        try:
            st = os.fstat(fd)
            fold = self._fold
            if fold.mark:  # the line just before the offset: a file rewritten in place is folded afresh
                self.bytes_read += len(fold.mark)
                if os.pread(fd, len(fold.mark), fold.offset - len(fold.mark)) != fold.mark:
                    fold = LedgerFold()
            if st.st_ino != fold.inode or st.st_size < fold.offset:
                fold = LedgerFold(inode=st.st_ino)
            self._fold = fold
            if st.st_size > fold.offset:
                data = os.pread(fd, st.st_size - fold.offset, fold.offset)
                self.bytes_read += len(data)
                whole = data.rfind(b"\n") + 1  # a torn or in-flight last line waits for its newline
                for line in data[:whole].split(b"\n")[:-1]:
                    fold.lines += 1
                    if line.strip():
                        fold_line(fold, line, fold.lines, self.run_id)
                fold.offset += whole
                if whole:  # (data starts on a line: the offset is always just after a newline)
                    fold.mark = data[data.rfind(b"\n", 0, whole - 1) + 1 : whole]
        finally:
            os.close(fd)
        return fold

    def records(self, *, variant: str | None = MAIN_VARIANT, include_set_aside: bool = False) -> list[StageRecord]:
        """Folded records in the order they were last touched (``variant=None``: all)."""
        fold = self._refresh()
        out = list(fold.recs.values())
        if include_set_aside:
            out = sorted(out + fold.hidden, key=lambda r: r.seq)
        return out if variant is None else [r for r in out if r.variant == variant]

    def current(self, *, variant: str = MAIN_VARIANT) -> dict[tuple[int, str], StageRecord]:
        """(step, stage) -> the record of its most recently touched attempt."""
        fold = self._refresh()
        cur = [r for (v, _), stages in fold.current.items() if v == variant for r in stages.values()]
        return {(r.step, r.stage): r for r in sorted(cur, key=lambda r: r.seq)}

    def current_record(self, step: int, stage: str, *, variant: str = MAIN_VARIANT) -> StageRecord | None:
        """The record of the most recently touched attempt of (step, stage), or None."""
        return self._refresh().current.get((variant, int(step)), {}).get(stage)

    def status(self, step: int, stage: str, *, variant: str = MAIN_VARIANT) -> str | None:
        r = self.current_record(step, stage, variant=variant)
        return None if r is None else r.status

    def done_stages(self, step: int, *, variant: str = MAIN_VARIANT) -> set[str]:
        """Stages of ``step`` whose current attempt finished."""
        stages = self._refresh().current.get((variant, int(step)), {})
        return {s for s, r in stages.items() if r.status == DONE}

    def next_attempt(self, step: int, stage: str, *, variant: str = MAIN_VARIANT) -> int:
        """1 + the highest attempt recorded for (step, stage) (set-aside ones included), or 0."""
        return self._refresh().attempts.get((int(step), stage, variant), -1) + 1

    def last_finished(self, *, variant: str = MAIN_VARIANT) -> tuple[int, str] | None:
        """(step, stage) of the most recently finished stage of the highest step with one."""
        done = [r for r in self.current(variant=variant).values() if r.status == DONE]
        if not done:
            return None
        best = max(done, key=lambda r: (r.step, r.seq))
        return best.step, best.stage

    def last_complete_step(
        self,
        required: Iterable[str] | Callable[[int], Iterable[str]],
        *,
        first_step: int = 0,
        variant: str = MAIN_VARIANT,
    ) -> int | None:
        """Highest n such that every step first_step..n has all its required stages done.

        ``required`` is a set of stage names or a function step -> stage names
        (calibrate only every K steps, evaluate every E). None if step
        ``first_step`` itself is incomplete.
        """
        need = required if callable(required) else (lambda _s, _r=set(required): _r)
        done: dict[int, set[str]] = {}
        for (n, s), r in self.current(variant=variant).items():
            if r.status == DONE:
                done.setdefault(n, set()).add(s)
        last = None
        for n in range(first_step, max(done, default=first_step - 1) + 1):
            if not set(need(n)) <= done.get(n, set()):
                break
            last = n
        return last

    def to_arrow(self, *, variant: str | None = None) -> pa.Table:
        """Live records as a table with the ``ledger`` schema (for the catalog)."""
        rows = [
            {
                "run_id": r.run_id,
                "step": r.step,
                "variant": r.variant,
                "stage": r.stage,
                "attempt": r.attempt,
                "status": r.status,
                "started_at": r.started_at,
                "finished_at": r.finished_at,
                "seconds": r.seconds,
                "outputs": r.outputs,
                "error": r.error,
                "host": r.host,
                "pid": r.pid,
                "info": json.dumps(r.info, sort_keys=True, default=str) if r.info else None,
            }
            for r in self.records(variant=variant)
        ]
        return pa.Table.from_pylist(rows, schema=LEDGER.schema())
