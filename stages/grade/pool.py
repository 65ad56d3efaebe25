"""Batch grading: verifiers run in a process pool with a wall-clock limit per item.

Why processes, and why not ``concurrent.futures``: math-verify bounds its own
work with ``signal.alarm``, which only works in a process's main thread, and
sympy can still hang in C code where no signal is delivered. A hanging item must
score 0, be logged with its id and never hold up the batch. A
``ProcessPoolExecutor`` can stop *waiting* for a future but cannot stop the worker
computing it, so the pool would slowly fill with stuck workers. Here each worker
is a ``multiprocessing`` process (``forkserver`` context where available, else
``spawn``: no inherited threads or torch state) with its own pipe; the parent
hands one item at a time to each idle worker, and when an item runs past
``timeout_s`` it kills that worker, records the item as ``"timeout"`` and starts
a replacement.

The pool is created lazily on the first pooled call, reused by later calls (a
worker's start-up — importing sympy and math-verify — costs about a second), and
shut down at interpreter exit. Verifiers that are pure string checks
(``"synthetic"``) run inline in the caller: no pool, no pickling.

A verifier is named as in ``fp8rl_core.tasks.verifiers.VERIFIERS`` or, for one the
workers must import themselves, as ``"package.module:function"``.

Items are graded in any order; results come back in input order. Scripts that
call the pool at import time need the usual ``if __name__ == "__main__":`` guard
(``spawn``/``forkserver`` workers re-import the main module).
"""

from __future__ import annotations

import atexit
import importlib
import logging
import math
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection, wait
from typing import Callable, Sequence

from fp8rl_core.tasks.verifiers import extract_for, get_verifier, is_sandboxed, math_equal
from stages.grade.result import GradeResult, Status  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

INLINE_VERIFIERS = frozenset({"synthetic"})  # cheap and signal-free: graded in the caller


def resolve_verifier(name: str) -> Callable[[str, str], bool]:
    """A registered verifier name (``"math"``, ``"synthetic"``) or an importable
    ``"package.module:function"`` — the latter lets a caller plug in its own
    verifier, which the worker processes import by that path."""
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise KeyError(f"verifier {name!r} is not importable: {exc}") from None
    return get_verifier(name)


def _grade_one(
    verifier: str, response: str, gold: str, inner_timeout: int | None
) -> tuple[bool, str | None, Status, str]:
    extracted = extract_for(verifier, response)
    if extracted is None:
        return False, None, "no_answer", ""
    try:
        if verifier == "math":
            ok = math_equal(response, gold, timeout_s=inner_timeout)
        else:
            ok = bool(resolve_verifier(verifier)(response, gold))
    except Exception as exc:  # a verifier bug must not sink the batch; the item scores 0 and says why
        return False, extracted, "error", f"{type(exc).__name__}: {exc}"
    return ok, extracted, "ok", ""


