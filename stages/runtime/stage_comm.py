"""Stages every rank runs together (rollout, score): collectives that fail together, never hang.

Under ``torchrun`` each rank rolls out and grades its own share of a step, and
the ranks meet at collective points (gather the samples, share the DAPO refill
decision). A rank that raised on its own while the others wait in a collective
would hang the job, so a stage's local work runs inside one of two helpers:

* :func:`together` — every rank runs ``fn``; then the ranks exchange a status
  (``all_gather_object``) and, if any rank failed, *every* rank raises: the
  rank that failed its own error, the others :class:`PeerStageError` naming it;
* :func:`from_main` — rank 0 alone runs ``fn`` (the ledger's and per-step tables'
  writer) and broadcasts its value, or its failure, which every rank raises.

An error is *transient* (worth a retry) when :func:`is_transient` says so; a
:class:`PeerStageError` carries the failing rank's verdict, so rank 0 retries
a peer's I/O hiccup and gives up on a peer's bug, and all ranks follow
(``flows.campaign.flow`` broadcasts the outcome of each attempt). In one process
:data:`SINGLE_PROCESS_COMM` makes every collective the identity and errors propagate unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from storage.faults import InjectedTransientFault

T = TypeVar("T")


class TransientStageError(RuntimeError):
    """A failure worth retrying (I/O hiccup, engine restart, injected fault)."""


class PeerStageError(RuntimeError):
    """Another rank failed the stage this rank was running with it (so this rank stops too)."""

    def __init__(self, rank: int, error: str, transient: bool) -> None:
        super().__init__(f"rank {rank} failed: {error}")
        self.rank, self.error, self.transient = rank, error, transient

    def __reduce__(self):  # picklable with its fields (it may cross ranks itself)
        return PeerStageError, (self.rank, self.error, self.transient)


TRANSIENT = (TransientStageError, InjectedTransientFault, OSError, TimeoutError, ConnectionError)


def is_transient(err: BaseException) -> bool:
    """Whether a retry may succeed: I/O, timeouts, connections, or a peer's transient failure."""
    if isinstance(err, PeerStageError):
        return err.transient
    return isinstance(err, TRANSIENT)


class StageComm:
    """The collectives a stage needs; this base class is one process (identity)."""

    rank: int = 0
    world_size: int = 1

    def all_gather(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        return [obj]

    def gather(self, obj: Any) -> list | None:
        """Every rank's ``obj``, in rank order, on rank 0; ``None`` on the others."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others' argument is ignored)."""
        return obj


class DistStageComm(StageComm):
    """Object collectives over a ``torch.distributed`` process group (pickled; gloo or NCCL)."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self.dist, self.group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, obj: Any) -> list:
        out: list = [None] * self.world_size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list | None:
        out: list | None = [None] * self.world_size if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj if self.rank == 0 else None]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


SINGLE_PROCESS_COMM = StageComm()


def _status(err: BaseException) -> tuple[str, bool]:
    """What other ranks learn of a failure: a one-line description and whether it is transient."""
    return f"{type(err).__name__}: {err}".splitlines()[0], is_transient(err)


def _raise_first_failure(comm: StageComm, statuses: list, own: BaseException | None) -> None:
    """Raise on every rank if any rank failed (``statuses[r]`` is ``None`` or ``(error, transient)``)."""
    if own is not None:
        raise own
    for rank, status in enumerate(statuses):
        if status is not None:
            raise PeerStageError(rank, *status)


def together(comm: StageComm, fn: Callable[[], T]) -> T:
    """Run ``fn()`` on every rank; return this rank's value, or raise on every rank if any failed."""
    value, own = None, None
    try:
        value = fn()
    except Exception as err:  # shipped to the others before raising, never raised alone
        own = err
    statuses = comm.all_gather(None if own is None else _status(own))
    _raise_first_failure(comm, statuses, own)
    return value


def from_main(comm: StageComm, fn: Callable[[], T]) -> T:
    """Run ``fn()`` on rank 0 alone; every rank gets its value, or raises its failure."""
    value, own = None, None
    if comm.rank == 0:
        try:
            value = fn()
        except Exception as err:
            own = err
    status, value = comm.broadcast((None if own is None else _status(own), value))
    _raise_first_failure(comm, [status], own)
    return value


def broadcast(env, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank of ``env`` (identity in one process)."""
    return obj if env.world_size == 1 else env.stage_comm.broadcast(obj)
