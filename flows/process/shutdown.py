"""The one shutdown path of a run: SIGINT or SIGTERM ends every process of it, in order, in one line.

A run is several processes: the ``fp8rl`` command; under ``--nproc-per-node N``
torchrun and its ranks; Prefect's temporary API server (the command's, or rank
0's); the grading pool's workers; the code sandbox's launchers. A Ctrl-C at a
terminal sends SIGINT to the whole foreground process group, ``timeout -s
TERM`` sends SIGTERM to the group, ``kill`` or a batch scheduler to one process.
Whatever received it, the run ends the same way:

1. Each process that runs campaign code (the command, each rank) takes SIGINT
   and SIGTERM through :func:`signals_end_the_run`. The first one raises
   :class:`Interrupted` (a ``KeyboardInterrupt``) in the main thread: the stage in
   flight unwinds, its ledger record stays unfinished, and ``fp8rl resume``
   redoes it. Later signals are noted, never raised into the clean-up.
2. Prefect's temporary server runs in a session of its own
   (:mod:`flows.orchestration.server`), so a terminal's SIGINT does not reach it: the
   flow records its end on a live server instead of retrying a dead one (before,
   127 lines of httpx tracebacks and 76 s).
3. torchrun runs in a session of its own too; the command forwards the signal to
   it, torchrun forwards it to each rank's process group (its own behaviour),
   and each rank ends as in 1, quietly (:mod:`flows.process.torchrun` keeps torchrun's
   own report of the signal off the console). A rank that fails makes torchrun
   stop the others with SIGTERM: the same path.
4. What is left below the process (pool workers, sandbox launchers; under the
   command, anything a rank left behind: the command is the run's child
   subreaper) is ended by :func:`end_descendants`, SIGTERM then SIGKILL. The
   temporary server stops last.
5. The command prints one line, ``interrupted (SIGINT); the run stays
   resumable: `fp8rl resume RUN```, and exits 128 + the signal's number (130
   for SIGINT, 143 for SIGTERM), without the interpreter's teardown (a
   campaign's heap takes seconds to collect; nothing is left to close).

A deadline bounds it all: :data:`DEADLINE_S` after the first signal a process
still unwinding (a stuck collective, a library's retry loop) is ended from a
timer thread the same way (steps 4 and 5), so the run is gone within ten
seconds of the signal.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEADLINE_S = 8.0  # from the first signal to a forced end (the run is gone within 10 s)
GRACE_S = 1.0  # between SIGTERM and SIGKILL for what is left below a process
_PR_SET_CHILD_SUBREAPER = 36


class Interrupted(KeyboardInterrupt):
    """A run's process received SIGINT or SIGTERM (``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class RunEnded(SystemExit):
    """A signal ended the run and everything below this process has been ended: the entry point
    says ``line`` (if any) and exits 128 + ``signum`` at once (:func:`exit_now`). ``code`` replaces that
    exit code where the run ended for a reason of its own (its Prefect server failed: 2, with or
    without a signal, ``signum`` None)."""

    def __init__(self, signum: int | None, line: str | None, code: int | None = None) -> None:
        super().__init__(code if code is not None else 128 + (signum or 0))
        self.signum, self.line = signum, line


