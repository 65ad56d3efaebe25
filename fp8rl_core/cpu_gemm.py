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
tables are the same on every CPU (``fp8rl_core.cpu_env``). The price on an AMX CPU, measured
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
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

CPU_BF16_GEMMS = ("native", "fp32")  # what a run computes with; the setting may also say "auto"
NATIVE_MIN_HIDDEN = 256  # auto: narrower models (the tiny presets) keep the CPU-independent fp32 path

_GEMMS = frozenset(
    {
        F.linear,
        torch.mm,
        torch.bmm,
        torch.matmul,
        torch.addmm,
        torch.baddbmm,
        torch.Tensor.mm,
        torch.Tensor.bmm,
        torch.Tensor.matmul,
        torch.Tensor.__matmul__,
        torch.Tensor.addmm,
        torch.Tensor.baddbmm,
        F.scaled_dot_product_attention,
    }
)
_OPERAND_DTYPES = (torch.float32, torch.bfloat16)
_OPEN = [0]  # fp32 contexts open in this process (read by mm, which runs where modes do not reach)


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
        return GemmChoice(setting, "fp32", "no AMX-BF16/AVX512-BF16: the native BF16 GEMM is slow here")
    if hidden_size is not None and hidden_size < NATIVE_MIN_HIDDEN:
        return GemmChoice(
            setting,
            "fp32",
            f"{isa}, but hidden size {hidden_size} < {NATIVE_MIN_HIDDEN}: the CPU-independent FP32 GEMMs",
        )
    return GemmChoice(setting, "native", f"{isa} and a model at least {NATIVE_MIN_HIDDEN} wide")


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


_BF16_EXACT = "_fp8rl_bf16_exact"  # attribute of a float32 tensor whose values are all BF16 values


def mark_bf16_exact(t: torch.Tensor) -> torch.Tensor:
    """Tag a float32 tensor that holds only BF16 values (e.g. BF16 upcast): the ``fp32`` path takes it
    as an operand as it is, without the BF16 round trip (which would give the same values). Returns ``t``.
    The tag is on this tensor object, not on its storage: views and results of ops are untagged."""
    if t.dtype != torch.float32:
        raise ValueError(f"mark_bf16_exact: a float32 tensor holding BF16 values, got {t.dtype}")
    setattr(t, _BF16_EXACT, True)
    return t


def fp32_gemms_active() -> bool:
    """Whether a :class:`Bf16GemmsInFp32` mode handles this thread's GEMMs (a ``cpu_bf16_gemm("fp32")``
    context is open here)."""
    return any(isinstance(m, Bf16GemmsInFp32) for m in torch.overrides._get_current_function_mode_stack())


def _bf16_operand(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        if getattr(a, _BF16_EXACT, False):  # float32 holding BF16 values (mark_bf16_exact)
            return a
        return a.to(torch.bfloat16).float()  # the BF16 value, held in FP32 (exact)
    return a


class Bf16GemmsInFp32(TorchFunctionMode):
    """The torch-function mode behind ``cpu_bf16_gemm: fp32`` (see the module docstring).

    ``calls`` counts the GEMMs it took over (tests read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS and "out" not in kwargs and self._takes(args, kwargs):
            self.calls += 1
            with torch.autocast("cpu", enabled=False):
                out = func(*map(_bf16_operand, args), **{k: _bf16_operand(v) for k, v in kwargs.items()})
            return out.to(torch.bfloat16)
        return func(*args, **kwargs)

    @staticmethod
    def _takes(args: tuple, kwargs: dict) -> bool:
        tensors = _tensors(args, kwargs)
        if not tensors or any(t.device.type != "cpu" for t in tensors):
            return False
        floats = [t.dtype for t in tensors if t.is_floating_point()]
        if not floats:
            return False
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
            return all(d in _OPERAND_DTYPES for d in floats)
        return all(d == torch.bfloat16 for d in floats)


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
    mode = Bf16GemmsInFp32()
    _OPEN[0] += 1
    try:
        with mode:
            yield mode
    finally:
        _OPEN[0] -= 1


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.mm`` for the emulated low-precision linears: inside a ``cpu_bf16_gemm("fp32")``
    context a BF16 x BF16 product on CPU is an FP32 GEMM rounded once to BF16; else torch.mm."""
    if _OPEN[0] and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16 and a.device.type == "cpu":
        return torch.mm(a.float(), b.float()).to(torch.bfloat16)
    return torch.mm(a, b)


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
        return torch.mm(a.float(), b.float()).to(torch.bfloat16)
    return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16))


def modes_off(*tensors: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context without torch-function handling for plain CPU ``tensors`` while no torch-function
    mode other than :class:`Bf16GemmsInFp32` is active; otherwise a context that changes nothing
    (another mode, e.g. ``fp8rl_core.device_discipline``'s, keeps seeing every op).

    For code that runs no GEMM the mode would take and applies the BF16 rule itself (the emulated
    FP4 linears' quantize-dequantize, :func:`mm_rounded`): the same ops, without the mode's
    Python call per op -- a third of an FP4 rollout linear's time on a 128-token decode step."""
    ours = all(isinstance(m, Bf16GemmsInFp32) for m in torch.overrides._get_current_function_mode_stack())
    if ours and all(type(t) is torch.Tensor and t.device.type == "cpu" for t in tensors):
        return torch._C.DisableTorchFunction()
    return contextlib.nullcontext()
