"""BF16 GEMM numerics through FP32 GEMMs on a CPU without BF16 hardware (the ``auto`` default).

``precision.cpu_bf16_gemm: fp32`` makes every BF16 matmul of a CPU campaign run as
an FP32 GEMM on BF16 operands with its output rounded to BF16. That is the GPU's
own BF16 rule -- BF16 inputs, FP32 accumulation, one rounding of the output (the
tensor-core contract of cuBLAS BF16 GEMMs) -- so the products, the accumulation
precision and the output dtype are those of the ``native`` kernel; only the
accumulation order differs (not bit-identical to PyTorch's CPU BF16 kernel).

Why: on a CPU without AVX512-BF16/AMX, PyTorch's BF16 GEMM has no fast kernel and
runs 10-130x slower than FP32 GEMM of the same shape
(``benchmarks/cpu_bf16_gemm.py``); the stress world spends most of a step there.

``auto`` (the default, :func:`resolve_cpu_bf16_gemm`) takes the native kernel only on a CPU
that has a fast one (AMX-BF16 or AVX512-BF16) and for a model at least
:data:`NATIVE_MIN_HIDDEN` wide. Narrower models -- every tiny preset -- take ``fp32`` on every
CPU, by design: it keeps oneDNN's ISA-dependent BF16 kernels out of their numbers, so their
tables are the same on every CPU (``fp8rl_core.host.cpu_env``). The price on an AMX CPU, measured
(CPU time, one thread, an RL step of a 4-layer, 128-wide model on 128 samples): 1.3x;
``native`` buys it back where bit-identity across CPUs does not matter (docs/cpu.md).

Which calls: the matmuls the CPU autocast runs in BF16 (``F.linear``, ``mm``,
``bmm``, ``matmul``/``@``, ``addmm``, ``baddbmm``, scaled-dot-product attention)

* under CPU BF16 autocast, with FP32/BF16 float operands (autocast would cast
  them to BF16), and
* outside autocast, when every float operand is already BF16 (the emulated FP8 /
  FP4 linears compute their dequantized GEMMs in BF16 explicitly).

Anything else (CUDA tensors, FP32 GEMMs outside autocast, ``out=``) runs untouched.
Gradients follow through the casts: the backward's GEMMs are FP32 on the BF16
values and every gradient is rounded to BF16 where the BF16 kernel's would be.

A torch-function mode does not reach the ``backward`` of a custom autograd
Function (the autograd engine runs it without the caller's modes), so the
emulated FP8/FP4 linears call :func:`mm`, which follows the same rule while a
``cpu_bf16_gemm("fp32")`` context is open anywhere in the process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from fp8rl_core.cpu_numerics import portable_math
from fp8rl_core.cpu_numerics.bf16_rule import _BF16_EXACT, Bf16GemmsInFp32, _bf16_operand, mark_bf16_exact
from fp8rl_core.cpu_numerics.portable_mode import PortableNumerics

CPU_BF16_GEMMS = ("native", "fp32", "portable")  # what a run computes with; the setting may also say "auto"
NATIVE_MIN_HIDDEN = 256  # auto: narrower models (the tiny presets) keep the CPU-independent fp32 path

_OPEN = [0]  # fp32/portable contexts open in this process (read by mm, which runs where modes do not reach)
_PORTABLE_OPEN = [0]  # of which portable


@dataclass(frozen=True)
class GemmChoice:
    """What ``precision.cpu_bf16_gemm`` resolved to on this machine, and why (run.json records it)."""

    setting: str  # auto | native | fp32, as configured
    kind: str  # native | fp32, what the run computes with
    reason: str


# oneDNN's CPU instruction-set limits (``ONEDNN_MAX_CPU_ISA``), lowest first; the BF16 kernels
# need AVX512_CORE_BF16 (AVX512-BF16) or AVX512_CORE_AMX (AMX-BF16) at least
_ONEDNN_ISAS = (
    "SSE41",
    "AVX",
    "AVX2",
    "AVX2_VNNI",
    "AVX2_VNNI_2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX10_1_512",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "ALL",
)


def onednn_isa_limit(environ: dict[str, str] | None = None) -> str | None:
    """The instruction-set limit set for oneDNN (``ONEDNN_MAX_CPU_ISA``, or its older name
    ``DNNL_MAX_CPU_ISA``), upper-cased; None when unset or not a name oneDNN knows (it ignores those)."""
    import os

    environ = os.environ if environ is None else environ
    value = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return value if value in _ONEDNN_ISAS else None


def fast_bf16_isa() -> str | None:
    """The CPU's fast BF16 GEMM instructions PyTorch's oneDNN kernels use, or None.

    The hardware's, unless ``ONEDNN_MAX_CPU_ISA`` keeps oneDNN below them: then its BF16
    kernels run the slow conversion path whatever the CPU has (``ONEDNN_MAX_CPU_ISA=AVX2``
    makes an AMX CPU compute BF16 GEMMs as an AVX2-only CPU does, ~1 GFLOP/s)."""
    limit = onednn_isa_limit()
    rank = _ONEDNN_ISAS.index(limit) if limit else len(_ONEDNN_ISAS)
    if torch.cpu._is_amx_tile_supported() and rank >= _ONEDNN_ISAS.index("AVX512_CORE_AMX"):
        return "AMX-BF16"
    if torch.cpu._is_avx512_bf16_supported() and rank >= _ONEDNN_ISAS.index("AVX512_CORE_BF16"):
        return "AVX512-BF16"
    return None


def resolve_cpu_bf16_gemm(setting: str, hidden_size: int | None, device: str | torch.device = "cpu") -> GemmChoice:
    """Resolve ``precision.cpu_bf16_gemm`` for a model of width ``hidden_size`` (None: unknown,
    a checkpoint from ``model.path``, taken as wide). ``native``/``fp32`` are kept as given."""
    if setting not in ("auto", *CPU_BF16_GEMMS):
        raise ValueError(f"precision.cpu_bf16_gemm: unknown {setting!r}; valid: auto, {', '.join(CPU_BF16_GEMMS)}")
    if torch.device(device).type != "cpu":
        return GemmChoice(setting, "native", f"{torch.device(device).type}: the hardware's BF16 GEMMs")
    if setting != "auto":
        return GemmChoice(setting, setting, "configured")
    isa = fast_bf16_isa()
    if isa is None:
        return GemmChoice(setting, "portable", "no AMX-BF16/AVX512-BF16: the CPU-independent exact GEMMs")
    if hidden_size is not None and hidden_size < NATIVE_MIN_HIDDEN:
        return GemmChoice(
            setting,
            "portable",
            f"{isa}, but hidden size {hidden_size} < {NATIVE_MIN_HIDDEN}: the CPU-independent exact GEMMs",
        )
    return GemmChoice(setting, "native", f"{isa} and a model at least {NATIVE_MIN_HIDDEN} wide")


def active_cpu_gemm_mode() -> Bf16GemmsInFp32 | None:
    """The innermost ``cpu_bf16_gemm`` mode (fp32 or portable) active on this thread, or None."""
    modes = [m for m in torch.overrides._get_current_function_mode_stack() if isinstance(m, Bf16GemmsInFp32)]
    return modes[-1] if modes else None


def active_cpu_gemm() -> str:
    """The ``cpu_bf16_gemm`` kind open on this thread (``native`` when none): what a thread that works for
    this one opens, so that both compute alike (a mode does not cross threads)."""
    mode = active_cpu_gemm_mode()
    return "native" if mode is None else "portable" if isinstance(mode, PortableNumerics) else "fp32"


def fp32_gemms_active() -> bool:
    """Whether a :class:`Bf16GemmsInFp32` mode handles this thread's GEMMs (a ``cpu_bf16_gemm("fp32")``
    context is open here)."""
    return active_cpu_gemm_mode() is not None


@contextlib.contextmanager
def cpu_bf16_gemm(kind: str, device: str | torch.device = "cpu") -> Iterator[Bf16GemmsInFp32 | None]:
    """Inside: BF16 GEMMs on CPU follow ``kind`` (``native`` = PyTorch's BF16 kernels, a no-op;
    ``fp32`` = :class:`Bf16GemmsInFp32`). A CUDA device is left alone whatever ``kind`` says:
    its BF16 GEMMs are the hardware's. Wrap a whole thread's work (forward, backward, sampling):
    a torch-function mode is thread-local and the backward runs on the caller's thread on CPU."""
    if kind not in CPU_BF16_GEMMS:
        raise ValueError(f"precision.cpu_bf16_gemm: unknown {kind!r}; valid: {', '.join(CPU_BF16_GEMMS)}")
    if kind == "native" or torch.device(device).type != "cpu":
        yield None
        return
    mode = PortableNumerics() if kind == "portable" else Bf16GemmsInFp32()
    _OPEN[0] += 1
    _PORTABLE_OPEN[0] += kind == "portable"
    try:
        with mode:
            yield mode
    finally:
        _OPEN[0] -= 1
        _PORTABLE_OPEN[0] -= kind == "portable"


