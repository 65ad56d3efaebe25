"""The CPU setting that makes a campaign's numbers the same on every x86-64 CPU (torch-free).

A CPU run's bits depend on three things besides its inputs and seeds:

1. **ATen's vectorized kernels.** PyTorch compiles its elementwise and reduction kernels
   (softmax, log-softmax, cross-entropy, sums, the optimizer's arithmetic, ...) once per
   instruction set and picks one at the first op: ``DEFAULT``, ``AVX2`` or ``AVX512``. A wider
   vector sums in another order, so an AVX-512 CPU (most Intel Xeons, AMD Zen 4) and an AVX2
   one (AMD Zen 2/3, older Intel) disagree in the last bits of a softmax.
   ``ATEN_CPU_CAPABILITY=avx2`` makes every CPU that has AVX2 run the same AVX2 code; ATen's
   own code has no other CPU-dependent branch.
2. **Libraries that choose their code by the CPU**: MKL's GEMMs and vector math (``exp``,
   ``log``, ``sin``, ``cos``, ``sqrt``, ``tanh``) and oneDNN's BF16 kernels. No variable makes
   them agree across vendors (MKL honours ``MKL_CBWR`` branches on Intel CPUs only), so
   ``precision.cpu_bf16_gemm: portable`` (the ``auto`` choice of the tiny presets) does not call
   them: ``fp8rl_core.cpu_numerics.portable_mode`` computes GEMMs exactly and the transcendentals with
   ATen's own kernels. MKL's branch then changes only its speed, and is left to MKL.
3. **The thread count**, which splits reductions: part of the config (``threads``).

The variable is read once, at the first torch op, so :func:`pin_cpu_numerics` must run before
torch is imported: the ``fp8rl`` command does it first thing, and every process it starts
(ranks, sweep cells) inherits it. A value the user set is kept.
"""

from __future__ import annotations

import os
import sys
from typing import MutableMapping

# variable -> value in force unless the user set it (see the module docstring)
PINNED_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "avx2"}


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
