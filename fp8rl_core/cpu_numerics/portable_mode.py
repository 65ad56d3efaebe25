"""``precision.cpu_bf16_gemm: portable``: a campaign's CPU arithmetic with one answer on every x86-64 CPU.

:class:`PortableNumerics` is the torch-function mode behind it. It keeps the BF16 GEMM rule of
``cpu_bf16_gemm: fp32`` (BF16 operands, one rounding of the output to BF16, ``fp8rl_core.cpu_numerics.cpu_gemm``)
and replaces every call whose bits a library chooses by the CPU (``fp8rl_core.cpu_numerics.portable_math``):

* GEMMs (``F.linear``, ``mm``, ``bmm``, ``matmul``/``@``, ``addmm``, ``baddbmm``) by the exact GEMM,
  under BF16 autocast as before and, outside it, for float32 operands too (they keep float32);
* scaled-dot-product attention by its definition: exact ``Q·Kᵀ``, the softmax (ATen's own
  kernel; a row with nothing to attend to gives zeros, as PyTorch's math path does), the
  probabilities rounded to BF16 as a GPU's flash attention rounds them, exact ``P·V``;
* ``exp``, ``log``, ``sin``, ``cos``, ``sqrt`` (and ``pow(x, 0.5)``), ``tanh``, ``logsumexp`` and
  ``_foreach_sqrt`` on float32/float64 CPU tensors by the library-free versions, with gradients
  computed by the same functions.

What it leaves to torch: tensors off the CPU, other dtypes (a BF16 ``exp`` is ATen's own
code), tensor subclasses, calls with ``out=``. ``tests/fp8rl_core/cpu_numerics/test_cpu_portable.py`` lists the ATen
ops a short campaign dispatches and fails on one that reaches a CPU-dependent library.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fp8rl_core.cpu_numerics import bf16_rule
from fp8rl_core.cpu_numerics import portable_math as pm
from fp8rl_core.cpu_numerics.bf16_rule import Bf16GemmsInFp32

# --------------------------------------------------------------------------- GEMMs


def _linear(levels, input, weight, bias=None):
    if bias is None:  # under the BF16 rule the output's BF16 rounding is fused into the GEMM's last pass
        return pm.exact_matmul(input, weight.transpose(-1, -2), levels, to_bf16=levels == 1)
    return pm.exact_matmul(input, weight.transpose(-1, -2), levels) + bias.float()


def _same(t):
    return t


def _rule_operand(a):
    """An operand of the BF16 rule as the exact GEMM reads it: its BF16 value, held as BF16 (one
    conversion; a float32 tensor marked as holding BF16 values is taken as it is). Non-operand
    tensors (a bias, ``addmm``'s input, an attention mask) are used as ``.float()`` of it: the BF16
    value in float32, as :func:`bf16_rule._bf16_operand` gives."""
    if isinstance(a, torch.Tensor) and a.is_floating_point() and not getattr(a, bf16_rule._BF16_EXACT, False):
        return a.to(torch.bfloat16)
    return a


def _linear_reusing_grid(impl, levels, operand, args, kwargs):
    """``F.linear`` on a weight whose grid :func:`portable_math.reuse_weight_grids` holds (no gradient
    taken): the same exact GEMM on the same integers, the weight's grid made once. None otherwise."""
    if impl is not _linear or kwargs or len(args) < 2 or args[0].dim() < 2:
        return None
    if args[0].requires_grad and torch.is_grad_enabled():
        return None
    grid = pm.weight_grid(args[1], levels)
    if grid is None:
        return None
    x, bias = operand(args[0]), (operand(args[2]).float() if len(args) > 2 and args[2] is not None else None)
    out = pm.exact_matmul_values(x, None, levels, b_grid=grid, to_bf16=levels == 1 and bias is None)
    return out if bias is None else out + bias


def _addmm(levels, input, mat1, mat2, *, beta=1, alpha=1):
    out = pm.exact_matmul(mat1, mat2, levels)
    if alpha != 1:
        out = out * alpha
    input = input.float()
    return out if beta == 0 else (input if beta == 1 else input * beta) + out


def _matmul(levels, a, b):
    return pm.exact_matmul(a, b, levels, to_bf16=levels == 1)


def _sdpa(levels, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Scaled-dot-product attention by its definition, each GEMM exact (module docstring); under the
    BF16 rule (``levels`` 1) the probabilities are rounded to BF16, otherwise kept in float32."""
    if dropout_p:
        raise ValueError("precision.cpu_bf16_gemm: portable attention has no dropout (dropout_p must be 0)")
    if enable_gqa and query.size(-3) != key.size(-3):
        rep = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
    scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = pm.exact_matmul(query, key.transpose(-1, -2), levels) * scale
    if is_causal:
        attn_mask = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:  # (a float mask is the BF16 rule's BF16 value: added in float32)
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # nothing to attend to: zeros, not NaN
    probs = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return pm.exact_matmul(probs.to(torch.bfloat16) if levels == 1 else probs, value, levels, to_bf16=levels == 1)


_GEMM_IMPL = {
    F.linear: _linear,
    torch.mm: _matmul,
    torch.bmm: _matmul,
    torch.matmul: _matmul,
    torch.Tensor.mm: _matmul,
    torch.Tensor.bmm: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.addmm: _addmm,
    torch.baddbmm: _addmm,
    torch.Tensor.addmm: _addmm,
    torch.Tensor.baddbmm: _addmm,
    F.scaled_dot_product_attention: _sdpa,
}

# --------------------------------------------------------------------------- transcendentals, with gradients


class _Unary(torch.autograd.Function):
    """y = f(x) by a :mod:`portable_math` function; dy/dx from x and y by ``derivative``."""

    @staticmethod
    def forward(ctx, x, name):
        y = _FORWARD[name](x)
        ctx.name = name
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * _DERIVATIVE[ctx.name](x, y), None


_FORWARD = {
    "exp": pm.portable_exp,
    "log": pm.portable_log,
    "sin": pm.portable_sin,
    "cos": pm.portable_cos,
    "sqrt": pm.portable_sqrt,
    "tanh": pm.portable_tanh,
}
_DERIVATIVE = {
    "exp": lambda x, y: y,
    "log": lambda x, y: 1.0 / x,
    "sin": lambda x, y: pm.portable_cos(x),
    "cos": lambda x, y: -pm.portable_sin(x),
    "sqrt": lambda x, y: 0.5 / y,
    "tanh": lambda x, y: 1.0 - y * y,
}


def _unary(name: str):
    def apply(x, *args, **kwargs):
        return _Unary.apply(x, name) if x.requires_grad else _FORWARD[name](x)

    return apply


def _unary_(name: str):
    def apply(x, *args, **kwargs):
        with torch.no_grad():
            return x.copy_(_FORWARD[name](x))

    return apply


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, keepdim):
        out = pm.portable_logsumexp(x, dim, keepdim)
        ctx.dim, ctx.keepdim = dim, keepdim
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        if not ctx.keepdim:
            dims = (ctx.dim,) if isinstance(ctx.dim, int) else tuple(ctx.dim)
            for d in sorted(d % x.dim() for d in dims):
                grad, out = grad.unsqueeze(d), out.unsqueeze(d)
        return grad * pm.portable_exp(x - out), None, None


def _logsumexp(x, dim, keepdim=False):
    return _LogSumExp.apply(x, dim, keepdim) if x.requires_grad else pm.portable_logsumexp(x, dim, keepdim)


def _pow(x, exponent, *args, **kwargs):
    return _unary("sqrt")(x) if isinstance(exponent, (int, float)) and exponent == 0.5 else None


def _foreach_sqrt(tensors):
    return [_FORWARD["sqrt"](t) if _portable_operand(t) else torch.sqrt(t) for t in tensors]


def _foreach_sqrt_(tensors):
    for t in tensors:
        with torch.no_grad():
            t.copy_(_FORWARD["sqrt"](t) if _portable_operand(t) else torch.sqrt(t))


_UNARY_IMPL = {}
for _name in _FORWARD:
    _UNARY_IMPL[getattr(torch, _name)] = _unary(_name)
    _UNARY_IMPL[getattr(torch.Tensor, _name)] = _unary(_name)
    _UNARY_IMPL[getattr(torch.Tensor, _name + "_")] = _unary_(_name)
_UNARY_IMPL.update(
    {
        F.tanh: _unary("tanh"),
        torch.logsumexp: _logsumexp,
        torch.Tensor.logsumexp: _logsumexp,
        torch.special.logsumexp: _logsumexp,
        torch.pow: _pow,
        torch.Tensor.pow: _pow,
        torch.Tensor.__pow__: _pow,
    }
)
_LIST_IMPL = {torch._foreach_sqrt: _foreach_sqrt, torch._foreach_sqrt_: _foreach_sqrt_}
_FLOATS = (torch.float32, torch.float64)


def _plain_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"


def _portable_operand(t) -> bool:
    return _plain_cpu(t) and t.dtype in _FLOATS


class PortableNumerics(Bf16GemmsInFp32):
    """The torch-function mode of ``cpu_bf16_gemm: portable`` (module docstring). ``calls`` counts
    the GEMMs it took over, ``math_calls`` the transcendental calls."""

    def __init__(self) -> None:
        super().__init__()
        self.math_calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "out" not in kwargs:
            out = self._portable(func, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _portable(self, func, args, kwargs):
        gemm = _GEMM_IMPL.get(func)
        if gemm is not None:
            return self._gemm(gemm, args, kwargs)
        unary = _UNARY_IMPL.get(func)
        if unary is not None and args and _portable_operand(args[0]):
            out = unary(*args, **kwargs)
            self.math_calls += out is not None
            return out
        many = _LIST_IMPL.get(func)
        if many is not None and args:
            self.math_calls += 1
            out = many(*args)
            return args[0] if out is None else out
        return None

    def _gemm(self, impl, args, kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors or not all(_plain_cpu(t) for t in tensors):
            return None
        if self._takes(args, kwargs):  # the BF16 rule: BF16 operands, the output rounded to BF16
            self.calls += 1
            operand = _rule_operand
            with torch.autocast("cpu", enabled=False):
                out = _linear_reusing_grid(impl, 1, operand, args, kwargs)
                if out is None:
                    out = impl(1, *map(operand, args), **{k: operand(v) for k, v in kwargs.items()})
            if out.dtype == torch.bfloat16 and out._is_view():  # (a 1-D operand's squeeze) a new tensor, as
                return out.clone()  # the BF16 rounding's copy gives: callers may write it in place
            return out.to(torch.bfloat16)
        floats = [t.dtype for t in tensors if t.is_floating_point()]
        if floats and all(d == torch.float32 for d in floats) and not torch.is_autocast_enabled("cpu"):
            self.calls += 1
            out = _linear_reusing_grid(impl, 2, _same, args, kwargs)
            return impl(2, *args, **kwargs) if out is None else out
        return None
