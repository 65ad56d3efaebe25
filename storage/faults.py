"""Fault injection for crash and I/O tests: the one module through which tests reach into a run.

Every hook is inert unless the test suite arms it: ``FP8RL_TEST_HOOKS=1``
(``tests/conftest.py`` sets it for the session and the processes its tests
start). Without it the hooks below read nothing else, so a stray
``FP8RL_FAULT`` in a user's environment injects nothing.

    FP8RL_FAULT="<stage>@<step>[:<point>]=<kind>[,...]"    e.g. "train@2:mb1=kill"

Points: ``start`` (a stage's beginning, checked by the stage runner) or a
named point inside a stage (``mb<i>``: before mini-batch *i* of train;
``write:<table>``: a Parquet write of that table). Kinds:

- ``kill``: SIGKILL this process (a crash with no clean-up, as the OOM killer does);
- ``sigint``: SIGINT this process (a user's Ctrl-C; an error if SIGINT is ignored here,
  as in a shell's background job, where a Ctrl-C could not arrive either);
- ``transient``: raise :class:`InjectedTransientFault` (retried by the flow);
- ``enospc`` / ``erofs``: raise the ``OSError`` a full / read-only disk gives;
- ``wait``: write the marker (below, required) and wait until a line ``go`` is
  appended to it, or a signal ends the wait, at most two minutes: the test
  then acts from outside at a known point (sends SIGINT to the process group,
  SIGTERM to the command, fills the disk).

``FP8RL_FAULT_MARKER=<file>`` makes a fault fire once: the first firing
writes the marker, later ones see it and pass (so a retry succeeds).

``FP8RL_INJECT_LR="A:B=LR"`` (:func:`injected_lr`, :func:`lr_surge`): steps A..B
train at learning rate LR on their first train attempt, a finite surge for the
guard's tests (the train stage runs its update inside :func:`lr_surge`).

No state is kept in this module: the plan is parsed from the environment at
each point (nothing to parse when it is unset, the normal case), and the
stage and step being run are a :class:`contextvars.ContextVar` set by the
stage runner for the duration of the stage (:func:`stage_scope`), so points
deep inside a stage (a trainer's mini-batch loop) need not be passed the step.
"""

from __future__ import annotations

import contextvars
import errno
import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

ENV, MARKER_ENV, ARMED_ENV, LR_ENV = "FP8RL_FAULT", "FP8RL_FAULT_MARKER", "FP8RL_TEST_HOOKS", "FP8RL_INJECT_LR"
KINDS = ("kill", "sigint", "transient", "enospc", "erofs", "wait")

_SCOPE: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("fp8rl_fault_scope", default=None)


class InjectedTransientFault(RuntimeError):
    """A failure injected to exercise retries."""


@dataclass(frozen=True)
class Fault:
    stage: str
    step: int
    point: str
    kind: str


def parse(spec: str) -> tuple[Fault, ...]:
    """The faults of an ``FP8RL_FAULT`` value; ValueError names a malformed item."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, _, kind = item.partition("=")
        target, _, point = where.partition(":")
        stage, _, step = target.partition("@")
        if kind not in KINDS or not stage or not step.isdigit():
            raise ValueError(f"{ENV}: bad item {item!r}; expected <stage>@<step>[:<point>]=<{'|'.join(KINDS)}>")
        out.append(Fault(stage, int(step), point or "start", kind))
    return tuple(out)


def armed(env: Mapping[str, str] | None = None) -> bool:
    """Whether the test suite armed the hooks (``FP8RL_TEST_HOOKS=1``)."""
    return (os.environ if env is None else env).get(ARMED_ENV) == "1"


def _spec(env: Mapping[str, str], name: str) -> str | None:
    """A hook's setting, read only when the hooks are armed."""
    return env.get(name) if armed(env) else None


def _wait_for_go(marker: Path, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not marker.read_text().rstrip().endswith("go"):
        time.sleep(0.05)  # a signal's handler raises here


def _fire(fault: Fault, where: str, env: Mapping[str, str]) -> None:
    marker = env.get(MARKER_ENV)
    if fault.kind == "wait" and not marker:
        raise RuntimeError(f"{ENV}: {fault} needs {MARKER_ENV}, the file a test watches and appends 'go' to")
    if marker:
        if Path(marker).exists():
            return
        Path(marker).write_text(f"{fault}\n")
    if fault.kind == "wait":
        _wait_for_go(Path(marker))
        return
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "sigint":
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            raise RuntimeError(f"{ENV}: SIGINT is ignored in this process, so {fault} cannot stand for a Ctrl-C")
        os.kill(os.getpid(), signal.SIGINT)
        return
    if fault.kind == "transient":
        raise InjectedTransientFault(f"injected transient fault in {fault.stage} at step {fault.step} ({fault.point})")
    code = errno.ENOSPC if fault.kind == "enospc" else errno.EROFS
    raise OSError(code, os.strerror(code), where)


def at(
    stage: str,
    step: int,
    point: str = "start",
    *,
    path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """A fault point: fire the fault planned for (stage, step, point), if any."""
    env = os.environ if env is None else env
    spec = _spec(env, ENV)
    if not spec:
        return
    for f in parse(spec):
        if f.stage == stage and f.step == step and f.point == point:
            _fire(f, str(path or f"{stage}@{step}"), env)


def point(name: str, *, path: str | os.PathLike | None = None) -> None:
    """A fault point inside the stage now running (see :func:`stage_scope`); a no-op outside one."""
    if not _spec(os.environ, ENV):
        return
    scope = _SCOPE.get()
    if scope is not None:
        at(scope[0], scope[1], name, path=path)


@contextmanager
def stage_scope(stage: str, step: int) -> Iterator[None]:
    """Mark ``stage`` of ``step`` as running (for :func:`point`), and check its ``start`` point."""
    token = _SCOPE.set((stage, step))
    try:
        at(stage, step)
        yield
    finally:
        _SCOPE.reset(token)


def injected_lr(step: int, env: Mapping[str, str] | None = None) -> float | None:
    """The learning rate ``FP8RL_INJECT_LR="A:B=LR"`` sets for ``step`` (A <= step <= B), else None."""
    spec = _spec(os.environ if env is None else env, LR_ENV)
    if not spec:
        return None
    span, _, lr = spec.partition("=")
    a, _, b = span.partition(":")
    return float(lr) if int(a) <= step <= int(b or a) else None


@contextmanager
def lr_surge(optimizer, scheduler, step: int, attempt: int, env: Mapping[str, str] | None = None) -> Iterator[None]:
    """Inside the block, train at the learning rate :func:`injected_lr` sets for ``step``, on the
    step's first train attempt only (a replay after the guard's rollback runs clean); the
    schedule's own learning rates come back after it. Inert (a plain block) otherwise."""
    lr = injected_lr(step, env) if attempt == 0 else None
    if lr is None:
        yield
        return
    groups = optimizer.param_groups
    saved_base, saved_lr = list(scheduler.base_lrs), [g["lr"] for g in groups]
    scheduler.base_lrs = [lr for _ in saved_base]
    for g in groups:
        g["lr"] = lr
    try:
        yield
    finally:
        scheduler.base_lrs = saved_base
        for g, v in zip(groups, saved_lr):
            g["lr"] = v
