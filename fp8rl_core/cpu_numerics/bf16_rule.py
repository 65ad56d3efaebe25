"""The BF16 GEMM rule on a CPU: BF16 operands, one rounding of the output to BF16 (``cpu_bf16_gemm: fp32``).

:class:`Bf16GemmsInFp32` takes over the matmuls the CPU autocast would run in BF16 and computes
them as FP32 GEMMs on the BF16 values; ``fp8rl_core.cpu_numerics.portable_mode`` derives its exact-GEMM mode
from it. ``fp8rl_core.cpu_numerics.cpu_gemm`` chooses between them and PyTorch's own kernels.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

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
