"""What a CPU run computes with, resolved once per run and recorded in ``run.json``.

``precision.cpu_bf16_gemm: auto`` is resolved here for the run's model
(``fp8rl_core.cpu_numerics.cpu_gemm.resolve_cpu_bf16_gemm``); the record beside it (CPU model, torch,
ATen's vector ISA, threads) is what decides whether two runs on two
machines can agree bit for bit (``fp8rl_core.host.cpu_env``, docs/cpu.md).
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.cpu_numerics.cpu_gemm import GemmChoice, resolve_cpu_bf16_gemm
from fp8rl_core.host.cpu_env import cpu_numerics_env

RUN_JSON_KEY = "cpu_numerics"


def gemm_choice(cfg: CampaignConfig, device: Any = "cpu") -> GemmChoice:
    """``precision.cpu_bf16_gemm`` resolved for this run (a ``model.path`` checkpoint counts as wide)."""
    hidden = None if cfg.model.path is not None else cfg.model.hidden_size
    return resolve_cpu_bf16_gemm(cfg.precision.cpu_bf16_gemm, hidden, device)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what ``platform`` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(choice: GemmChoice, threads: int | None = None) -> dict:
    """The record written to ``run.json`` under :data:`RUN_JSON_KEY` (``threads``: the run's
    intra-op threads; default: this process's current count)."""
    import torch

    from fp8rl_core.cpu_numerics import exact_kernels

    kernels = {}
    if choice.kind == "portable":  # the same bits either way; the compiled kernels are faster
        exact_kernels.ops()
        kernels = {"exact_gemm_kernels": exact_kernels.status()}
    return {
        "bf16_gemm": asdict(choice),
        **kernels,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": cpu_numerics_env(),
        "threads": torch.get_num_threads() if threads is None else threads,
    }


def summary_line(record: dict) -> str:
    """One console line: ``cpu numerics: bf16 gemm portable (auto: ...); ATen AVX2; 2 thread(s); <CPU>``."""
    g = record["bf16_gemm"]
    env = [f"{k}={v or 'unset'}" for k, v in record["env"].items() if k != "ATEN_CPU_CAPABILITY"]
    parts = [f"bf16 gemm {g['kind']} ({g['setting']}: {g['reason']})", f"ATen {record['aten_cpu_capability']}"]
    if "exact_gemm_kernels" in record:
        parts.insert(1, f"exact GEMM kernels {record['exact_gemm_kernels']}")
    return "cpu numerics: " + "; ".join([*parts, *env, f"{record['threads']} thread(s)", record["cpu"]])


def record_cpu_numerics(run_dir: str | Path, choice: GemmChoice) -> dict:
    """Write :func:`describe` into ``run_dir/run.json`` (atomically; every start of the run
    overwrites it, so a resume on another machine says so). Returns the record."""
    from storage.run.layout import RUN_FILE, write_text_atomic

    record = describe(choice)
    path = Path(run_dir) / RUN_FILE
    info = json.loads(path.read_text(encoding="utf-8"))
    info[RUN_JSON_KEY] = record
    write_text_atomic(path, json.dumps(info, indent=2) + "\n")
    return record