def _worker_main(conn: Connection) -> None:
    """Worker loop: receive ``(index, verifier, response, gold, inner_timeout)``,
    send back ``(index, correct, extracted, status, detail)``; ``None`` stops."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        index, verifier, response, gold, inner_timeout = msg
        conn.send((index, *_grade_one(verifier, response, gold, inner_timeout)))


class _Worker:
    def __init__(self, ctx: mp.context.BaseContext) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="fp8rl-grader")
        self.proc.start()
        child.close()
        self.item: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=2)
        self.conn.close()


class GradingPool:
    """A fixed number of grading processes; see the module docstring."""

    def __init__(self, workers: int | None = None, start_method: str | None = None) -> None:
        self.n_workers = workers or max(1, min(4, os.cpu_count() or 1))
        methods = mp.get_all_start_methods()
        method = start_method or ("forkserver" if "forkserver" in methods else "spawn")
        self._ctx = mp.get_context(method)
        self._workers: list[_Worker] = []
        self.timeouts = 0  # items killed over the pool's lifetime

    def _ensure_workers(self) -> None:
        self._workers = [w for w in self._workers if w.proc.is_alive()]
        while len(self._workers) < self.n_workers:
            self._workers.append(_Worker(self._ctx))

    def grade(
        self,
        ids: Sequence[str],
        responses: Sequence[str],
        golds: Sequence[str],
        *,
        verifier: str = "math",
        timeout_s: float = 10.0,
    ) -> list[GradeResult]:
        """Grade items in the pool; each gets at most ``timeout_s`` wall-clock
        seconds of a worker (math-verify's own alarm is set just below it)."""
        n = len(ids)
        results: list[GradeResult | None] = [None] * n
        inner = max(1, math.floor(timeout_s))  # math-verify takes whole seconds
        pending = list(range(n - 1, -1, -1))  # pop() from the end = input order
        self._ensure_workers()
        busy: dict[int, _Worker] = {}  # fileno -> worker with an item in flight
        while pending or busy:
            for w in self._workers:
                if w.item is None and pending:
                    i = pending.pop()
                    w.item, w.started = i, time.monotonic()
                    w.conn.send((i, verifier, responses[i], golds[i], inner))
                    busy[w.conn.fileno()] = w
            now = time.monotonic()
            next_deadline = min(w.started + timeout_s for w in busy.values())
            ready = wait([w.conn for w in busy.values()], timeout=max(0.0, next_deadline - now))
            for conn in ready:
                w = busy.pop(conn.fileno())
                i = w.item
                try:
                    _, ok, extracted, status, detail = conn.recv()
                except (EOFError, OSError) as exc:  # the worker died under this item
                    ok, extracted, status, detail = False, None, "error", f"grader process died: {exc!r}"
                    w.kill()
                    self._replace(w)
                results[i] = GradeResult(ids[i], ok, extracted, status, time.monotonic() - w.started, detail)
                w.item = None
            now = time.monotonic()
            for fileno, w in list(busy.items()):
                if now - w.started >= timeout_s:
                    i = w.item
                    log.warning(
                        "grading item %s timed out after %.1fs: scored 0, grader restarted", ids[i], now - w.started
                    )
                    results[i] = GradeResult(
                        ids[i],
                        False,
                        extract_for(verifier, responses[i]),
                        "timeout",
                        now - w.started,
                        f"over {timeout_s}s",
                    )
                    self.timeouts += 1
                    del busy[fileno]
                    w.kill()
                    self._replace(w)
        return [r for r in results if r is not None]

    def _replace(self, dead: _Worker) -> None:
        self._workers = [w for w in self._workers if w is not dead]
        self._workers.append(_Worker(self._ctx))

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []


_POOL: GradingPool | None = None


def get_pool(workers: int | None = None) -> GradingPool:
    """The process-wide pool, created on first use and closed at exit."""
    global _POOL
    if _POOL is None:
        _POOL = GradingPool(workers)
        atexit.register(shutdown_pool)
    return _POOL


def shutdown_pool() -> None:
    """Stop the shared pool's workers (safe to call twice)."""
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None


def grade_batch(
    ids: Sequence[str],
    responses: Sequence[str],
    golds: Sequence[str],
    *,
    verifier: str = "math",
    timeout_s: float = 10.0,
    workers: int | None = None,
    code_config=None,
) -> list[GradeResult]:
    """Grade ``responses`` against ``golds`` with the named verifier.

    Inline for :data:`INLINE_VERIFIERS`, else in the shared :class:`GradingPool`
    with ``timeout_s`` per item. Results are in input order.
    """
    if not len(ids) == len(responses) == len(golds):
        raise ValueError(f"grade_batch: {len(ids)} ids, {len(responses)} responses, {len(golds)} golds")
    if is_sandboxed(verifier):  # model-written programs: run in the sandbox (stages.grade.code)
        from stages.grade.code import grade_code_responses

        return grade_code_responses(ids, responses, golds, verifier, code_config)
    resolve_verifier(verifier)  # unknown name -> KeyError listing the valid ones, before any work
    if verifier in INLINE_VERIFIERS:
        out = []
        for i, r, g in zip(ids, responses, golds):
            t0 = time.monotonic()
            ok, extracted, status, detail = _grade_one(verifier, r, g, None)
            out.append(GradeResult(i, ok, extracted, status, time.monotonic() - t0, detail))
        return out
    if not ids:
        return []
    return get_pool(workers).grade(ids, responses, golds, verifier=verifier, timeout_s=timeout_s)
