"""``python gpu_check/main.py --cpu``: every GPU-check section's code on the CPU, and the check's time bounds.

The rehearsal runs each section in a process of its own with emulated FP8 kernels at tiny shapes
(``gpu_check/cpu_mode.py``); torchao's blockwise Triton autotuning is bounded and cached
(``gpu_check/autotune_bound.py``), checked here against torchao's real kernel module where Triton
imports (it does without a GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), FP8RL_MAX_THREADS="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


@pytest.mark.slow
@pytest.mark.timeout(700)
def test_the_cpu_rehearsal_runs_every_section_end_to_end():
    """Every section runs to its end in its own process: the three FP8 recipes train a step through
    torchao's emulated modules (blockwise: the project's emulation), the SQNR and rollout sections print
    their figures, and section 5 runs vLLM's CPU build or says why it skipped. The report says these are
    not GPU figures."""
    proc = subprocess.run(
        [sys.executable, "gpu_check/main.py", "--cpu"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=680
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    lines = out.splitlines()
    assert lines[0].startswith("gpu-check --cpu:") and "no figure below is a GPU measurement" in lines[0]
    assert lines[-1].startswith("gpu-check --cpu: total") and lines[-1].endswith("not GPU figures")
    for n in "12345":
        assert any(ln.startswith(f"[{n}] ") and "(budget " in ln for ln in lines), n
    tiny = next(ln for ln in lines if ln.startswith("    tiny "))
    assert "FAILED" not in tiny and all(f"{r} " in tiny for r in ("bf16", "tensorwise", "rowwise", "blockwise"))
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        sqnr = next(ln for ln in lines if ln.startswith(f"    {recipe} "))
        assert "real vs emulation" in sqnr and "FAILED" not in sqnr
        backend = "fp8rl-emulated" if recipe == "blockwise" else "torchao"
        assert any(ln.startswith(f"train_step fp8_{recipe}: backend {backend}, ") and " loss " in ln for ln in lines)
        assert any(ln.startswith(f"train_step fp8_{recipe}: emulation vs kernel |dlogp|") for ln in lines)
    assert "real kernel vs emulation, same scheme" in out
    # the one failure the CPU allows: torchao's FP8 inference asks for a CUDA SM89+ device
    failed = [ln for ln in lines if "FAILED" in ln]
    assert len(failed) <= 1 and all(
        ln.startswith("    torchao FP8 inference: FAILED") and "CUDA" in ln for ln in failed
    )
    assert "[5] vLLM cycle: SKIP (import vllm failed: " in out or (" -> PASS" in out and "    sync margin: gap " in out)
    # each section prints its phases with their times: a slow machine reads apart from a wrong one
    for phase in ("import", "fp8_tensorwise build and convert", "fp8_tensorwise step", "bf16 forward"):
        assert any(ln.startswith(f"    phase {phase}") and ln.endswith(" s") for ln in lines), phase


@pytest.mark.timeout(120)
def test_a_real_section_that_overruns_is_stopped_and_the_rehearsal_returns_within_its_budget(capsys):
    """Sections given less time than their imports take: each is stopped inside its work (or killed a
    few seconds after its deadline), the run says so, exits 1, and returns within its total + 10 s."""
    from gpu_check.main import rehearse
    from gpu_check.section_process import GRACE_S

    budgets = {"[1] train-step throughput": 1.5, "[4] trainer step": 1.5}
    total = 12.0
    t0 = time.monotonic()
    rc = rehearse(total_s=total, budgets=budgets)
    took = time.monotonic() - t0
    out = capsys.readouterr().out
    assert rc == 1 and took <= total + 10.0, (rc, took)
    for name in budgets:
        stopped = f"    {name}: stopped at its deadline" in out
        killed = f"    {name}: killed {GRACE_S:.0f} s after its deadline" in out
        assert stopped or killed, out
    assert "train_step fp8_tensorwise: backend" not in out  # nothing ran past the deadline


def _config(warps: int, stages: int, **kwargs):
    return SimpleNamespace(kwargs=kwargs, num_warps=warps, num_stages=stages)


class _Autotuner:  # the attributes of triton.runtime.autotuner.Autotuner that the bound uses
    def __init__(self, configs):
        self.configs, self.keys, self.cache, self.cache_results = list(configs), ["K"], {("old",): 0}, False


def test_the_bound_keeps_the_preferred_configs_and_turns_the_disk_cache_on():
    from gpu_check.autotune_bound import bound_autotuners

    gemm = _Autotuner(_config(w, 2, BLOCK_SIZE_M=b, BLOCK_SIZE_N=b) for b in (64, 128, 256) for w in (4, 8))
    quant = _Autotuner(_config(w, s, NUM_GROUPS=g) for g in (2, 16, 32, 64, 128) for w in (2, 4, 8) for s in (2, 4, 6))
    module = SimpleNamespace(gemm=gemm, quant=quant, not_a_kernel=[1, 2], EPS=1e-12)
    assert bound_autotuners(module, 2) == {"gemm": (6, 2), "quant": (45, 2)}
    assert [(c.kwargs["BLOCK_SIZE_M"], c.num_warps) for c in gemm.configs] == [(128, 4), (128, 8)]
    assert [(c.kwargs["NUM_GROUPS"], c.num_stages, c.num_warps) for c in quant.configs] == [(64, 2, 4), (64, 2, 2)]
    assert gemm.cache_results and quant.cache_results and not gemm.cache and not quant.cache
    assert bound_autotuners(module, 1) == {"gemm": (2, 1), "quant": (2, 1)}  # one config: Triton benchmarks nothing
    with pytest.raises(ValueError, match="at least 1"):
        bound_autotuners(module, 0)


_REAL_BOUND = r"""
import os, sys
from gpu_check.autotune_bound import bound_blockwise_autotune, KERNELS_MODULE
line = bound_blockwise_autotune(cache_dir=sys.argv[1])
import importlib
from triton.runtime.autotuner import Autotuner
k = importlib.import_module(KERNELS_MODULE)
tuners = {n: v for n, v in vars(k).items() if isinstance(v, Autotuner)}
print("LINE", line)
sizes = [len(v.configs) for v in tuners.values()]
print("TUNERS", len(tuners), max(sizes), all(v.cache_results for v in tuners.values()))
print("DIR", os.environ["TRITON_CACHE_DIR"])
"""


def _python_with_triton() -> str | None:
    from tests.real_vllm import vllm_python

    for python in (sys.executable, str(vllm_python())):
        if (
            Path(python).exists()
            and subprocess.run([python, "-c", "import triton"], capture_output=True).returncode == 0
        ):
            return python
    return None


@pytest.mark.timeout(240)
def test_the_bound_applies_to_torchaos_real_blockwise_kernels(tmp_path):
    """torchao 0.18's seven autotuned blockwise kernels (Triton imports without a GPU), each cut to <= 2
    configurations with the disk cache on; not run on a GPU here."""
    python = _python_with_triton()
    if python is None:
        pytest.skip("no interpreter here imports triton (the CPU torch has none; the vLLM venv brings it)")
    env = {k: v for k, v in ENV.items() if k != "TRITON_CACHE_DIR"}
    out = subprocess.run(
        [python, "-c", _REAL_BOUND, str(tmp_path / "cache")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TUNERS 7 2 True" in out.stdout and f"DIR {tmp_path / 'cache'}" in out.stdout
    assert "LINE autotune: 7 torchao blockwise kernels bounded to <= 2 configs (" in out.stdout


def test_without_triton_the_bound_says_why_in_one_line(monkeypatch):
    from gpu_check import autotune_bound

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, autotune_bound.KERNELS_MODULE, raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/nonexistent")
    line = autotune_bound.bound_blockwise_autotune()
    assert line.startswith(f"autotune: not bounded ({autotune_bound.KERNELS_MODULE} does not import: ")


_GPU_MACHINE = r"""
import sys

class Block:  # the GPU machine has torch, transformers and pyarrow: no pydantic, Prefect, DuckDB or vLLM
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("pydantic", "pydantic_core", "prefect", "duckdb", "vllm"):
            raise ImportError("the GPU machine has no " + name)

sys.meta_path.insert(0, Block())
from gpu_check import autotune_bound, cpu_mode, main, section_process
sys.exit(main.main(["--section", "[5] vLLM cycle", "--seconds", "30"]))
"""


@pytest.mark.timeout(120)
def test_the_gpu_path_imports_nothing_the_gpu_machine_lacks():
    """``make gpu-check``'s modules, the new ones included, import without pydantic, Prefect, DuckDB or
    vLLM, and a section's own process runs (section 5 says it skipped and why)."""
    out = subprocess.run(
        [sys.executable, "-c", _GPU_MACHINE], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=110
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("[5] vLLM cycle: SKIP (import vllm failed: ImportError: the GPU machine has no vllm")
