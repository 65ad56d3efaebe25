"""The code that asks torch about CUDA devices, run on the CPU against a stand-in for ``torch.cuda``.

The stand-in keeps the rules the real module enforces: device indices below the device
count, ``mem_get_info`` of an existing device (free <= total), one RNG state per device of
the generator's own size (16 bytes: seed and offset of Philox), ``empty_cache`` counting its
calls. What each check exercises is the project's side: refusing a device the machine lacks in
one line, reading the memory of the device asked for, picking the local rank's device,
carrying every device's RNG state through a checkpoint.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(60)

GIB = 2**30


class FakeCuda:
    """``torch.cuda``'s queries for ``count`` devices of ``total`` bytes with ``used`` in use each."""

    def __init__(self, count: int = 2, total: int = 80 * GIB, used: int = 3 * GIB) -> None:
        self.count, self.total, self.used = count, total, used
        self.current = 0
        self.emptied = 0
        self.rng = [torch.tensor(list(range(i, i + 16)), dtype=torch.uint8) for i in range(count)]

    def install(self, monkeypatch) -> FakeCuda:
        for name in (
            "is_available",
            "device_count",
            "current_device",
            "mem_get_info",
            "empty_cache",
            "get_rng_state_all",
            "set_rng_state_all",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self

    def _index(self, device) -> int:
        if isinstance(device, int):
            index = device
        else:
            index = self.current if device is None else torch.device(device).index
            index = self.current if index is None else index
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (have {self.count})")
        return int(index)

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self._index(device)
        return self.total - self.used, self.total

    def empty_cache(self) -> None:
        self.emptied += 1

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.rng]

    def set_rng_state_all(self, states) -> None:
        states = list(states)
        if len(states) != self.count or any(s.dtype != torch.uint8 or s.numel() != 16 for s in states):
            raise RuntimeError("set_rng_state_all: one 16-byte uint8 state per device")
        self.rng = [s.clone() for s in states]


def test_a_cuda_device_the_machine_lacks_is_one_line_and_the_memory_read_is_the_device_asked_for(monkeypatch):
    import typer

    from flows.cli_campaign import _available_bytes, _check_device

    FakeCuda(count=2, total=80 * GIB).install(monkeypatch)
    _check_device("cuda:1")
    with pytest.raises(typer.Exit) as err:
        _check_device("cuda:2")
    assert err.value.exit_code == 2
    assert _available_bytes("cuda:1") == (80 * GIB, "cuda:1") and _available_bytes("cuda") == (80 * GIB, "cuda:0")
    FakeCuda(count=0).install(monkeypatch)
    with pytest.raises(typer.Exit):
        _check_device("cuda")
    assert _available_bytes("cuda:0") is None
    _check_device("cpu")


def test_auto_takes_the_local_ranks_device_and_an_explicit_one_is_checked(monkeypatch):
    from stages.context import resolve_device

    FakeCuda(count=4).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "6")  # 8 ranks on two nodes of 4 GPUs: the local index wraps
    assert resolve_device("auto") == torch.device("cuda", 2)
    assert resolve_device("cuda:3") == torch.device("cuda", 3)
    FakeCuda(count=0).install(monkeypatch)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")


def test_the_engine_reads_device_memory_and_gives_the_trainers_cache_back(monkeypatch):
    from stages.engines.vllm_engine import gpu_memory_used_gib, release_trainer_cache

    cuda = FakeCuda(count=1, total=141 * GIB, used=7 * GIB).install(monkeypatch)
    assert gpu_memory_used_gib() == pytest.approx(7.0)
    release_trainer_cache()
    assert cuda.emptied == 1
    FakeCuda(count=0).install(monkeypatch)
    assert gpu_memory_used_gib() is None


def test_every_devices_rng_state_goes_through_a_checkpoint(monkeypatch):
    import json

    from storage.checkpoints import capture_rng_state, restore_rng_state

    cuda = FakeCuda(count=2).install(monkeypatch)
    state = json.loads(json.dumps(capture_rng_state()))  # as a checkpoint stores it
    saved = cuda.get_rng_state_all()
    cuda.rng = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]
    restore_rng_state(state)
    assert all(torch.equal(a, b) for a, b in zip(cuda.rng, saved))
    FakeCuda(count=0).install(monkeypatch)  # resumed on a machine without CUDA: the CPU states only
    restore_rng_state(state)
