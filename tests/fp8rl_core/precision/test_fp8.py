"""FP8 numerics (fp8rl_core.precision.fp8) and the emulated linears (fp8rl_core.precision.fp8_linear).

References: real FP8 casts, a hand-written loop, torch._scaled_mm on CPU (tiny
shapes only: it is ~10^4x slower than a BF16 matmul), torchao's own
quantization functions and its emulate=True Float8Linear.
"""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch
from torch import nn

from fp8rl_core.precision.conversion import quiet_import_torchao_float8
from fp8rl_core.precision.fp8 import (
    E4M3,
    E5M2,
    amax_to_qscale,
    dequantize,
    fake_quantize,
    fp8_format,
    quantize,
    round_down_to_power_of_2,
    round_to_fp8_grid_,
    scaled_mm_emulated,
    sqnr_db,
)
from fp8rl_core.precision.fp8_linear import Fp8Recipe, Fp8RolloutLinear, Fp8TrainingLinear, quantize_operand

FORMATS = [E4M3, E5M2]
GRANS = ["tensorwise", "rowwise", "blockwise"]


@pytest.fixture(autouse=True)
def _lenient_shapes():
    """These tests check the emulation's own (lenient) numerics on odd shapes against torchao's
    emulate path; the strict kernel-shape mode (on in the suite) is tested in test_train_scaleout."""
    from fp8rl_core.precision.fp8_linear import set_strict_shapes

    prev = set_strict_shapes(False)
    yield
    set_strict_shapes(prev)


def _all_codes(fmt):
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.dtype).float()
    return v[torch.isfinite(v)].unique()  # sorted finite grid values


