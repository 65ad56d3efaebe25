"""FP4 formats (NVFP4, MXFP4): hand-computed values, torchao's oracle, SQNR bands,
stochastic rounding and the random Hadamard transform."""

from __future__ import annotations

import warnings

import pytest
import torch

from fp8rl_core.precision.fp4 import (
    E2M1_VALUES,
    MXFP4,
    NVFP4,
    FP4Format,
    dequantize_fp4,
    fake_quantize_fp4,
    hadamard_matrix,
    quantize_fp4,
    random_hadamard,
    random_signs,
    round_e2m1_,
    sqnr_db,
)

pytestmark = pytest.mark.timeout(60)


def test_e2m1_round_to_nearest_even_and_saturation():
    x = torch.tensor(
        [0.0, -0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, 7.0, 100.0, -0.75, -5.0, -9.0]
    )
    want = [0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, -1.0, -4.0, -6.0]
    assert round_e2m1_(x.clone()).tolist() == want


def test_e2m1_grid_is_the_eight_magnitudes():
    y = round_e2m1_(torch.linspace(-8, 8, 4001))
    assert sorted({abs(v) for v in y.tolist()}) == list(E2M1_VALUES)


def test_mxfp4_hand_values():
    x = torch.zeros(4, 32)
    # block 0: amax 7 -> scale 2**(floor(log2 7) - 2) = 1; 7 saturates to 6
    x[0, :9] = torch.tensor([0.25, 0.3, 0.75, 1.25, 2.5, 3.5, 5.0, 7.0, -7.0])
    # block 1: amax 0.1 -> scale 2**(-4 - 2) = 1/64; 0.1 * 64 = 6.4 -> 6 -> 0.09375
    x[1, :2] = torch.tensor([0.1, -0.018])  # -0.018 * 64 = -1.152 -> -1 -> -1/64
    # block 2: all zeros (max 0); block 3: amax 7.9 saturates (floor scale 1)
    x[3, 0] = 7.9
    v, s, ts = quantize_fp4(x, MXFP4)
    assert ts is None
    assert s.flatten().tolist() == [1.0, 2.0**-6, 2.0**-127, 1.0]
    assert v[0, :9].tolist() == [0.0, 0.5, 1.0, 1.0, 2.0, 4.0, 4.0, 6.0, -6.0]
    assert v[1, :2].tolist() == [6.0, -1.0]
    assert v[2].abs().sum() == 0 and v[3, 0] == 6.0
    d = dequantize_fp4(v, s, ts, MXFP4)
    assert d[1, :2].tolist() == [6.0 / 64, -1.0 / 64]
    assert torch.equal(d, fake_quantize_fp4(x, MXFP4))


def test_nvfp4_hand_values():
    # tensor amax 2688 = 448 * 6 -> tensor scale exactly 1
    x = torch.zeros(1, 64)
    x[0, 0] = 2688.0  # block 0: block scale e4m3(2688/6) = 448, element 6
    x[0, 1] = 1000.0  # 1000/448 = 2.23 -> 2 -> 896
    x[0, 16:20] = torch.tensor([6.0, 0.3, 0.75, -5.0])  # block 1: amax 6 -> scale 1, subnormal 0.3 -> 0.5
    x[0, 32:34] = torch.tensor([0.6, 0.05])  # block 2: scale e4m3(0.1) = 0.1015625; 0.6 -> 6
    # block 3: all zeros, block scale floored at 2**-6
    v, s, ts = quantize_fp4(x, NVFP4)
    assert ts.item() == 1.0
    assert s.flatten().tolist() == [448.0, 1.0, 0.1015625, 2.0**-6]
    assert v[0, :2].tolist() == [6.0, 2.0]
    assert v[0, 16:20].tolist() == [6.0, 0.5, 1.0, -4.0]
    assert v[0, 32:34].tolist() == [6.0, 0.5]  # 0.05 / 0.1015625 = 0.49 -> 0.5
    assert v[0, 48:].abs().sum() == 0
    d = fake_quantize_fp4(x, NVFP4)
    assert d[0, :2].tolist() == [2688.0, 896.0]
    assert d[0, 32].item() == pytest.approx(0.609375, abs=0)


def test_nvfp4_tiny_block_underflows_its_scale():
    x = torch.zeros(1, 32)
    x[0, 0] = 2688.0
    x[0, 16] = 1e-4  # (1e-4 / 6) / 1 < 2**-6: scale clamped, element 0.0064 -> 0
    v, s, _ = quantize_fp4(x, NVFP4)
    assert s[0, 1].item() == 2.0**-6 and v[0, 16].item() == 0.0