def exit_now(end: RunEnded) -> None:
    """Print ``end``'s line and exit with its code, skipping the interpreter's teardown: a campaign's
    heap takes seconds to collect at exit, and every file and process of the run is already closed."""
    if end.line:
        sys.stderr.write(end.line + "\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(end.code)


def end_process(code: int) -> None:
    """Exit with ``code`` once the interpreter's own exit work is done (non-daemon threads joined,
    ``atexit`` handlers run, streams flushed), but without its teardown.

    During teardown any thread that takes the GIL back (a daemon thread between two torch ops, a
    process group's C++ thread dropping a tensor) is unwound out of C++ code and the process aborts
    (std::terminate, SIGABRT): a rank that had finished its campaign would be reported failed and
    torchrun would end its peers. Skipping teardown loses nothing: the run's files are closed."""
    import atexit

    threading._shutdown()  # what the interpreter does first at exit: wait for the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by ``signum``: 128 + its number."""
    return 128 + signum


def interrupted_line(signum: int, resume: str) -> str:
    """The one line the command prints when a signal ended the run."""
    return f"interrupted ({signal.Signals(signum).name}); the run stays resumable: `{resume}`"


class RunSignals:
    """The signals one process of a run received; see the module docstring.

    The kernel's delivery is also written to a pipe (``signal.set_wakeup_fd``) by
    the C-level handler, at once, before Python runs any handler and whichever
    handler is installed (Prefect's own SIGTERM bridge inside a flow): a rank
    whose collective fails because a peer just ended by the same signal can tell
    (:meth:`arrived`) that it is being ended, not failing."""

    def __init__(self, on_deadline: Callable[[int], None], deadline_s: float) -> None:
        self.signum: int | None = None
        self._on_deadline, self._deadline_s = on_deadline, deadline_s
        self._seen: int | None = None
        self.wakeup_r, self.wakeup_w = os.pipe()
        for fd in (self.wakeup_r, self.wakeup_w):
            os.set_blocking(fd, False)

    def arrived(self, within_s: float = 0.0) -> int | None:
        """SIGINT or SIGTERM delivered to this process (handled yet or not), waiting up to ``within_s``."""
        deadline = time.monotonic() + within_s
        while self.signum is None and self._seen is None:
            try:
                data = os.read(self.wakeup_r, 64)
            except BlockingIOError:
                data = b""
            self._seen = next((b for b in data if b in SIGNALS), None)
            left = deadline - time.monotonic()
            if self._seen is not None or left <= 0:
                break
            select.select([self.wakeup_r], [], [], left)
        return self.signum if self.signum is not None else self._seen

    def handle(self, signum: int, _frame) -> None:
        if self.signum is not None:
            return  # the first signal is unwinding the run; a second Ctrl-C must not break its clean-up
        self._take(signum)
        raise Interrupted(signum)

    def settle(self) -> int | None:
        """The signal ending this process (:meth:`arrived`), from now on taken as handled: its Python
        handler, if it has not run yet, will not raise into the clean-up; None when no signal came."""
        signum = self.arrived()
        if signum is not None and self.signum is None:
            self._take(signum)
        return self.signum

    def _take(self, signum: int) -> None:
        self.signum = signum
        self.end_within(self._deadline_s, signum)

    def end_within(self, seconds: float, signum: int) -> None:
        """Call ``on_deadline(signum)`` in ``seconds`` from a timer thread (ended with the process), whatever
        handles the signal meanwhile: a run that must end (its Prefect server died) arms it before it
        sends itself the signal, which Prefect's own SIGTERM bridge may take instead of :meth:`handle`."""
        timer = threading.Timer(seconds, self._on_deadline, args=(signum,))
        timer.daemon = True
        timer.start()


@contextmanager
def signals_end_the_run(on_deadline: Callable[[int], None], deadline_s: float = DEADLINE_S) -> Iterator[RunSignals]:
    """SIGINT and SIGTERM raise :class:`Interrupted` once inside the block (main thread only).

    ``on_deadline(signum)`` runs on a timer thread ``deadline_s`` after the first
    signal if the process is still alive: it must end the process (see :func:`force_end`)."""
    state = RunSignals(on_deadline, deadline_s)
    try:
        if threading.current_thread() is not threading.main_thread():
            yield state
            return
        old = {s: signal.signal(s, state.handle) for s in SIGNALS}
        old_fd = signal.set_wakeup_fd(state.wakeup_w, warn_on_full_buffer=False)
        try:
            yield state
        finally:
            signal.set_wakeup_fd(old_fd)
            for s, handler in old.items():
                signal.signal(s, handler if state.signum is None else signal.SIG_IGN)
    finally:
        os.close(state.wakeup_r)
        os.close(state.wakeup_w)


def received(within_s: float = 0.0) -> int | None:
    """The signal that is ending this process (inside :func:`signals_end_the_run`), else None; waits up
    to ``within_s`` for one (see :meth:`RunSignals.arrived`)."""
    state = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
    return state.arrived(within_s) if isinstance(state, RunSignals) else None


def force_end(signum: int, line: str | None, keep: Iterable[int] = (), code: int | None = None) -> None:
    """End this process now: what is below it first (``keep`` last), then one line, exit 128 + ``signum``
    (or ``code``)."""
    keep = set(keep)
    end_descendants(os.getpid(), skip=keep)
    end_pids(keep)
    exit_now(RunEnded(signum, line, code))


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux), so that a process a rank
    left behind is still below the command when it ends what is left."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (``/proc``; empty where there is none)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents before children."""
    out, todo = [], children(pid)
    while todo:
        p = todo.pop(0)
        if p not in out:
            out.append(p)
            todo += children(p)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def end_pids(pids: Iterable[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM ``pids``, SIGKILL those alive ``grace_s`` later; reap the ones that are this process's children."""
    pids = [p for p in pids if _alive(p)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for p in pids:
                _reap(p)
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            time.sleep(0.02)


def end_descendants(pid: int | None = None, skip: Iterable[int] = (), grace_s: float = GRACE_S) -> list[int]:
    """End every process below ``pid`` (default: this one) except ``skip`` and their own descendants."""
    pid = os.getpid() if pid is None else pid
    spared = set(skip)
    for s in list(spared):
        spared.update(descendants(s))
    targets = [p for p in descendants(pid) if p not in spared]
    end_pids(targets, grace_s)
    return targets