def _outlier_data(seed=0):
    """[256, 512] activations with row scales over 2**[-8, 8] and rare x100 outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 512, generator=g) * torch.exp2(torch.randint(-8, 9, (256, 1), generator=g).float())
    spikes = torch.rand(256, 512, generator=g) < 1e-3
    return torch.where(spikes, x * 100, x)


# --------------------------------------------------------------------------- grid rounding


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_round_to_grid_is_bit_exact_with_a_real_cast(fmt):
    codes = _all_codes(fmt)
    mids = (codes[1:] + codes[:-1]) / 2  # exact ties: ties-to-even must match
    g = torch.Generator().manual_seed(1)
    cases = [
        codes,
        mids,
        torch.randn(100_000, generator=g) * fmt.max / 8,
        torch.randn(100_000, generator=g) * fmt.min_normal * 4,  # subnormal range
        mids * (1 + 1e-6 * torch.randn(mids.shape, generator=g)),
        torch.tensor([0.0, -0.0, fmt.max, -fmt.max, 1e-30]),
    ]
    for v in cases:
        v = v.clamp(-fmt.max, fmt.max)
        assert torch.equal(round_to_fp8_grid_(v.clone(), fmt), v.to(fmt.dtype).float())


def test_round_to_grid_rejects_non_float32():
    with pytest.raises(TypeError, match="float32"):
        round_to_fp8_grid_(torch.ones(3, dtype=torch.bfloat16), E4M3)


# --------------------------------------------------------------------------- scales


def test_scales_amax_floor_and_power_of_two():
    amax = torch.tensor([0.0, 1.0, 3.0, 448.0 * 2**-20])
    qs = amax_to_qscale(amax, E4M3)
    assert torch.isfinite(qs).all() and qs[0] == torch.tensor(448.0 / 1e-12, dtype=torch.float32)
    assert qs[1] == 448.0
    p2 = amax_to_qscale(amax, E4M3, round_scales_to_power_of_2=True)
    assert torch.equal(p2, torch.exp2(torch.floor(torch.log2(p2))))  # powers of two
    assert (p2 <= qs).all() and (p2 > qs / 2).all()  # rounded down, never overflowing
    just_below = torch.nextafter(torch.tensor([8.0]), torch.tensor([0.0]))
    assert round_down_to_power_of_2(just_below).item() == 4.0  # log2 would round this up to 8


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_quantize_saturates_and_handles_zeros(fmt):
    x = torch.tensor([[1.0, -2.0, 3.0], [0.0, 0.0, 0.0]])
    q, qs = quantize(x, "rowwise", dtype=fmt.dtype)
    assert torch.isfinite(q.float()).all() and torch.equal(q[1].float(), torch.zeros(3))
    assert q[0].float().abs().max() == fmt.max  # the row amax maps to fp8_max
    # a scale from elsewhere (smaller amax) must saturate, not overflow to inf/nan
    y = (torch.tensor([1e9, -1e9]) * 1.0).to(torch.float32)
    sat = fake_quantize(torch.cat([y, torch.ones(2)]).reshape(2, 2), "tensorwise", dtype=fmt.dtype)
    assert torch.isfinite(sat).all()
    assert fake_quantize(torch.zeros(4, 4), "rowwise", dtype=fmt.dtype).abs().sum() == 0


# --------------------------------------------------------------------------- fake_quantize


def _loop_reference(x: torch.Tensor, fmt, block) -> torch.Tensor:
    """Group by group with python loops: the definition, written out."""
    out = torch.empty_like(x, dtype=torch.float32)
    rows, cols = x.shape
    for r0 in range(0, rows, block[0]):
        for c0 in range(0, cols, block[1]):
            tile = x[r0 : r0 + block[0], c0 : c0 + block[1]].double()
            amax = max(tile.abs().max().item(), 1e-12)
            qs = torch.tensor(fmt.max / amax, dtype=torch.float64).float()  # float64 divide, float32 scale
            q = (tile.float() * qs).clamp(-fmt.max, fmt.max).to(fmt.dtype).float()
            out[r0 : r0 + block[0], c0 : c0 + block[1]] = q / qs
    return out.to(x.dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_matches_loop_reference(fmt, dtype):
    x = (torch.randn(13, 21, generator=torch.Generator().manual_seed(2)) * 7).to(dtype)
    cases = {"tensorwise": (13, 21), "rowwise": (1, 21)}
    for gran, block in cases.items():
        assert torch.equal(fake_quantize(x, gran, dtype=fmt.dtype), _loop_reference(x, fmt, block))
    for block in [(4, 8), (1, 8), (8, 1), (13, 21), (128, 128)]:  # ragged edges in most
        got = fake_quantize(x, "blockwise", dtype=fmt.dtype, block=block)
        assert torch.equal(got, _loop_reference(x, fmt, block)), block


@pytest.mark.parametrize("gran", GRANS)
@pytest.mark.parametrize("pow2", [False, True])
def test_fake_quantize_equals_quantize_dequantize(gran, pow2):
    x = _outlier_data().reshape(2, 128, 512)[:, :100, :300]  # 3-D, ragged for 128-blocks
    for fmt in FORMATS:
        for dtype in (torch.float32, torch.bfloat16):
            xx = x.to(dtype)
            q, qs = quantize(xx, gran, dtype=fmt.dtype, round_scales_to_power_of_2=pow2)
            ref = dequantize(q, qs, gran, out_dtype=dtype)
            got = fake_quantize(xx, gran, dtype=fmt.dtype, round_scales_to_power_of_2=pow2)
            assert got.shape == xx.shape and got.dtype == dtype
            assert torch.equal(got, ref)


@pytest.mark.parametrize("gran", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("pow2", [False, True])
def test_fake_quantize_matches_torchao_float8_casts(gran, pow2):
    quiet_import_torchao_float8()
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    x = _outlier_data(3)
    for fmt in FORMATS:
        kw = dict(scaling_granularity=ScalingGranularity.TENSORWISE)
        if gran == "rowwise":
            kw = dict(scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1)
        scale = tensor_to_scale(x, fmt.dtype, round_scales_to_power_of_2=pow2, **kw)
        ao = to_fp8_saturated(x * scale, fmt.dtype).float() / scale
        q, qs = quantize(x, gran, dtype=fmt.dtype, round_scales_to_power_of_2=pow2)
        assert torch.equal(qs, scale)
        assert torch.equal(fake_quantize(x, gran, dtype=fmt.dtype, round_scales_to_power_of_2=pow2), ao)


def test_blockwise_codes_match_torchao_affine_float8():
    """torchao's inference primitives divide by amax/fp8_max where we multiply by its
    reciprocal (training convention), so a few codes may differ by one FP8 step."""
    quiet_import_torchao_float8()
    from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

    x = _outlier_data(4)
    for block in [(1, 128), (128, 128)]:
        scale = _choose_scale_float8(x, list(block), torch.float8_e4m3fn)
        ao = _quantize_affine_float8(x, scale, torch.float8_e4m3fn)
        q, qs = quantize(x, "blockwise", block=block)
        torch.testing.assert_close(qs.reciprocal(), scale, rtol=1e-6, atol=0)
        codes_ours, codes_ao = q.view(torch.uint8).int(), ao.view(torch.uint8).int()
        diff = (codes_ours - codes_ao).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


# --------------------------------------------------------------------------- SQNR


def test_sqnr_hand_value():
    assert sqnr_db(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.5])) == pytest.approx(20.0)
    assert sqnr_db(torch.ones(3), torch.ones(3)) == math.inf


def test_sqnr_bands_and_granularity_order_with_outliers():
    gauss = torch.randn(256, 512, generator=torch.Generator().manual_seed(5)).bfloat16()
    for gran in GRANS:  # a 3-bit (2-bit) mantissa gives ~31 (~25) dB on well-scaled data
        assert 29.0 < sqnr_db(gauss, fake_quantize(gauss, gran)) < 33.0
        assert 23.0 < sqnr_db(gauss, fake_quantize(gauss, gran, dtype=torch.float8_e5m2)) < 27.0
    x = _outlier_data().bfloat16()
    fq = {
        "tensorwise": fake_quantize(x, "tensorwise"),
        "rowwise": fake_quantize(x, "rowwise"),
        "blockwise": fake_quantize(x, "blockwise", block=(1, 128)),
    }
    whole = {k: sqnr_db(x, v) for k, v in fq.items()}
    per_token = {k: statistics.median(sqnr_db(x[i], v[i]) for i in range(x.shape[0])) for k, v in fq.items()}
    for s in (whole, per_token):
        assert s["blockwise"] >= s["rowwise"] > s["tensorwise"] + 3.0
    # one outlier-dominated scale pushes the small rows into subnormals: a typical
    # token loses ~6 dB under tensorwise scaling, none under rowwise / blockwise
    assert per_token["tensorwise"] < 28.0 and 30.0 < per_token["rowwise"] < 33.0


# --------------------------------------------------------------------------- scaled mm


def _scaled_mm_or_skip(*args, **kw):
    try:
        return torch._scaled_mm(*args, **kw)
    except (RuntimeError, NotImplementedError) as e:  # pragma: no cover - build dependent
        pytest.skip(f"torch._scaled_mm unavailable on this build: {e}")


@pytest.mark.parametrize("gran", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_emulated_matches_torch_scaled_mm(gran, out_dtype):
    g = torch.Generator().manual_seed(6)
    a, b = torch.randn(16, 32, generator=g) * 3, torch.randn(48, 32, generator=g)
    qa, sa = quantize(a, gran)  # [16, 32], sa [] or [16, 1]
    qb, sb = quantize(b, gran)  # [48, 32], sb [] or [48, 1]
    scale_a, scale_b = sa.reciprocal(), sb.reciprocal().t() if gran == "rowwise" else sb.reciprocal()
    ref = _scaled_mm_or_skip(qa, qb.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    got = scaled_mm_emulated(qa, qb.t(), scale_a, scale_b, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    # float32 accumulation in a different order: a few float32 ulps of the sum of |terms|
    bound = (qa.float().abs() @ qb.float().abs().t()) * scale_a * scale_b * 2**-20
    if out_dtype == torch.bfloat16:
        bound = bound + ref.float().abs() * 2**-8  # plus one BF16 rounding step
    assert ((got.float() - ref.float()).abs() <= bound).all()


def test_scaled_mm_emulated_rejects_bad_input():
    q = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="expected a"):
        scaled_mm_emulated(q, q, torch.ones(()), torch.ones(()))
    with pytest.raises(TypeError, match="FP8"):
        scaled_mm_emulated(torch.zeros(4, 8), q.t(), torch.ones(()), torch.ones(()))
    with pytest.raises(ValueError, match="scale_a"):
        scaled_mm_emulated(q, q.t(), torch.ones(3, 1), torch.ones(()))


def test_bad_input_errors():
    x = torch.randn(4, 4)
    with pytest.raises(ValueError, match="valid: tensorwise, rowwise, blockwise"):
        fake_quantize(x, "columnwise")
    with pytest.raises(TypeError, match="float"):
        fake_quantize(torch.ones(4, 4, dtype=torch.int32), "tensorwise")
    with pytest.raises(ValueError, match="unsupported FP8 dtype"):
        fake_quantize(x, "tensorwise", dtype=torch.int8)
    with pytest.raises(ValueError, match="block"):
        fake_quantize(x, "blockwise", block=(0, 128))
    with pytest.raises(ValueError, match=">= 2 dims"):
        fake_quantize(torch.randn(8), "blockwise")
    assert fp8_format(torch.float8_e5m2).max == 57344.0


# --------------------------------------------------------------------------- emulated linears


def _fq(gran, **kw):
    return lambda x, fmt, p2: fake_quantize(x, gran, dtype=fmt.dtype, round_scales_to_power_of_2=p2, **kw)


_LAYOUT_TO_FQ = {  # quantize_operand layout -> the same groups through the public fake_quantize
    "tensor": _fq("tensorwise"),
    "row": _fq("rowwise"),
    "col": lambda x, fmt, p2: _fq("rowwise")(x.t(), fmt, p2).t(),
    "tile_row": _fq("blockwise", block=(1, 128)),
    "tile_col": _fq("blockwise", block=(128, 1)),
    "block": _fq("blockwise"),
}


@pytest.mark.parametrize("layout", list(_LAYOUT_TO_FQ))
@pytest.mark.parametrize("chunk", [4096, None], ids=["chunked", "whole"])
def test_quantize_operand_equals_fake_quantize(layout, chunk, monkeypatch):
    import fp8rl_core.precision.fp8_operands as fo

    if chunk is not None:
        monkeypatch.setattr(fo, "_CHUNK_ELEMS", chunk)  # several chunks, ragged last chunk
    x = _outlier_data(7)[:200, :300]
    for fmt in FORMATS:
        for p2 in (False, True):
            v, post = quantize_operand(x, fmt, layout, pow2=p2, compute_dtype=torch.float32, dequantize=True)
            assert post is None and torch.equal(v, _LAYOUT_TO_FQ[layout](x, fmt, p2))
    v, post = quantize_operand(x, E4M3, "row", pow2=False, compute_dtype=torch.bfloat16)
    assert v.dtype == torch.bfloat16 and post.shape == (200, 1)  # raw FP8 values, exact in BF16
    assert torch.equal(round_to_fp8_grid_(v.float(), E4M3), v.float())
    torch.testing.assert_close(v.float() * post, _LAYOUT_TO_FQ["row"](x, E4M3, False), rtol=2e-7, atol=0)


@pytest.mark.parametrize("layout", ["tensor", "row", "block"])
def test_gpu_sized_chunks_change_the_op_count_not_the_values(layout, monkeypatch):
    """The memory plan rounds its fake CPU tensors in a GPU's chunks (64x the CPU's): same values, fewer ops."""
    import fp8rl_core.precision.fp8_operands as fo

    monkeypatch.setattr(fo, "_CHUNK_ELEMS", 4096)  # CPU: many chunks; GPU-sized: one (the whole-tensor path)
    x = _outlier_data(7)[:200, :300]
    calls = []
    monkeypatch.setattr(fo, "_round_in_place_", lambda *a, _f=fo._round_in_place_, **k: calls.append(1) or _f(*a, **k))
    v_cpu, s_cpu = quantize_operand(x, E4M3, layout, pow2=False, compute_dtype=torch.float32, dequantize=True)
    n_cpu = len(calls)
    with fo.gpu_sized_chunks():
        v_gpu, s_gpu = quantize_operand(x, E4M3, layout, pow2=False, compute_dtype=torch.float32, dequantize=True)
    assert torch.equal(v_cpu, v_gpu) and s_cpu is None and s_gpu is None
    assert n_cpu > 1 and len(calls) - n_cpu == 1
    assert fo._chunk_elems(x.device) == 4096


def test_rounding_runs_on_the_calling_thread_and_restores_the_thread_count():
    torch.set_num_threads(2)
    seen = []
    original = torch.Tensor.add_

    def spy(self, *a, **k):
        seen.append(torch.get_num_threads())
        return original(self, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "add_", spy)
        quantize_operand(torch.randn(300, 200), E4M3, "row", pow2=False, compute_dtype=torch.bfloat16)
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2


@pytest.mark.parametrize("chunk", [64, None], ids=["chunked", "whole"])
def test_matmul_output_scaling(chunk, monkeypatch):
    """Per-row / per-column / scalar dequantization scales applied to a BF16 matmul output
    in float32: the result is the float64 product up to BF16 roundings."""
    import fp8rl_core.precision.fp8_operands as fo

    if chunk is not None:
        monkeypatch.setattr(fo, "_CHUNK_ELEMS", chunk)
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(37, 16, generator=g).bfloat16(), torch.randn(16, 24, generator=g).bfloat16()
    rows, cols, scalar = torch.rand(37, 1, generator=g) + 0.5, torch.rand(1, 24, generator=g) + 0.5, torch.tensor(0.7)
    exact = a.double() @ b.double()
    for pa, pb in ((rows, cols), (rows, scalar), (scalar, cols), (None, cols), (rows, None), (scalar, scalar)):
        ref = exact * (1.0 if pa is None else pa.double()) * (1.0 if pb is None else pb.double())
        got = fo._mm(a, b, pa, pb)
        assert got.dtype == torch.bfloat16
        assert ((got.double() - ref).abs() <= ref.abs() * 2**-7 + 1e-6).all()  # <= 2 BF16 roundings


def _torchao_linear(lin: nn.Linear, recipe: str):
    float8 = quiet_import_torchao_float8()
    import dataclasses

    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return float8.convert_to_float8_training(nn.Sequential(copy.deepcopy(lin)), config=config)[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("autocast", [False, True])
def test_training_linear_matches_torchao_emulate(recipe, autocast):
    """Oracle: torchao's Float8Linear(emulate=True), forward and both gradients."""
    torch.manual_seed(8)
    lin = nn.Linear(128, 96, bias=False)
    ao = _torchao_linear(lin, recipe)
    ours = Fp8TrainingLinear.from_linear(copy.deepcopy(lin), Fp8Recipe.named(recipe))
    x = torch.randn(4, 50, 128) * torch.exp(torch.randn(4, 50, 1))
    xa, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ya, yo = ao(xa), ours(xo)
    assert ya.dtype == yo.dtype == (torch.bfloat16 if autocast else torch.float32)
    g = torch.randn(ya.shape)
    (ya.float() * g).sum().backward()
    (yo.float() * g).sum().backward()
    # rowwise scales are powers of two (folded exactly): bit-equal. Tensorwise applies
    # its scale to the BF16 matmul output: one extra BF16 rounding at most.
    tol = 0.0 if (recipe == "rowwise" or not autocast) else 2**-7
    for got, ref in ((yo, ya), (xo.grad, xa.grad), (ours.weight.grad, ao.weight.grad)):
        err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
        assert err <= max(tol, 1e-6), err