def _fp32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The product of float32-held operands on the open context's path (exact GEMM when portable)."""
    if _PORTABLE_OPEN[0]:
        return portable_math.exact_matmul(a, b, 1)
    return torch.mm(a, b)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.mm`` for the emulated low-precision linears: inside a ``cpu_bf16_gemm("fp32")``
    context a BF16 x BF16 product on CPU is an FP32 GEMM rounded once to BF16; else torch.mm."""
    if _OPEN[0] and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and a.device.type == "cpu":
        if _PORTABLE_OPEN[0]:  # the exact GEMM reads BF16 operands and rounds its output to BF16 itself
            return portable_math.exact_matmul(a, b, 1, to_bf16=True)
        return _fp32_mm(a.float(), b.float()).to(torch.bfloat16)
    return torch.mm(a, b)


def exp(x: torch.Tensor) -> torch.Tensor:
    """``torch.exp`` for code that runs where modes do not reach (a custom autograd backward): the
    library-free exp while a ``cpu_bf16_gemm("portable")`` context is open, else ``torch.exp``."""
    if _PORTABLE_OPEN[0] and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return portable_math.portable_exp(x)
    return torch.exp(x)


def rounded_operand(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float32 tensor the caller owns, made an operand of :func:`mm_rounded` in ``dtype``.

    Inside a ``cpu_bf16_gemm("fp32")`` context, on CPU, for ``dtype`` BF16: y rounded to BF16 in
    place and kept in float32 -- the value :func:`mm` upcasts a BF16 operand to, without the BF16
    copy's second upcast. Otherwise ``y.to(dtype)``."""
    if _OPEN[0] and dtype == torch.bfloat16 and y.dtype == torch.float32 and y.device.type == "cpu":
        return y.copy_(y.to(torch.bfloat16))
    return y.to(dtype)


