"""Freed tensor memory kept in the process (Linux, glibc; torch-free): faster CPU steps, same bits.

PyTorch's CPU allocator takes every tensor from ``malloc`` and gives it back when the
tensor dies. glibc serves a request above its mmap threshold (128 KiB at start, raised
as big blocks are freed) with fresh pages from the kernel and returns them on ``free``,
so a step that makes and drops the same multi-MiB activations again and again (an FP4
emulation step: dozens of ``[tokens, width]`` float32 temporaries per linear) pays a page
fault per 4 KiB and cold caches each time. :func:`keep_freed_memory` raises the mmap
threshold to glibc's 64-bit maximum (32 MiB) and the trim threshold to 256 MiB: the heap
keeps freed blocks and hands them out again: a third as many page faults in a stress-world
NVFP4 micro-batch forward + backward, 5-10 % less CPU time (docs/cpu.md).
Only speed changes: the allocator decides where tensors live, never what is computed.
The cost is memory: up to 256 MiB of freed heap stays with the process.

The ``fp8rl`` command calls it first thing; the two ``MALLOC_*_`` variables it sets (unless
the user set them) make glibc in every process the command starts (ranks, sweep cells) do
the same from their first allocation.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import MutableMapping

MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX of 64-bit glibc
TRIM_THRESHOLD = 256 << 20
MALLOC_ENV: dict[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def keep_freed_memory(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set the :data:`MALLOC_ENV` variables the user has not set and, for ``os.environ`` on glibc,
    apply them to this process (``mallopt``). Returns whether this process's allocator was changed.

    As :func:`fp8rl_core.host.cpu_env.pin_cpu_numerics`: once torch is imported in this process (an
    in-process caller such as a test) nothing is changed, neither the allocator nor the environment."""
    environ = os.environ if environ is None else environ
    if environ is os.environ and "torch" in sys.modules:
        return False
    user_set = all(k in environ for k in MALLOC_ENV)  # glibc read them when this process started
    for k, v in MALLOC_ENV.items():
        environ.setdefault(k, v)
    if environ is not os.environ or user_set or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt): leave the allocator alone
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, int(environ["MALLOC_MMAP_THRESHOLD_"]))
    return bool(ok and mallopt(_M_TRIM_THRESHOLD, int(environ["MALLOC_TRIM_THRESHOLD_"])))
