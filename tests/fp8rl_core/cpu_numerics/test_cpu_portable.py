"""``precision.cpu_bf16_gemm: portable`` (cpu_numerics.portable_math, portable_mode): one answer on every CPU.

The GEMM is exact: its result cannot depend on the order in which a BLAS sums, which is what
differs between MKL's kernels on Intel and AMD CPUs; the transcendentals use ATen's own kernels
only and come out correctly rounded on these samples (the VML versions they replace are not
guaranteed to). Each test below fails on the old ``fp32`` path (MKL's SGEMM and VML).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fp8rl_core.cpu_numerics import cpu_gemm
from fp8rl_core.cpu_numerics import portable_math as pm
from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm


def _bf16(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).bfloat16().float()


def test_the_gemm_does_not_depend_on_the_summation_order():
    """Permuting the inner dimension permutes the order of the sums: the exact GEMM gives the same
    bits, an FP32 SGEMM does not (checked on the same operands)."""
    a, b = _bf16(64, 1000, seed=1), _bf16(1000, 48, seed=2)
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(3))
    exact = pm.exact_matmul(a, b, 1)
    assert torch.equal(exact, pm.exact_matmul(a[:, perm], b[perm], 1))
    assert not torch.equal(a @ b, a[:, perm] @ b[perm])  # what the old path computed: order-dependent


def test_bf16_operands_on_their_grid_give_the_exactly_rounded_product():
    a = _bf16(37, 300, seed=4).clamp(-2.0, 2.0).add(8.0).bfloat16().float()  # near each row's largest: on the grid
    b = _bf16(300, 20, seed=5).clamp(-2.0, 2.0).add(8.0).bfloat16().float()
    assert torch.equal(pm.exact_matmul(a, b, 1), (a.double() @ b.double()).float())


def test_float32_operands_keep_more_than_float32_gemm_precision_and_long_inner_dims_chunk():
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(16, 3 * pm.EXACT_CHUNK + 5, generator=g), torch.randn(3 * pm.EXACT_CHUNK + 5, 8, generator=g)
    ref = a.double() @ b.double()
    err = ((pm.exact_matmul(a, b).double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    assert err < 2**-22  # one rounding to float32 (2**-24) plus the grid's ~2**-38
    assert torch.equal(pm.exact_matmul(a, b), pm.exact_matmul(a.clone(), b.clone()))


def test_gradients_of_the_gemm_are_the_gemms_of_the_gradients():
    a, b = _bf16(3, 5, 16, seed=7).requires_grad_(), _bf16(16, 4, seed=8).requires_grad_()
    g = _bf16(3, 5, 4, seed=9)
    (pm.exact_matmul(a, b, 1) * g).sum().backward()
    assert torch.allclose(a.grad, g @ b.detach().t(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(b.grad, a.detach().reshape(-1, 16).t() @ g.reshape(-1, 4), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "fn,ref,domain",
    [
        (pm.portable_exp, torch.exp, lambda x: x * 10),
        (pm.portable_log, torch.log, lambda x: x.abs() * 100 + 1e-30),
        (pm.portable_sin, torch.sin, lambda x: x * 300),
        (pm.portable_cos, torch.cos, lambda x: x * 300),
        (pm.portable_sqrt, torch.sqrt, lambda x: x.abs() * 1e3),
        (pm.portable_tanh, torch.tanh, lambda x: x * 4),
    ],
)
def test_transcendentals_are_correctly_rounded_on_these_samples(fn, ref, domain):
    x = domain(torch.randn(50_000, generator=torch.Generator().manual_seed(10)))
    want = ref(x.double()).float()  # float64 result rounded once: the correctly rounded float32 (but ~2**-29)
    assert torch.equal(fn(x), want)


def test_special_values_follow_torch():
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan")])
    for fn, ref in [(pm.portable_exp, torch.exp), (pm.portable_log, torch.log), (pm.portable_sqrt, torch.sqrt)]:
        got, want = fn(special), ref(special)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~got.isnan()], want[~want.isnan()])
    rows = torch.tensor([[0.0, 1.0, 2.0], [float("-inf")] * 3, [1e30, 1.0, -1e30]])
    assert torch.equal(pm.portable_logsumexp(rows, -1).isinf(), torch.logsumexp(rows, -1).isinf())
    assert torch.allclose(pm.portable_logsumexp(rows[[0, 2]], -1), torch.logsumexp(rows[[0, 2]], -1))


def test_the_mode_takes_gemms_attention_and_math_with_torchs_gradients():
    q, k, v = (_bf16(2, 4, 9, 16, seed=s).requires_grad_() for s in (11, 12, 13))
    x = torch.randn(40, generator=torch.Generator().manual_seed(14)).requires_grad_()
    with cpu_bf16_gemm("portable") as mode, torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = torch.exp(x) + torch.log(x.abs() + 1) + torch.sqrt(x.abs() + 1) + torch.tanh(x) + x.sin() + x.cos()
        lse = torch.logsumexp(x[None], -1)
    assert mode.calls == 1 and mode.math_calls == 7 and out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out.float(), ref, atol=2e-2)
    (y.sum() + lse.sum()).backward()
    xd = x.detach()
    want = xd.exp() + xd.sign() / (xd.abs() + 1) + 0.5 * xd.sign() / (xd.abs() + 1).sqrt()
    want = want + 1 - xd.tanh() ** 2 + xd.cos() - xd.sin() + torch.softmax(xd, 0)
    assert torch.allclose(x.grad, want, rtol=1e-5, atol=1e-6)


def test_a_row_with_nothing_to_attend_to_gives_zeros_not_nan():
    q, k, v = (_bf16(1, 1, 3, 8, seed=s) for s in (15, 16, 17))
    mask = torch.tensor([[False, False, False], [True, False, False], [True, True, False]])
    with cpu_bf16_gemm("portable"), torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[0, 0, 0], torch.zeros(8, dtype=torch.bfloat16)) and not out.isnan().any()


def test_code_outside_the_modes_reach_follows_the_open_context():
    """A custom backward runs without the caller's modes: cpu_gemm.exp and cpu_gemm.mm follow the
    open context there (the log-prob backward and the emulated FP8 linears use them)."""
    x = torch.randn(100, generator=torch.Generator().manual_seed(18)) * 5
    a, b = _bf16(8, 16, seed=19).bfloat16(), _bf16(16, 4, seed=20).bfloat16()
    with cpu_bf16_gemm("portable"):
        assert torch.equal(cpu_gemm.exp(x), pm.portable_exp(x))
        assert torch.equal(cpu_gemm.mm(a, b), pm.exact_matmul(a.float(), b.float(), 1).bfloat16())
    assert torch.equal(cpu_gemm.exp(x), torch.exp(x))


def test_the_portable_path_leaves_other_devices_dtypes_and_subclasses_alone():
    x = torch.randn(8, dtype=torch.float16)
    with cpu_bf16_gemm("portable") as mode:
        torch.exp(x)
        torch.mm(torch.ones(2, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int64))
    assert mode.calls == 0 and mode.math_calls == 0
    with pytest.raises(ValueError, match="no dropout"):
        with cpu_bf16_gemm("portable"):
            F.scaled_dot_product_attention(*(torch.randn(1, 1, 2, 4) for _ in range(3)), dropout_p=0.5)
    assert math.isclose(pm.portable_exp(torch.tensor([1.0], dtype=torch.float64)).item(), math.e, rel_tol=1e-15)
