"""torchao's blockwise FP8 Triton autotuning, bounded and its timings cached on disk.

torchao 0.18's blockwise training prototype
(``torchao/prototype/blockwise_fp8_training/kernels.py``) wraps seven Triton
kernels in ``@triton.autotune``: two GEMMs over 6 configurations (tile 64 / 128
/ 256 x 4 or 8 warps, keyed on N, K and, for the 128x1 one, M), three
activation quantizers over 45 (5 row-group sizes x 3 warp counts x 3 pipeline
depths, keyed on K) and two weight quantizers over 4 (keyed on M, N). Every
new key compiles and benchmarks each configuration: about 360 runs at
Qwen3-8B's shapes, 2-3 minutes of a 5-minute check before the first blockwise
step is timed.

:func:`bound_blockwise_autotune` cuts each kernel's list to at most
``max_configs`` (default 2) in place, by a fixed preference: the middle tile
(128) and row-group size (64), then the shallowest pipeline (2 stages), then 4
warps. Triton benchmarks nothing when one configuration is left and two
otherwise, so a new key costs two compilations instead of up to 45. It also
turns on Triton's disk cache of autotuning results
(``Autotuner.cache_results``; the files go to ``TRITON_CACHE_DIR``, which it
sets to :data:`CACHE_DIR` unless already set), so a second run on the same
machine and software benchmarks nothing.

The preference is a guess that keeps configurations torchao itself offers; it
has not been measured on a GPU (as of 2026-12-03 nothing in ``gpu_check/`` has
run on one). Kernel speed is not what the check's blockwise cells are compared
on (they time the train step against BF16), and a slower tile shows there as a
lower ratio, not as a wrong result. On CPU the tests run it against the real
torchao module where Triton imports (it imports without a GPU).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

KERNELS_MODULE = "torchao.prototype.blockwise_fp8_training.kernels"
CACHE_DIR = Path.home() / ".cache" / "fp8rl" / "gpu-check-triton"
MAX_CONFIGS = 2


def preference(config) -> tuple[float, int, float]:
    """Sort key of a ``triton.Config`` (smaller first): the middle tile / row-group size, then the
    shallowest pipeline, then 4 warps."""
    kw = config.kwargs
    size = abs(math.log2(kw.get("BLOCK_SIZE_M", 128) / 128)) + abs(math.log2(kw.get("BLOCK_SIZE_N", 128) / 128))
    size += abs(math.log2(kw.get("NUM_GROUPS", 64) / 64))
    return size, config.num_stages, abs(math.log2(config.num_warps / 4))


def bound_autotuners(module, max_configs: int = MAX_CONFIGS) -> dict[str, tuple[int, int]]:
    """Cut every autotuned kernel of ``module`` to its ``max_configs`` preferred configurations and turn on
    its disk cache; returns ``{kernel name: (configs before, configs after)}``."""
    if max_configs < 1:
        raise ValueError(f"max_configs must be at least 1, got {max_configs}")
    bounded = {}
    for name, obj in sorted(vars(module).items()):
        configs = getattr(obj, "configs", None)
        if not (isinstance(configs, list) and configs and hasattr(obj, "keys") and hasattr(obj, "cache")):
            continue  # not a triton Autotuner
        before = len(configs)
        obj.configs = sorted(configs, key=preference)[:max_configs]
        obj.cache_results = True
        obj.cache.clear()  # choices made under the old list must not outlive it
        bounded[name] = (before, len(obj.configs))
    return bounded


def bound_blockwise_autotune(max_configs: int = MAX_CONFIGS, cache_dir: Path | None = None) -> str:
    """Bound torchao's blockwise kernels' autotuning (see the module) in this process; returns one line
    saying what was done, or why nothing was (Triton or torchao not importable)."""
    import importlib

    os.environ.setdefault("TRITON_CACHE_DIR", str(cache_dir or CACHE_DIR))
    try:
        module = importlib.import_module(KERNELS_MODULE)
    except Exception as err:  # noqa: BLE001 - no Triton (CPU torch) or no torchao: nothing to bound
        return f"autotune: not bounded ({KERNELS_MODULE} does not import: {type(err).__name__}: {str(err)[:120]})"
    bounded = bound_autotuners(module, max_configs)
    if not bounded:
        return f"autotune: not bounded (no autotuned kernel found in {KERNELS_MODULE})"
    sizes = ", ".join(f"{before}->{after}" for before, after in bounded.values())
    return (
        f"autotune: {len(bounded)} torchao blockwise kernels bounded to <= {max_configs} configs ({sizes}); "
        f"timings cached in {os.environ['TRITON_CACHE_DIR']}"
    )