def test_block2d_uses_one_scale_per_tile():
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    v, s, _ = quantize_fp4(x, NVFP4, "block2d")
    assert s.shape == (2, 2)
    for i in range(2):
        for j in range(2):
            tile = x[16 * i : 16 * i + 16, 16 * j : 16 * j + 16]
            want = (tile.abs().amax() / 6 / (x.abs().amax() / 2688)).to(torch.float8_e4m3fn).float()
            assert s[i, j] == want
    # the same weight quantized in 2-D tiles is the transpose of its transpose's quantization
    assert torch.equal(
        fake_quantize_fp4(x, NVFP4, "block2d").t(), fake_quantize_fp4(x.t().contiguous(), NVFP4, "block2d")
    )
    assert not torch.equal(fake_quantize_fp4(x, NVFP4, "row").t(), fake_quantize_fp4(x.t().contiguous(), NVFP4, "row"))


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=str)
def test_col_layout_is_row_layout_of_the_transpose_bit_for_bit(fmt):
    """The grad-weight operands are quantized in blocks down dim 0 ("col") instead of being
    transposed first: same blocks, same scales, same values, no transposed copy."""
    x = _test_tensor().t().contiguous()  # [256, 64]: zero, outlier and subnormal-range blocks down columns
    v, s, ts = quantize_fp4(x, fmt, "col")
    vt, st, tst = quantize_fp4(x.t().contiguous(), fmt, "row")
    assert s.shape == (256 // fmt.block, 64)
    assert torch.equal(v, vt.t()) and torch.equal(s, st.t()) and (ts is None or torch.equal(ts, tst))
    assert torch.equal(fake_quantize_fp4(x, fmt, "col"), fake_quantize_fp4(x.t().contiguous(), fmt, "row").t())
    assert torch.equal(dequantize_fp4(v, s, ts, fmt, "col"), fake_quantize_fp4(x, fmt, "col"))


@pytest.mark.parametrize(
    "fmt,layout,shape",
    [
        (NVFP4, "row", (4, 24)),
        (MXFP4, "row", (4, 48)),
        (NVFP4, "block2d", (8, 32)),
        (NVFP4, "col", (24, 4)),
        (MXFP4, "col", (48, 4)),
    ],
)
def test_ragged_shapes_are_errors(fmt, layout, shape):
    with pytest.raises(ValueError, match="not whole"):
        quantize_fp4(torch.randn(*shape), fmt, layout)


def _torchao():
    from fp8rl_core.host.quiet_imports import silence_torchao_import_noise

    silence_torchao_import_noise()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
        from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    return f4_unpacked_to_f32, unpack_uint4, get_fp_scale, to_mx, nvfp4_quantize, per_tensor_amax_to_scale


def _test_tensor() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g).mul(4)  # rows of different range
    x[0, :32] = 0  # a zero block in both formats
    x[1, 5] = 300.0  # an outlier
    x[2, :16] *= 1e-6  # blocks in the scale's subnormal range
    return x


def test_mxfp4_bit_exact_with_torchao():
    f4_to_f32, unpack, get_fp_scale, to_mx, _, _ = _torchao()
    x = _test_tensor()
    scale, packed = to_mx(x, torch.float4_e2m1fn_x2, 32)
    v, s, _ = quantize_fp4(x, MXFP4)
    assert torch.equal(f4_to_f32(unpack(packed)).reshape(x.shape), v)
    assert torch.equal(get_fp_scale(scale).reshape(s.shape), s)


def test_nvfp4_bit_exact_with_torchao():
    f4_to_f32, unpack, _, _, nvfp4_quantize, per_tensor_amax_to_scale = _torchao()
    x = _test_tensor()
    pts = per_tensor_amax_to_scale(x.abs().amax())
    scale, packed = nvfp4_quantize(x, 16, pts)
    v, s, ts = quantize_fp4(x, NVFP4)
    assert ts.item() == pts.item()
    assert torch.equal(f4_to_f32(unpack(packed)).reshape(x.shape), v)
    assert torch.equal(scale.to(torch.float32).reshape(s.shape), s)


