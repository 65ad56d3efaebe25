"""A CPU stand-in for vLLM's NCCL data plane (``PyNcclCommunicator``), keeping its protocol and rules.

vLLM's NCCL weight transfer (``vllm/distributed/weight_transfer/nccl_engine.py``,
``nccl_common.py``, ``packed_tensor.py``) rendezvouses the trainer (rank 0) and the
inference workers (ranks 1..N) on a ``StatelessProcessGroup`` TCPStore, then builds a
``PyNcclCommunicator`` over it and broadcasts from rank 0. Only that communicator and a
few CUDA calls around it need a GPU. With ``FP8RL_TEST_NCCL_STANDIN=1``
(``tests/vllm_site/sitecustomize.py`` calls :func:`install` in every process of a
``vllm serve`` or engine core the tests start; a trainer process calls it itself):

* ``PyNcclCommunicator``, as ``nccl_common`` looks it up, becomes :class:`GlooCommunicator`
  for a ``StatelessProcessGroup``: the same broadcast over gloo, on a gloo group built on
  the same TCPStore (``PrefixStore``). Every other group keeps vLLM's class.
* In ``nccl_common``, ``nccl_engine`` and ``packed_tensor`` only, the CUDA-only calls on
  that path answer as one device would: ``torch.accelerator.current_device_index()`` is
  0, ``torch.cuda.current_stream()`` / ``torch.cuda.Stream(...)`` are a stream whose
  ``synchronize`` returns, ``torch.cuda.stream(s)`` enters nothing.

NCCL's own rules are enforced, every rank seeing the same verdict (each broadcast first
all-gathers a small header of every rank's view): the tensor contiguous (NCCL reads
``numel`` elements from ``data_ptr()``) and on the communicator's device, the same dtype
and element count on every rank, ``src`` the same everywhere and in range; a destroyed
communicator refuses to broadcast. With ``FP8RL_TEST_NCCL_WIRE=FILE`` each broadcast
appends one JSON line (pid, rank, src, dtype, numel, bytes) there, so a test can read
what crossed the wire.

Everything else, the trainer engine, the worker engine, the packed producer and
consumer, the rendezvous itself, is vLLM's own code.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.abc
import json
import os
import sys
from typing import Any

ENV = "FP8RL_TEST_NCCL_STANDIN"
WIRE_ENV = "FP8RL_TEST_NCCL_WIRE"
TIMEOUT_S = float(os.environ.get("FP8RL_TEST_NCCL_TIMEOUT_S", "300"))


def _torch():
    import torch

    return torch


class GlooCommunicator:
    """``PyNcclCommunicator``'s interface (rank, world_size, device, broadcast, destroy) over gloo.

    For any group other than vLLM's ``StatelessProcessGroup`` the real class is built instead."""

    real: Any = None  # vLLM's PyNcclCommunicator, set by install()

    def __new__(cls, group: Any, device: Any = None, library_path: str | None = None):
        from vllm.distributed.utils import StatelessProcessGroup

        if not isinstance(group, StatelessProcessGroup):
            return cls.real(group, device, library_path)
        return super().__new__(cls)

    def __init__(self, group: Any, device: Any = None, library_path: str | None = None) -> None:
        torch = _torch()
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self.group, self.rank, self.world_size = group, group.rank, group.world_size
        self.device = torch.device("cpu")
        self.disabled = self.world_size == 1  # as vLLM's: a group of one has nothing to send
        self.available = not self.disabled
        self.destroyed = False
        self.pg = None
        if not self.disabled:
            store = PrefixStore("fp8rl-nccl-standin", group.store)
            self.pg = ProcessGroupGloo(store, self.rank, self.world_size, datetime.timedelta(seconds=TIMEOUT_S))

    DTYPES = ("float32", "bfloat16", "float16", "uint8", "int8", "int32", "int64", "float64", "float8_e4m3fn")

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        torch = _torch()
        if self.destroyed:
            raise RuntimeError("NCCL stand-in: broadcast on a destroyed communicator")
        if self.disabled:
            return
        name = str(tensor.dtype).removeprefix("torch.")
        code = self.DTYPES.index(name) if name in self.DTYPES else -1
        mine = torch.tensor(
            [code, tensor.numel(), int(src), int(tensor.is_contiguous()), int(tensor.device == self.device)],
            dtype=torch.int64,
        )
        views = [torch.zeros_like(mine) for _ in range(self.world_size)]
        self.pg.allgather([views], [mine]).wait()
        problem = self._problem([v.tolist() for v in views])
        if problem:
            raise RuntimeError(f"NCCL stand-in (rank {self.rank}): {problem}")
        self.pg.broadcast(tensor, int(src)).wait()
        self._record(tensor, int(src))

    def _problem(self, views: list[list[int]]) -> str | None:
        """NCCL's rules for one broadcast, judged on every rank's view (so all ranks fail alike)."""
        for rank, (code, numel, src, contiguous, on_device) in enumerate(views):
            if code < 0:
                return f"rank {rank} broadcasts a dtype NCCL has no type for"
            if not contiguous:
                return f"rank {rank}'s tensor is not contiguous (NCCL reads numel elements from data_ptr)"
            if not on_device:
                return f"rank {rank}'s tensor is not on the communicator's device"
            if not 0 <= src < self.world_size:
                return f"src {src} is out of range for {self.world_size} ranks"
        codes = {tuple(v[:3]) for v in views}
        if len(codes) > 1:
            seen = [(self.DTYPES[c], n, s) for c, n, s in sorted(codes)]
            return f"the ranks disagree on (dtype, numel, src) of one broadcast: {seen}"
        return None

    def _record(self, tensor: Any, src: int) -> None:
        path = os.environ.get(WIRE_ENV)
        if not path:
            return
        line = {
            "pid": os.getpid(), "rank": self.rank, "src": src, "dtype": str(tensor.dtype).removeprefix("torch."),
            "numel": tensor.numel(), "bytes": tensor.numel() * tensor.element_size(),
        }  # fmt: skip
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def destroy(self) -> None:
        self.destroyed, self.available, self.pg = True, False, None