def test_blockwise_linear_matches_fake_quantized_reference():
    """Forward and gradients of the blockwise linear equal float64 matmuls of operands
    fake-quantized as DeepSeek-V3 does (x 1x128, W 128x128, dy 1x128 / 128x1)."""
    torch.manual_seed(9)
    lin = nn.Linear(256, 128, bias=True)
    ours = Fp8TrainingLinear.from_linear(lin, Fp8Recipe.named("blockwise"))
    x = (torch.randn(300, 256) * torch.exp(torch.randn(300, 1))).requires_grad_()
    y = ours(x)  # float32 compute without autocast
    g = torch.randn(300, 128)
    y.backward(g)
    fq = lambda t, block: fake_quantize(t.detach(), "blockwise", block=block).double()  # noqa: E731
    w = lin.weight.detach()
    ref_y = fq(x, (1, 128)) @ fq(w, (128, 128)).t() + lin.bias.double()
    ref_gx = fq(g, (1, 128)) @ fq(w, (128, 128))
    ref_gw = fq(g, (128, 1)).t() @ fq(x, (128, 1))
    for got, ref in ((y, ref_y), (x.grad, ref_gx), (lin.weight.grad, ref_gw), (lin.bias.grad, g.sum(0).double())):
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("scheme", ["per_tensor", "per_block"])
def test_rollout_linear_w8a8_numerics(scheme):
    """vLLM-style W8A8: per-token (or 1x128) activations x per-tensor (or 128x128) weights."""
    torch.manual_seed(10)
    w, b = torch.randn(256, 256) * 0.05, torch.randn(256) * 0.1
    lin = Fp8RolloutLinear(256, 256, scheme=scheme)
    lin.refresh_weight(w, b, dtype=torch.bfloat16)
    x = (torch.randn(3, 40, 256) * torch.exp(torch.randn(3, 40, 1))).bfloat16()
    out = lin(x)
    assert out.shape == (3, 40, 256) and out.dtype == torch.bfloat16
    if scheme == "per_tensor":
        ref = fake_quantize(x.float(), "rowwise").double() @ fake_quantize(w, "tensorwise").double().t()
    else:
        xq = fake_quantize(x.float().reshape(120, 256), "blockwise", block=(1, 128)).reshape(3, 40, 256)
        ref = xq.double() @ fake_quantize(w, "blockwise").double().t()
    ref = ref + b.double()
    rel = (out.double() - ref).abs() / ref.abs().amax(-1, keepdim=True)  # per token, vs its largest output
    assert rel.max() < 2**-6  # a few BF16 roundings (matmul output, scale, bias), no FP8-size error
    assert sqnr_db(ref, out) > 45.0
    with pytest.raises(RuntimeError, match="refresh_weight"):
        Fp8RolloutLinear(8, 8, scheme=scheme)(torch.zeros(1, 8))
    with pytest.raises(ValueError, match="scheme"):
        Fp8RolloutLinear(8, 8, scheme="per_channel")