def mm_rounded(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`mm` of :func:`rounded_operand` results for a product in ``dtype``: bit for bit the
    product of the ``dtype`` operands, float32-held BF16 values included (either or both)."""
    if dtype != torch.bfloat16 or (a.dtype != torch.float32 and b.dtype != torch.float32):
        return mm(a, b)
    if _OPEN[0] and a.device.type == "cpu":
        if _PORTABLE_OPEN[0]:
            return portable_math.exact_matmul(a, b, 1, to_bf16=True)
        return _fp32_mm(a.float(), b.float()).to(torch.bfloat16)
    return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16))


__all__ = ["_BF16_EXACT", "Bf16GemmsInFp32", "_bf16_operand", "mark_bf16_exact"]  # re-exported


def modes_off(*tensors: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context without torch-function handling for plain CPU ``tensors`` while no torch-function
    mode other than :class:`Bf16GemmsInFp32` is active; otherwise a context that changes nothing
    (another mode, e.g. ``fp8rl_core.host.device_discipline``'s, keeps seeing every op).

    For code that runs no GEMM the mode would take and applies the BF16 rule itself (the emulated
    FP4 linears' quantize-dequantize, :func:`mm_rounded`): the same ops, without the mode's
    Python call per op -- a third of an FP4 rollout linear's time on a 128-token decode step."""
    ours = all(isinstance(m, Bf16GemmsInFp32) for m in torch.overrides._get_current_function_mode_stack())
    if ours and all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors):
        return torch._C.DisableTorchFunction()
    return contextlib.nullcontext()
