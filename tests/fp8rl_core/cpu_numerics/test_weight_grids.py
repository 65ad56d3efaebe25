"""A weight's grid made once per generation (``portable_math.reuse_weight_grids``) gives
the bits of making it at every GEMM, and is made again whenever the weight may have changed."""

from __future__ import annotations

import pytest
import torch

from fp8rl_core.cpu_numerics import portable_math as pm
from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm

pytestmark = pytest.mark.timeout(60)


def _layer() -> tuple[torch.nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 48), torch.randn(5, 7, 64) * torch.exp(torch.randn(5, 7, 64))


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-rule", "float32"])
def test_a_reused_grid_gives_the_bits_of_making_it_again(autocast: bool) -> None:
    lin, x = _layer()
    with cpu_bf16_gemm("portable"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), torch.no_grad():
        ref = lin(x)
        with pm.reuse_weight_grids() as grids:
            made, hits = grids.made, grids.hits
            first, again = lin(x), lin(x[:, :1])  # a prefill, then a decoding step
            assert (grids.made - made, grids.hits - hits) == (1, 1)
    assert ref.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.equal(first, ref) and torch.equal(again, ref[:, :1])


@pytest.mark.parametrize("change", ["optimizer_step", "load_state_dict", "copy_", "new_storage"])
def test_a_weight_changed_inside_the_scope_is_put_on_its_grid_again(change: str) -> None:
    lin, x = _layer()
    other = torch.nn.Linear(64, 48)
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1)
    with cpu_bf16_gemm("portable"), torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x).float().square().sum().backward()  # a gradient for the optimizer's step (no scope open)
        with pm.reuse_weight_grids(), torch.no_grad():
            before = lin(x)
            if change == "optimizer_step":
                opt.step()
            elif change == "load_state_dict":
                lin.load_state_dict(other.state_dict())
            elif change == "copy_":
                lin.weight.copy_(other.weight)
            else:
                lin.weight = torch.nn.Parameter(other.weight.detach().clone())
            after = lin(x)
        with torch.no_grad():
            fresh = lin(x)  # outside the scope: the weight's grid made from its values now
    assert not torch.equal(before, after)
    assert torch.equal(after, fresh)


def test_the_store_is_emptied_when_the_outermost_scope_ends() -> None:
    lin, x = _layer()
    with cpu_bf16_gemm("portable"), torch.no_grad():
        with pm.reuse_weight_grids() as outer:
            with pm.reuse_weight_grids() as inner:
                lin(x)
            assert inner is outer and len(outer.store) == 1  # a nested scope shares the outer store
            lin(x)
            assert len(outer.store) == 1
        assert outer.store == {} and outer.depth == 0
        made = outer.made
        lin(x)  # no scope: nothing kept
        assert outer.made == made and outer.store == {}


def test_a_gemm_that_takes_the_weights_gradient_makes_its_own_grid() -> None:
    lin, x = _layer()
    with cpu_bf16_gemm("portable"), torch.autocast("cpu", dtype=torch.bfloat16), pm.reuse_weight_grids() as grids:
        made = grids.made
        out = lin(x)  # grad enabled, the weight requires grad: the autograd path, not the store
        assert grids.made == made and grids.store == {}
        out.float().sum().backward()
    assert lin.weight.grad is not None
