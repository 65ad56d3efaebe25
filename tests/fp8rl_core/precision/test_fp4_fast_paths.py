"""The FP4 emulation's fast paths compute what the plain formulations compute, bit for bit.

``fp8rl_core.precision.fp4`` rounds NVFP4 block scales to E4M3 in the float32 bits instead of casting
to FP8 and back, finds block maxima by max pooling, keeps a working buffer through the
rounding and quantizes a caller's float32 tensor in place; ``fp8rl_core.cpu_numerics.cpu_gemm`` hands the
FP4 linears' operands to the FP32 GEMMs as float32-held BF16 values. Each test compares with
the plain formulation written out here (the one the code used before). The inplace and
rounded-operand tests fail on the old code (neither existed).
"""

from __future__ import annotations

import pytest
import torch

from fp8rl_core.cpu_numerics import cpu_gemm
from fp8rl_core.precision.fp4 import MXFP4, NVFP4, _block_amax, _e4m3_normal_, _grouped, fake_quantize_fp4, round_e2m1_

pytestmark = pytest.mark.timeout(60)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_e4m3_rounding_in_the_bits_is_the_fp8_cast():
    g = torch.Generator().manual_seed(0)
    lo, hi = _bits(torch.tensor(2.0**-6)).item(), _bits(torch.tensor(448.0)).item()
    sample = torch.randint(lo, hi + 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    # every E4M3 value and the midpoints between neighbours (the ties), with one float32 ulp either side
    grid = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[(grid >= 2.0**-6) & (grid <= 448)]
    mids = (grid[1:] + grid[:-1]) / 2
    edges = torch.cat([grid, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e4))])
    x = torch.cat([sample.view(torch.float32), edges, torch.tensor([float("nan"), -float("nan")])])
    assert x.numel() >= 4096  # the bit path, not the small-tensor cast
    want = x.to(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(_bits(_e4m3_normal_(x.clone())), _bits(want))


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4])
@pytest.mark.parametrize("layout", ["row", "col", "block2d"])
def test_block_maxima_by_pooling_are_amax(fmt, layout):
    a = torch.randn(128, 96 if fmt is NVFP4 else 128, generator=torch.Generator().manual_seed(1)).abs()
    a[3, 5] = float("nan")
    g, dims = _grouped(a, fmt, layout)
    want = g.amax(dim=dims, keepdim=True)
    got = _block_amax(a, fmt, layout)
    assert got.shape == want.shape
    assert torch.equal(got.nan_to_num(-1.0), want.nan_to_num(-1.0))
    assert torch.isnan(got).sum() == 1


def _stochastic_written_out(y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Stochastic E2M1 rounding as the code wrote it before (the |y| < 1 mask as a comparison)."""
    y.clamp_(-6.0, 6.0)
    bits = y.view(torch.int32)
    sign = torch.bitwise_and(bits, -0x80000000)
    bits.bitwise_and_(0x7FFFFFFF)
    small = (y < 1.0).to(torch.float32)
    y.add_(small)
    words = torch.empty((y.numel() + 1) // 2, dtype=torch.int64).random_(generator=gen)
    bits.add_(words.view(torch.int32)[: y.numel()].bitwise_and_(0x3FFFFF).view(y.shape))
    bits.bitwise_and_(-(1 << 22))
    y.sub_(small)
    return bits.bitwise_or_(sign).view(torch.float32)


def test_stochastic_rounding_is_the_formulation_written_out():
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(2)) * 3
    x[0, :4] = torch.tensor([0.0, -0.0, 1.0, -0.999])
    got = round_e2m1_(x.clone(), stochastic=True, generator=torch.Generator().manual_seed(3))
    want = _stochastic_written_out(x.clone(), torch.Generator().manual_seed(3))
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("stochastic", [False, True])
def test_inplace_quantization_computes_in_the_callers_tensor(stochastic):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    kw = dict(stochastic=True, generator=torch.Generator().manual_seed(5)) if stochastic else {}
    want = fake_quantize_fp4(x, NVFP4, "col", **kw)
    buf = x.clone()
    kw = dict(stochastic=True, generator=torch.Generator().manual_seed(5)) if stochastic else {}
    got = fake_quantize_fp4(buf, NVFP4, "col", inplace=True, **kw)
    assert got.data_ptr() == buf.data_ptr()
    assert torch.equal(_bits(got), _bits(want))
    # a tensor that is not float32 (or not contiguous) is copied as before, never written to
    xb = x.bfloat16()
    assert torch.equal(fake_quantize_fp4(xb, NVFP4, inplace=True), fake_quantize_fp4(xb.float(), NVFP4))
    assert torch.equal(xb, x.bfloat16())


@pytest.mark.parametrize("kind", ["fp32", "native"])
def test_rounded_operands_give_the_bf16_product_bit_for_bit(kind):
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(48, 32, generator=g), torch.randn(40, 32, generator=g)
    with cpu_gemm.cpu_bf16_gemm(kind):
        want = cpu_gemm.mm(a.bfloat16(), b.bfloat16().t())
        ra, rb = (
            cpu_gemm.rounded_operand(a.clone(), torch.bfloat16),
            cpu_gemm.rounded_operand(b.clone(), torch.bfloat16),
        )
        assert ra.dtype == (torch.float32 if kind == "fp32" else torch.bfloat16)
        got = cpu_gemm.mm_rounded(ra, rb.t(), torch.bfloat16)
        mixed = cpu_gemm.mm_rounded(ra, b.bfloat16().t(), torch.bfloat16)  # one operand plain BF16
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(mixed, want)


def test_modes_off_keeps_the_gemm_mode_out_for_plain_cpu_tensors():
    a = torch.randn(4, 4).bfloat16()
    with cpu_gemm.cpu_bf16_gemm("fp32") as mode:
        with cpu_gemm.modes_off(a):
            torch.mm(a, a)
        assert mode.calls == 0
        torch.mm(a, a)
        assert mode.calls == 1


def test_rollout_linear_is_the_plain_formulation_and_follows_a_refresh():
    from fp8rl_core.precision.fp4_linear import Fp4RolloutLinear

    g = torch.Generator().manual_seed(7)
    w1, w2, x = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(8, 64, generator=g)
    lin = Fp4RolloutLinear(64, 32, fmt=NVFP4)

    def plain(w: torch.Tensor) -> torch.Tensor:  # quantize both, round to BF16, multiply by the BF16 rule
        xq = fake_quantize_fp4(x.bfloat16().float(), NVFP4).bfloat16()
        return cpu_gemm.mm(xq, fake_quantize_fp4(w, NVFP4).bfloat16().t())

    with torch.autocast("cpu", dtype=torch.bfloat16), cpu_gemm.cpu_bf16_gemm("fp32"):
        lin.refresh_weight(w1, None)
        first = [lin(x.bfloat16()) for _ in range(2)]  # the second call uses the cached float32 weight
        lin.refresh_weight(w2, None)
        second = lin(x.bfloat16())
        want1, want2 = plain(w1), plain(w2)
    assert all(torch.equal(f, want1) for f in first)
    assert torch.equal(second, want2) and not torch.equal(want1, want2)


def test_modes_off_leaves_another_mode_on():
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        seen = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.seen += 1
            return func(*args, **(kwargs or {}))

    a = torch.randn(4, 4)
    with cpu_gemm.cpu_bf16_gemm("fp32"), Count():
        with cpu_gemm.modes_off(a):
            a.abs()
    assert Count.seen == 1