class _Stream:
    """A stream on the one device: work on it is done when it is enqueued."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    cuda_stream = 0


class _Namespace:
    """``real``'s attributes, some answered otherwise."""

    def __init__(self, real: Any, **answers: Any) -> None:
        self._real = real
        self.__dict__.update(answers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def one_device_torch() -> _Namespace:
    """``torch`` as the transfer modules see it: the CUDA calls of their path answer as one device would."""
    torch = _torch()
    cuda = _Namespace(
        torch.cuda, current_stream=lambda *a, **k: _Stream(), Stream=_Stream,
        stream=lambda s=None: contextlib.nullcontext(),
    )  # fmt: skip
    accelerator = _Namespace(torch.accelerator, current_device_index=lambda: 0)
    return _Namespace(torch, cuda=cuda, accelerator=accelerator)


def _patch_pynccl(module: Any) -> None:
    if module.PyNcclCommunicator is not GlooCommunicator:
        GlooCommunicator.real = module.PyNcclCommunicator
        module.PyNcclCommunicator = GlooCommunicator


def _patch_torch(module: Any) -> None:
    module.torch = one_device_torch()


PATCHES = {
    "vllm.distributed.device_communicators.pynccl": _patch_pynccl,
    "vllm.distributed.weight_transfer.nccl_common": _patch_torch,
    "vllm.distributed.weight_transfer.nccl_engine": _patch_torch,
    "vllm.distributed.weight_transfer.packed_tensor": _patch_torch,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Any) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the transfer modules right after vLLM's own code has run (whoever imports them first)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, PATCHES[name])
                return spec
        return None


def install() -> None:
    """Put the stand-in in place for this process (modules imported already are patched now)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _Finder())


def wire_bytes(path: str | os.PathLike, *, pid: int | None = None, rank: int | None = None) -> dict[str, int]:
    """Bytes broadcast per dtype, from the wire file (only one process's, or one rank's, if asked)."""
    out: dict[str, int] = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if (pid is None or row["pid"] == pid) and (rank is None or row["rank"] == rank):
                out[row["dtype"]] = out.get(row["dtype"], 0) + row["bytes"]
    return out
