"""The compiled kernels of the exact GEMM (``fp8rl_core/cpu_numerics/exact_gemm.cpp``) give the
tensor-by-tensor path's bits: the grid of every operand, the output's rounding, and whole GEMMs with
their gradients, on values chosen to hit every edge (zeros of both signs, subnormal operands and
products, ties, rows whose largest value is tiny or huge, infinities, BF16 rounding carries)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp8rl_core.cpu_numerics import exact_kernels
from fp8rl_core.cpu_numerics import portable_math as pm

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def kernels():
    ops = exact_kernels.ops()
    if ops is None:
        pytest.skip(f"exact GEMM kernels: {exact_kernels.status()}")
    return ops


@pytest.fixture
def tensor_path(monkeypatch):
    """Run ``portable_math`` without the kernels (as where they cannot be built)."""

    def use():
        monkeypatch.setitem(exact_kernels._STATE, "ops", None)
        monkeypatch.setitem(exact_kernels._STATE, "tried", True)

    return use


def _edge_values(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    flat = x.view(-1, shape[-1])
    flat[0, :] = 0.0  # an all-zero row
    flat[1, :3] = torch.tensor([-0.0, 0.0, -0.0])
    flat[2, :] = 1e-42  # a row of subnormals: its scale is clamped at 2**127
    flat[3, :] = torch.randn(shape[-1], generator=g) * 1e-38
    flat[4, :4] = torch.tensor([1.5, 2.5, -0.5, -2.5])  # ties to even once scaled
    flat[5, :2] = torch.tensor([3.0e38, -1.0])
    flat[6, :2] = torch.tensor([float("inf"), 1.0])
    flat[7, :3] = torch.tensor([1.0, 1.00390625, 1.01171875])  # BF16 ties and carries
    flat[8, :2] = torch.tensor([2.0**-126, 2.0**-149])
    flat[9, :4] = torch.tensor([2.0**30, 1e-42, -1e-45, -1e-40])  # scaled down: subnormal and signed-zero products
    flat[10, ::3] = -1e-44  # subnormal operands among normal ones (a gradient's tail)
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    width = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("dim", [-1, -2])
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("layout", ["plain", "transposed", "batched", "bf16-held"])
def test_the_grid_equals_the_tensor_path_bit_for_bit(kernels, tensor_path, levels, dim, bf16, layout):
    x = _edge_values(levels * 10 + (dim == -1), (2, 12, 37) if layout == "batched" else (12, 37))
    if layout == "transposed":
        x = x.t().contiguous().t()
    if layout == "bf16-held":
        x = x.bfloat16()
    fast, fast_up = pm._levels(x, dim, levels, bf16)
    tensor_path()
    slow, slow_up = pm._levels(x, dim, levels, bf16)
    assert _same_bits(fast_up, slow_up)
    assert len(fast) == len(slow) == levels
    for f, s in zip(fast, slow):
        assert _same_bits(f, s)


@pytest.mark.parametrize("to_bf16", [False, True])
def test_the_output_rounding_equals_the_tensor_path_bit_for_bit(kernels, tensor_path, to_bf16):
    g = torch.Generator().manual_seed(3)
    out = torch.randn(2, 9, 33, generator=g, dtype=torch.float64) * 2.0**60
    out[0, 0, :4] = torch.tensor([0.0, -0.0, 2.0**-200, -(2.0**-160)])  # underflow after the scaling
    out[0, 1, :3] = torch.tensor([float("inf"), 1.0 + 2.0**-24, 1.0 + 3 * 2.0**-24])  # float32 ties
    ua = torch.exp2(torch.randint(-126, 128, (2, 9, 1), generator=g).float())
    ub = torch.exp2(torch.randint(-126, 128, (1, 1, 33), generator=g).float())
    fast = pm._finish(out, ua, ub, to_bf16)
    tensor_path()
    assert _same_bits(fast, pm._finish(out, ua, ub, to_bf16))


@pytest.mark.parametrize("levels", [1, 2])
def test_a_gemm_and_its_gradients_equal_the_tensor_path(kernels, tensor_path, levels):
    g = torch.Generator().manual_seed(levels)
    dtype = torch.bfloat16 if levels == 1 else torch.float32
    a = (torch.randn(3, 40, 64, generator=g) * 3).to(dtype)
    w = (torch.randn(48, 64, generator=g) * 0.05).to(dtype)
    q, k = (torch.randn(2, 4, 24, 16, generator=g).to(dtype) for _ in range(2))

    def run():
        a_, w_, q_, k_ = (t.detach().clone().requires_grad_() for t in (a, w, q, k))
        y = pm.exact_matmul(a_, w_.t(), levels, to_bf16=levels == 1)
        s = pm.exact_matmul(q_, k_.transpose(-1, -2), levels)
        (y.float().square().sum() + s.sin().sum()).backward()
        return y, s, a_.grad, w_.grad, q_.grad, k_.grad

    fast = run()
    tensor_path()
    slow = run()
    for f, s in zip(fast, slow):
        assert _same_bits(f, s)


def test_the_kernels_do_what_the_switch_says(kernels):
    assert "compiled" in exact_kernels.status()
    assert exact_kernels.build_dir().is_dir()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.grid(torch.zeros(1, 2, 2, dtype=torch.float64), 2, 1, False)


@pytest.mark.parametrize("shape", [(5, 64), (2, 5, 64)])
def test_a_gemm_under_the_bf16_rule_returns_a_new_tensor_callers_may_write_in_place(shape):
    """A BF16 GEMM's output is a tensor of its own: a view (of the exact GEMM's output) would make
    FSDP warn on a module's output and autograd refuse an in-place op on it."""
    import torch.nn.functional as F

    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm

    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(48, 64, generator=g, requires_grad=True)
    v = torch.randn(64, generator=g, requires_grad=True)
    with cpu_bf16_gemm("portable"), torch.autocast("cpu", dtype=torch.bfloat16):
        for y in (F.linear(x, w), x @ w.t(), torch.matmul(x, v)):
            assert y.dtype == torch.bfloat16 and not y._is_view()
            y.mul_(2.0)  # an in-place op on a view of a custom Function's output raises here
            y.float().sum().backward()
    assert x.grad is not None and w.grad is not None and v.grad is not None


def test_a_build_never_leaves_a_library_being_written_where_other_processes_load_it(kernels, tmp_path, monkeypatch):
    """While the library is compiled and linked, the name other processes load (``build_dir()/LIBRARY``,
    which they take as a finished build) holds nothing; afterwards it holds the whole library. A linker
    writing straight into that name let a process that started a moment later load half a file."""
    import shutil

    import torch.utils.cpp_extension as cpp_extension

    real = exact_kernels.build_dir() / "fp8rl_exact_gemm.so"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    final = exact_kernels.build_dir() / "fp8rl_exact_gemm.so"
    seen = {}

    def linking(name, sources, build_directory, **kwargs):  # the linker, halfway and then done
        out = Path(build_directory) / "fp8rl_exact_gemm.so"
        out.write_bytes(real.read_bytes()[:4096])
        seen["final while linking"] = final.exists()
        shutil.copyfile(real, out)

    monkeypatch.setattr(cpp_extension, "load", linking)
    exact_kernels._load()
    assert seen == {"final while linking": False}
    assert final.read_bytes() == real.read_bytes()
    assert [p.name for p in final.parent.iterdir() if p.name.endswith(".part")] == []
