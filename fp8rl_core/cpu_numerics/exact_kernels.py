"""Compiled kernels for the exact GEMM's grid and output: the same bits as the tensor-by-tensor path, in one pass.

``exact_gemm.cpp`` holds two operators, ``torch.ops.fp8rl_exact.grid`` (an operand's BF16 value, the
largest magnitude of each row or column, the scale, the grid integers as float64) and
``torch.ops.fp8rl_exact.finish`` (the float64 sums rounded to float32, divided by the two scales, optionally
rounded on to BF16). Each does what :mod:`fp8rl_core.cpu_numerics.portable_math` does with a dozen ATen
calls, with the same IEEE operations on the same operands, so its outputs are the same bits by
construction (``tests/fp8rl_core/cpu_numerics/test_exact_kernels.py`` checks them against the tensor path, edge
values included).

They are built once per machine with the C++ compiler PyTorch's extensions use (``g++``), into
``$XDG_CACHE_HOME/fp8rl/kernels`` (``~/.cache/fp8rl/kernels``); ``make`` builds them when it sets up the
venv, and the first portable GEMM of a process loads them (building them first if they are missing;
processes that start together wait for one build). A build happens in a staging folder and the
library is published under its final name by an atomic rename, so a process never loads a library
another one is still writing. Where they cannot be built (no compiler, not
x86-64 with AVX2) or ``FP8RL_EXACT_KERNELS=0`` is set, the tensor path runs instead: the same numbers,
slower. Compiled with AVX2 (the portable numerics' floor: ATen runs its AVX2 kernels) and without FMA
contraction or fast-math, so every operation is the one written.

    python -m fp8rl_core.cpu_numerics.exact_kernels     # build (or find) them and say where
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "exact_gemm.cpp"
CFLAGS = ("-O3", "-mavx2", "-mno-fma", "-ffp-contract=off", "-fno-fast-math", "-std=c++17")
ENV_SWITCH = "FP8RL_EXACT_KERNELS"  # "0": the tensor path only

log = logging.getLogger(__name__)
_LOCK = threading.Lock()
_STATE: dict[str, object] = {"ops": None, "tried": False, "why": "not loaded yet"}


def _cpu_has_avx2() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and torch.cpu._is_avx2_supported()


def build_dir() -> Path:
    """Where the kernels are built: one folder per source, flags and torch install."""
    torch_id = f"{torch.__version__} {Path(torch.__file__).resolve().parent}".encode()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + torch_id).hexdigest()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fp8rl" / "kernels" / f"exact_gemm-{key[:12]}"


LIBRARY = "fp8rl_exact_gemm.so"
STAGING = "staging"  # the build's own folder inside build_dir(): ninja's files and the library as it is linked


def _load():
    where = build_dir()
    built = where / LIBRARY
    if built.is_file():  # the folder's name is the source's, flags' and torch's hash: this very build
        torch.ops.load_library(str(built))
        return torch.ops.fp8rl_exact
    from torch.utils.cpp_extension import load  # (a quarter of a second to import: only to build)

    staging = where / STAGING
    staging.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + path  # the venv's ninja, not activated
    try:  # torch's lock on the staging folder makes processes that start together wait for one build
        load(name="fp8rl_exact_gemm", sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
             build_directory=str(staging), is_python_module=False, verbose=False)
    finally:
        os.environ["PATH"] = path
    _publish(staging / LIBRARY, built)
    return torch.ops.fp8rl_exact


def _publish(library: Path, final: Path) -> None:
    """Copy the linked ``library`` to ``final`` under a name of this process's, then rename it into place:
    another process finds either no library at ``final`` or a whole one."""
    part = final.with_name(f".{final.name}.{os.getpid()}.part")
    shutil.copyfile(library, part)
    os.replace(part, final)


def ops():
    """``torch.ops.fp8rl_exact`` once built and loaded in this process; None where the tensor path runs
    (:func:`status` says why). Built or loaded on the first call."""
    if _STATE["tried"]:
        return _STATE["ops"]
    with _LOCK:
        if _STATE["tried"]:
            return _STATE["ops"]
        if os.environ.get(ENV_SWITCH, "1") == "0":
            _STATE["why"] = f"{ENV_SWITCH}=0: the tensor path"
        elif not _cpu_has_avx2():
            _STATE["why"] = "not an x86-64 CPU with AVX2: the tensor path"
        else:
            try:
                _STATE["ops"] = _load()
                _STATE["why"] = "compiled"
            except Exception as exc:  # no compiler, headers or disk: the same numbers, slower
                _STATE["why"] = f"could not build ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}): " \
                                "the tensor path"
                log.warning("exact GEMM kernels %s", _STATE["why"])
        _STATE["tried"] = True
        return _STATE["ops"]


def status() -> str:
    """One phrase: whether the compiled kernels run here, and why not where they do not."""
    return str(_STATE["why"])


if __name__ == "__main__":
    ops()
    print(f"exact GEMM kernels: {status()}" + (f" ({build_dir()})" if ops() is not None else ""))
