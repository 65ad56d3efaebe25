"""The CPU settings that make a campaign's numbers the same on every x86-64 CPU (torch-free).

A CPU run's bits depend on three things besides its inputs and seeds:

1. **ATen's vectorized kernels.** PyTorch compiles its elementwise and reduction kernels
   (softmax, log-softmax, cross-entropy, the attention kernel's online softmax, ...) once
   per instruction set and picks one at the first op: ``DEFAULT``, ``AVX2`` or
   ``AVX512``. A wider vector sums in another order, so an AVX-512 CPU (most Intel Xeons,
   AMD Zen 4) and an AVX2 one (AMD Zen 2/3, older Intel) disagree in the last bits of a
   softmax. ``ATEN_CPU_CAPABILITY=avx2`` makes every CPU that has AVX2 run the AVX2 code.
2. **MKL.** FP32 GEMMs (``mm``, ``linear``, the FP32 path of ``cpu_bf16_gemm``) and the
   vector math behind large ``exp`` calls go through MKL, which dispatches on the CPU
   (block sizes from cache sizes, AVX2 / AVX-512 kernels, vendor). MKL's Conditional
   Numerical Reproducibility fixes the code branch: ``MKL_CBWR=AVX2`` gives the same
   results on every Intel CPU with AVX2, AVX-512 ones included. MKL honours it on Intel
   CPUs only (elsewhere it runs its automatic branch); ``COMPATIBLE``, the one branch it
   documents as identical on Intel and non-Intel CPUs, made a tiny-model RL step 1.8x
   slower (measured: docs/cpu.md), so it is the user's choice, not the default.
3. **The BF16 GEMM kernel** (oneDNN: AMX, AVX512-BF16 or an AVX2 conversion path, each
   with its own accumulation order). ``precision.cpu_bf16_gemm: auto`` runs the tiny
   presets' BF16 GEMMs as FP32 GEMMs on BF16 operands (``fp8rl_core.cpu_gemm``) on every
   CPU, so oneDNN's choice never reaches them.

Both variables are read once, at the first torch op (ATen) and the first MKL call, so
:func:`pin_cpu_numerics` must run before torch is imported: the ``fp8rl`` command does
it first thing, and every process it starts (ranks, sweep cells) inherits it. A value
the user set is kept. The thread count changes reduction orders too; a campaign fixes
it in its config (``threads``).
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping

# variable -> value in force unless the user set it (see the module docstring)
PINNED_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}


def pin_cpu_numerics(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set every :data:`PINNED_ENV` variable the user has not set; returns the values in force.

    Once torch is imported in this process (an in-process caller such as a test) nothing is
    set: the values would not take effect here, yet processes started later would inherit
    them and compute differently from this one. The run records what is really in force."""
    environ = os.environ if environ is None else environ
    if environ is os.environ and "torch" in sys.modules:
        return cpu_numerics_env(environ)
    environ.update({k: v for k, v in PINNED_ENV.items() if k not in environ})
    return cpu_numerics_env(environ)


def cpu_numerics_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The values of the :data:`PINNED_ENV` variables in ``environ`` ("" where unset)."""
    environ = os.environ if environ is None else environ
    return {k: environ.get(k, "") for k in PINNED_ENV}
