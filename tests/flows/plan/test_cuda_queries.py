"""The code that asks torch about CUDA devices, run on the CPU against a stand-in for ``torch.cuda``.

The stand-in keeps the rules the real module enforces: device indices below the device
count, ``mem_get_info`` of an existing device (free <= total), one RNG state per device of
the generator's own size (16 bytes: seed and offset of Philox), ``empty_cache`` counting its
calls. What each check exercises is the project's side: refusing a device the machine lacks in
one line, reading the memory of the device asked for, picking the local rank's device,
carrying every device's RNG state through a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[3]

GIB = 2**30


class FakeCuda:
    """``torch.cuda``'s queries for ``count`` devices of ``total`` bytes with ``used`` in use each."""

    def __init__(
        self, count: int = 2, total: int = 80 * GIB, used: int = 3 * GIB, capability: tuple[int, int] = (9, 0)
    ) -> None:
        self.count, self.total, self.used, self.capability = count, total, used, capability
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
            "get_device_name",
            "get_device_capability",
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

    def get_device_name(self, device=None) -> str:
        self._index(device)
        return "NVIDIA H200 (stand-in)"

    def get_device_capability(self, device=None) -> tuple[int, int]:
        self._index(device)
        return self.capability

    def empty_cache(self) -> None:
        self.emptied += 1

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.rng]

    def set_rng_state_all(self, states) -> None:
        states = list(states)
        if len(states) != self.count or any(s.dtype != torch.uint8 or s.numel() != 16 for s in states):
            raise RuntimeError("set_rng_state_all: one 16-byte uint8 state per device")
        self.rng = [s.clone() for s in states]


def _child_standin(monkeypatch, count: int, total_gib: int) -> None:
    """The probe's child process answers from ``tests/cuda_site`` as a machine with these devices."""
    import os

    site = str(Path(__file__).resolve().parents[2] / "cuda_site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([site, str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FP8RL_TEST_CUDA_STANDIN", f"{count},{total_gib}")


def test_a_cuda_device_the_machine_lacks_is_one_line_and_the_memory_read_is_the_device_asked_for(monkeypatch):
    import typer

    from flows.commands.run import _check_device
    from flows.plan.fit import available_bytes

    FakeCuda(count=2, total=80 * GIB).install(monkeypatch)
    _child_standin(monkeypatch, 2, 80)
    _check_device("cuda:1")
    with pytest.raises(typer.Exit) as err:
        _check_device("cuda:2")
    assert err.value.exit_code == 2
    assert available_bytes("cuda:1") == (80 * GIB, "cuda:1 (NVIDIA H200 (stand-in))")
    assert available_bytes("cuda") == (80 * GIB, "cuda:0 (NVIDIA H200 (stand-in))")
    assert available_bytes("cuda:2") is None  # the child cannot tell: no check rather than a wrong one
    FakeCuda(count=0).install(monkeypatch)
    with pytest.raises(typer.Exit):
        _check_device("cuda")
    assert available_bytes("cuda:0") is None
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

    from storage.checkpoints.store import capture_rng_state, restore_rng_state

    cuda = FakeCuda(count=2).install(monkeypatch)
    state = json.loads(json.dumps(capture_rng_state()))  # as a checkpoint stores it
    saved = cuda.get_rng_state_all()
    cuda.rng = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]
    restore_rng_state(state)
    assert all(torch.equal(a, b) for a, b in zip(cuda.rng, saved))
    FakeCuda(count=0).install(monkeypatch)  # resumed on a machine without CUDA: the CPU states only
    restore_rng_state(state)


def test_the_gpu_check_entry_names_the_device_then_runs_every_section_under_the_budget(monkeypatch):
    from gpu_check import main as gpu_check

    FakeCuda(count=1).install(monkeypatch)
    lines, ran = [], []
    monkeypatch.setattr(gpu_check, "emit", lines.append)
    monkeypatch.setattr(gpu_check, "add_paths", lambda: ["/wheels/torchao-0.18.0-cp39-abi3.whl"])
    monkeypatch.setattr(gpu_check, "run_all", lambda start, total, budgets: ran.append((total, dict(budgets))))
    assert gpu_check.main([]) == 0
    assert ran == [(gpu_check.TOTAL_BUDGET_S, gpu_check.SECTION_BUDGETS_S)]
    assert lines[0].startswith("gpu-check: NVIDIA H200 (stand-in), CUDA capability (9, 0), torch ")
    assert "torchao 0.18" in lines[0] and "wheels: ['torchao-0.18.0-cp39-abi3.whl']" in lines[0]


