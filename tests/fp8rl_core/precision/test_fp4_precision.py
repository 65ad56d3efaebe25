"""FP4 training and rollout modes (fp8rl_core.precision.fp4_linear, fp8rl_core.precision.fp4_modes)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_precision import LINEARS_PER_LAYER, tiny_config, toy_batch, train_steps
from torch import nn
from transformers import Qwen3ForCausalLM

from fp8rl_core.precision.autocast import autocast_context
from fp8rl_core.precision.bf16_pass import bf16_shadow
from fp8rl_core.precision.conversion import TRAIN_PRECISIONS, convert_for_training
from fp8rl_core.precision.fp4 import MXFP4, NVFP4, fake_quantize_fp4, sqnr_db
from fp8rl_core.precision.fp4_linear import (
    Fp4Recipe,
    Fp4RolloutLinear,
    Fp4State,
    Fp4TrainingLinear,
    fp4_rng_state,
    load_fp4_rng_state,
)
from fp8rl_core.precision.rollout import ROLLOUT_PRECISIONS, convert_for_rollout

pytestmark = pytest.mark.timeout(120)
FP4_MODES = ["nvfp4", "mxfp4"]


@pytest.fixture(scope="module")
def base_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_config()).eval()


@pytest.fixture(autouse=True)
def _one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def test_modes_are_registered():
    assert {"nvfp4", "mxfp4"} <= set(TRAIN_PRECISIONS.names())
    assert {"nvfp4_w4a4", "mxfp4_w4a4"} <= set(ROLLOUT_PRECISIONS.names())


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4])
def test_linear_forward_and_grads_follow_the_recipe(fmt):
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(40, 64, requires_grad=True)  # 40 tokens: not whole Hadamard tiles (padded inside)
    state = Fp4State(0)
    fp4 = Fp4TrainingLinear.from_linear(lin, Fp4Recipe(fmt), state)
    y = fp4(x)
    # forward: 1 x b activation blocks, b x b weight tiles, nearest-even
    want = (
        fake_quantize_fp4(x.detach(), fmt, "row") @ fake_quantize_fp4(lin.weight.detach(), fmt, "block2d").t()
        + lin.bias
    )
    assert torch.allclose(y, want, atol=1e-5)
    g = torch.randn(40, 32)
    y.backward(g)
    gx, gw = x.grad.clone(), lin.weight.grad.clone()
    ref_x, ref_w = g @ lin.weight.detach(), g.t() @ x.detach()
    # FP4 noise, unbiased: close to the exact gradients but not equal
    assert 8.0 < sqnr_db(ref_x, gx) < 30.0 and 5.0 < sqnr_db(ref_w, gw) < 30.0
    # grad-input uses the forward's quantized weight (2-D tiles), not a re-quantized one
    state2 = Fp4State(0)
    x.grad = None
    lin.weight.grad = None
    fp4b = Fp4TrainingLinear.from_linear(lin, Fp4Recipe(fmt), state2)
    fp4b(x).backward(g)
    assert torch.equal(x.grad, gx) and torch.equal(lin.weight.grad, gw)  # same seed: same draws


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4], ids=str)
def test_weight_gradient_is_the_recipe_written_out(fmt):
    """grad-weight = Q(T dy)^T Q(T x) with T the random Hadamard transform along the (zero-padded)
    token dim and Q blocks of b along that dim: written out here with explicit transposes and
    row blocks, which the layer avoids (it quantizes down the columns)."""
    from fp8rl_core.precision.fp4 import random_hadamard

    torch.manual_seed(1)
    lin = nn.Linear(64, 32, bias=False)
    x = torch.randn(40, 64, requires_grad=True)
    state = Fp4State(3)
    fp4 = Fp4TrainingLinear.from_linear(lin, Fp4Recipe(fmt, stochastic_grad=False), state)
    g = torch.randn(40, 32)
    fp4(x).backward(g)
    m = -(-40 // max(16, fmt.block)) * max(16, fmt.block)
    pad = lambda t: torch.cat([t, t.new_zeros(m - t.shape[0], t.shape[1])])  # noqa: E731
    hg, hx = random_hadamard(pad(g), state.signs), random_hadamard(pad(x.detach()), state.signs)
    want = fake_quantize_fp4(hg.t().contiguous(), fmt, "row") @ fake_quantize_fp4(hx.t().contiguous(), fmt, "row").t()
    torch.testing.assert_close(lin.weight.grad, want, rtol=1e-5, atol=1e-6)
    # blocks along the token dim matter: quantizing along the feature dims instead is far off
    wrong = fake_quantize_fp4(hg, fmt, "row").t() @ fake_quantize_fp4(hx, fmt, "row")
    assert not torch.allclose(lin.weight.grad, wrong, rtol=1e-3, atol=1e-4)


def test_stochastic_rounding_makes_the_weight_gradient_unbiased():
    torch.manual_seed(1)
    lin = nn.Linear(32, 16, bias=False)
    x = torch.randn(64, 32)
    g = torch.randn(64, 16) * 1e-3
    exact = g.t() @ x
    recipe = Fp4Recipe(NVFP4)
    state = Fp4State(0)
    fp4 = Fp4TrainingLinear.from_linear(lin, recipe, state)
    total = torch.zeros_like(exact)
    for _ in range(64):
        lin.weight.grad = None
        fp4(x).backward(g)
        total += lin.weight.grad
    one = sqnr_db(exact, lin.weight.grad)
    mean = sqnr_db(exact, total / 64)
    assert mean > one + 3.0, (one, mean)  # averaging stochastic draws shrinks the noise


@pytest.mark.parametrize("mode", FP4_MODES)
def test_fp4_model_trains_and_state_dict_loads_into_plain_model(base_model, mode):
    model = copy.deepcopy(base_model).train()
    report = convert_for_training(model, mode, seed=3)
    assert len(report.converted) == 2 * LINEARS_PER_LAYER and not report.skipped
    assert report.kept_high_precision == ("lm_head",) and type(model.lm_head) is nn.Linear
    losses = train_steps(model, mode, toy_batch(), steps=5)
    assert losses[-1] < losses[0] - 0.3, losses
    plain = Qwen3ForCausalLM(tiny_config())
    plain.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize("mode", FP4_MODES)
def test_bf16_shadow_of_fp4_is_the_bf16_forward(base_model, mode):
    fp4 = copy.deepcopy(base_model)
    convert_for_training(fp4, mode)
    ids = toy_batch(seed=1)
    with torch.no_grad(), autocast_context("bf16"):
        ref = base_model(input_ids=ids).logits
        with bf16_shadow(fp4):
            shadow = fp4(input_ids=ids).logits
        low = fp4(input_ids=ids).logits
    assert torch.equal(shadow, ref)
    assert 5.0 < sqnr_db(ref.float(), low.float()) < 30.0  # FP4 noise: clearly there, below FP8's


def test_a_layer_fp4_cannot_take_is_an_error_naming_it_unless_kept():
    model = Qwen3ForCausalLM(tiny_config(intermediate_size=200))  # 200 is not whole 16/32 blocks
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.mlp\.gate_proj: nvfp4 training needs .*128->200"):
        convert_for_training(copy.deepcopy(model), "nvfp4")
    kept = copy.deepcopy(model)
    report = convert_for_training(kept, "nvfp4", keep_high_precision=("model.layers.*.mlp.*",))
    assert len(report.converted) == 2 * 4 and len(report.skipped) == 2 * 3
    assert all(why == "listed in precision.keep_high_precision" for _, why in report.skipped)
    assert type(kept.model.layers[0].mlp.down_proj) is nn.Linear
    with pytest.raises(ValueError, match="emulation only"):
        convert_for_training(copy.deepcopy(model), "mxfp4", emulate=False)


def test_fp4_rng_state_round_trips_so_a_resumed_run_equals_an_uninterrupted_one(base_model):
    def run(split: bool) -> list[torch.Tensor]:
        model = copy.deepcopy(base_model).train()
        convert_for_training(model, "nvfp4", seed=5)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(4):
            if split and step == 2:  # "checkpoint": weights, optimizer and the FP4 generator; then a fresh process
                saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), fp4_rng_state(model))
                model = copy.deepcopy(base_model).train()
                convert_for_training(model, "nvfp4", seed=5)
                opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                load_fp4_rng_state(model, saved[2])
            ids = toy_batch(seed=step)
            with autocast_context("nvfp4"):
                model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in model.parameters()]

    a, b = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert fp4_rng_state(base_model) is None


@pytest.mark.parametrize("mode", ["nvfp4_w4a4", "mxfp4_w4a4"])
def test_w4a4_rollout_copy_generates_and_is_noisier_than_fp8(base_model, mode):
    train = copy.deepcopy(base_model)
    convert_for_training(train, mode.split("_")[0])
    rollout = convert_for_rollout(train, mode)
    assert sum(isinstance(m, Fp4RolloutLinear) for m in rollout.modules()) == 2 * LINEARS_PER_LAYER
    ids = toy_batch(seed=3)
    with torch.no_grad():
        ref = convert_for_rollout(base_model, "bf16")(input_ids=ids).logits.float()
        fp8 = convert_for_rollout(base_model, "fp8_per_tensor")(input_ids=ids).logits.float()
        got = rollout(input_ids=ids).logits.float()
        out = rollout.generate(
            input_ids=ids[:2, :6],
            attention_mask=torch.ones(2, 6, dtype=torch.long),
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=True,
            top_k=0,
        )
    assert out.shape == (2, 10)
    assert 5.0 < sqnr_db(ref, got) < sqnr_db(ref, fp8)