# SQNR of a 512x512 standard Gaussian (fixed seed). Measured neighbours the bands exclude:
# NVFP4 row: block 32 -> 19.84 dB, block 8 -> 21.35, E8M0 scale at block 16 -> 18.60;
# MXFP4 row: block 16 -> 18.60, block 64 -> 18.94, E4M3 scale -> 19.84;
# NVFP4 16x16 tiles: 32x32 tiles -> 18.78, 8x8 -> 19.48.
@pytest.mark.parametrize(
    "fmt,layout,band",
    [(NVFP4, "row", (20.25, 20.6)), (MXFP4, "row", (18.7, 18.88)), (NVFP4, "block2d", (18.95, 19.25))],
)
def test_sqnr_band_on_gaussian(fmt, layout, band):
    g = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    db = sqnr_db(g, fake_quantize_fp4(g, fmt, layout))
    print(f"SQNR {fmt.name} {layout}: {db:.2f} dB")
    assert band[0] <= db <= band[1]


def test_sqnr_bands_exclude_wrong_block_or_scale():
    g = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    wrong = [FP4Format("x", 32, "e4m3", True), FP4Format("x", 8, "e4m3", True), FP4Format("x", 16, "e8m0", False)]
    for f in wrong:
        db = sqnr_db(g, fake_quantize_fp4(g, f))
        assert not 20.25 <= db <= 20.6, (f, db)
        assert not 18.7 <= db <= 18.88 or f.block == 32, (f, db)


def test_stochastic_rounding_is_unbiased_and_on_grid():
    gen = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.3)
    y = round_e2m1_(x.clone(), stochastic=True, generator=gen)
    assert set(y.unique().tolist()) == {1.0, 1.5}
    assert y.mean().item() == pytest.approx(1.3, abs=3e-3)
    z = round_e2m1_(torch.full((100_000,), -4.6), stochastic=True, generator=gen)
    assert set(z.unique().tolist()) == {-4.0, -6.0} and z.mean().item() == pytest.approx(-4.6, abs=0.02)
    assert round_e2m1_(torch.tensor([7.0, -0.0, 6.0]), stochastic=True, generator=gen).tolist() == [6.0, 0.0, 6.0]


@pytest.mark.parametrize(
    "v,lo,hi",
    [
        (0.1, 0.0, 0.5),
        (0.3, 0.0, 0.5),
        (0.7, 0.5, 1.0),
        (0.99, 0.5, 1.0),
        (1.75, 1.5, 2.0),
        (2.2, 2.0, 3.0),
        (3.9, 3.0, 4.0),
        (5.5, 4.0, 6.0),
        (-0.3, -0.5, 0.0),
        (-2.2, -3.0, -2.0),
    ],
)
def test_stochastic_rounding_rounds_up_with_probability_frac_in_every_binade(v, lo, hi):
    """The bit trick (22 random bits added below E2M1's mantissa bit, then truncated) is
    exact in every binade, the subnormal one (spacing 0.5 below 1) and the carries into the
    next exponent (1.75 -> 2) included; grid values and zeros stay put."""
    n = 200_000
    y = round_e2m1_(torch.full((n,), v), stochastic=True, generator=torch.Generator().manual_seed(1))
    assert set(y.unique().tolist()) <= {lo, hi}
    p_up = (y == (hi if v > 0 else lo)).float().mean().item()
    want = (abs(v) - min(abs(lo), abs(hi))) / abs(hi - lo)
    assert p_up == pytest.approx(want, abs=4 * (want * (1 - want) / n) ** 0.5 + 1e-6)
    grid = torch.tensor([-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert torch.equal(round_e2m1_(grid.clone(), stochastic=True, generator=torch.Generator().manual_seed(2)), grid)


def test_stochastic_rounding_is_reproducible_from_the_generator_state():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64)
    state = gen.get_state()
    a = fake_quantize_fp4(x, NVFP4, stochastic=True, generator=gen)
    b = fake_quantize_fp4(x, NVFP4, stochastic=True, generator=gen)
    gen.set_state(state)
    assert torch.equal(fake_quantize_fp4(x, NVFP4, stochastic=True, generator=gen), a)
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="Generator"):
        fake_quantize_fp4(x, NVFP4, stochastic=True)


def test_random_hadamard_is_orthogonal_and_preserves_products():
    h = hadamard_matrix(16)
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6)
    gen = torch.Generator().manual_seed(0)
    signs = random_signs(16, gen)
    assert set(signs.tolist()) <= {-1.0, 1.0}
    g, x = torch.randn(64, 24), torch.randn(64, 40)
    assert torch.allclose(random_hadamard(g, signs).t() @ random_hadamard(x, signs), g.t() @ x, atol=1e-4)
    with pytest.raises(ValueError, match="tiles"):
        random_hadamard(torch.randn(20, 4), signs)