@pytest.mark.parametrize("capability, skipped", [((9, 0), []), ((8, 9), ["fp8_blockwise"]), ((8, 0), None)])
def test_the_train_step_section_runs_the_modes_this_gpus_kernels_allow(monkeypatch, capability, skipped):
    from gpu_check import sections, train_step

    FakeCuda(count=1, capability=capability).install(monkeypatch)
    seen = {}

    def run_modes(emit, device, batch, *, deadline, missing):
        seen.update(device=device, deadline=deadline, why={m: missing(need) for m, need in train_step.MODES})

    monkeypatch.setattr(train_step, "run_modes", run_modes)
    monkeypatch.setattr(train_step, "_batch", lambda device: ("batch on", device))
    lines = []
    monkeypatch.setattr(sections, "emit", lines.append)
    sections.section_train_step(deadline=123.0)
    assert lines[:2] == [
        "[4] sharded trainer step (gpu_check/train_step.py)",
        f"train_step: NVIDIA H200 (stand-in) SM{capability[0]}{capability[1]}, torch {torch.__version__}",
    ]
    assert seen["device"] == torch.device("cuda", 0) and seen["deadline"] == 123.0
    cannot = [m for m, why in seen["why"].items() if why]
    assert cannot == (skipped if skipped is not None else [m for m, _ in train_step.MODES])
    assert all("for the real kernel" in seen["why"][m] for m in cannot)


def test_the_nccl_sync_without_a_rendezvous_is_refused_when_the_engine_is_made():
    from stages.engines.vllm_options import check_engine_options

    with pytest.raises(ValueError, match=r"nccl_master=\(address, port\)"):
        check_engine_options(
            logprobs_mode="processed", sleep_level=0, weight_sync="nccl", verify_sync="first", in_process=False,
            nccl_master=None,
        )  # fmt: skip


class RecordingCuda(FakeCuda):
    """:class:`FakeCuda` that records every call that would create a CUDA context in this process (a memory
    query, a device's name or properties, the lazy initialization, choosing a device); the device count and
    ``is_available`` do not create one."""

    CONTEXT_CALLS = ("mem_get_info", "get_device_name", "get_device_capability", "empty_cache", "get_rng_state_all")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.contexts: list[str] = []

    def install(self, monkeypatch) -> RecordingCuda:
        super().install(monkeypatch)
        for name in self.CONTEXT_CALLS:
            monkeypatch.setattr(torch.cuda, name, self._recording(name, getattr(torch.cuda, name)))
        for name in ("init", "_lazy_init", "set_device", "get_device_properties", "synchronize"):
            monkeypatch.setattr(torch.cuda, name, self._recording(name, lambda *a, **k: None))
        return self

    def _recording(self, name, fn):
        def call(*args, **kwargs):
            self.contexts.append(name)
            return fn(*args, **kwargs)

        return call


@pytest.mark.timeout(120)
def test_the_launcher_reads_the_gpus_memory_without_a_cuda_context_of_its_own(monkeypatch):
    """``fp8rl run``'s memory check asks a child process; the launcher, which then waits on torchrun for the
    whole campaign, makes no call that creates a CUDA context (it would hold 0.3-0.6 GB of rank 0's GPU)."""
    import typer
    from conftest import micro_config

    from flows.commands.run import check_memory_fit

    cuda = RecordingCuda(count=1, total=80 * GIB).install(monkeypatch)
    _child_standin(monkeypatch, 1, 80)
    big = micro_config("device=cuda", "model.hidden_size=16384", "model.intermediate_size=65536", "model.num_layers=12")
    with pytest.raises(typer.Exit) as err:
        check_memory_fit(big, 1)
    assert err.value.exit_code == 2
    check_memory_fit(micro_config("device=cuda"), 1)  # the tiny model fits
    assert cuda.contexts == []
