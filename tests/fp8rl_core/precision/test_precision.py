"""Training and rollout precision modes on a tiny Qwen3 (fp8rl_core.precision.conversion)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402  (after precision: quiet torchao)

from fp8rl_core.precision.autocast import autocast_context
from fp8rl_core.precision.bf16_pass import bf16_shadow
from fp8rl_core.precision.conversion import TRAIN_PRECISIONS, convert_for_training
from fp8rl_core.precision.fp8 import E4M3, fake_quantize, sqnr_db
from fp8rl_core.precision.fp8_linear import Fp8RolloutLinear, Fp8TrainingLinear
from fp8rl_core.precision.fp8_operands import quantize_operand
from fp8rl_core.precision.rollout import ROLLOUT_PRECISIONS, convert_for_rollout, sync_rollout_weights
from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

FP8_MODES = ["fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"]
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def tiny_config(**overrides) -> Qwen3Config:
    """The tiny shape with a 32-token vocabulary, a short context and a pad token only."""
    kw = dict(vocab_size=32, max_position_embeddings=64, bos_token_id=None, eos_token_id=None)
    return tiny_qwen3_config(**{**kw, **overrides})


@pytest.fixture(scope="module")
def base_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_config()).eval()


def toy_batch(b=8, t=16, seed=0) -> torch.Tensor:
    """A learnable toy language: token t+1 = (token t + 1) mod 32 from a random start."""
    start = torch.randint(0, 32, (b, 1), generator=torch.Generator().manual_seed(seed))
    return (start + torch.arange(t)) % 32  # [B, T]


def train_steps(model, mode, ids, steps=5, lr=3e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        with autocast_context(mode):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("mode", ["bf16", *FP8_MODES])
def test_converted_model_trains_and_state_dict_loads_into_plain_model(base_model, mode):
    model = copy.deepcopy(base_model).train()
    report = convert_for_training(model, mode)
    n_fp8 = 0 if mode == "bf16" else 2 * LINEARS_PER_LAYER
    assert len(report.converted) == n_fp8 and not report.skipped
    assert report.kept_high_precision == ("lm_head",) and type(model.lm_head) is nn.Linear
    assert sum(isinstance(m, Fp8TrainingLinear) for m in model.modules()) == n_fp8
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    losses = train_steps(model, mode, toy_batch())
    assert losses[-1] < losses[0] - 0.5, losses
    plain = Qwen3ForCausalLM(tiny_config())
    plain.load_state_dict(model.state_dict(), strict=True)
    assert plain.model.embed_tokens.weight.data_ptr() == plain.lm_head.weight.data_ptr()  # ties survive


@pytest.mark.parametrize("mode", FP8_MODES)
def test_bf16_shadow_is_exactly_the_bf16_mode_forward(base_model, mode):
    fp8 = copy.deepcopy(base_model)
    convert_for_training(fp8, mode)
    train_steps(fp8, mode, toy_batch(), steps=2)  # weights move away from init
    bf16 = Qwen3ForCausalLM(tiny_config()).eval()
    bf16.load_state_dict(fp8.state_dict())
    fp8.eval()
    ids = toy_batch(seed=1)
    with torch.no_grad(), autocast_context("bf16"):
        ref = bf16(input_ids=ids).logits
        with bf16_shadow(fp8):
            with bf16_shadow(fp8):  # nesting is harmless
                nested = fp8(input_ids=ids).logits
            shadow = fp8(input_ids=ids).logits
        after = fp8(input_ids=ids).logits
    assert torch.equal(shadow, ref) and torch.equal(nested, ref)
    assert not torch.equal(after, ref)  # FP8 forward restored on exit
    assert sqnr_db(ref.float(), after.float()) > 15.0  # ...and it is close to BF16


def test_our_emulation_equals_torchao_emulate_end_to_end(base_model):
    """rowwise (power-of-two scales): our emulation and torchao's emulate=True give
    bit-identical logits and gradients through the whole model. (tensorwise agrees
    per layer up to one BF16 rounding, see test_fp8.py; FP8 rounding flips make that
    visible end to end, so it is not compared bitwise here.)"""
    ours, ao = copy.deepcopy(base_model), copy.deepcopy(base_model)
    assert convert_for_training(ours, "fp8_rowwise").backend == "fp8rl-emulated"
    rep = convert_for_training(ao, "fp8_rowwise", backend="torchao")
    assert rep.backend == "torchao" and rep.emulate and len(rep.converted) == 14
    ids = toy_batch(seed=2)
    for m in (ours, ao):
        with autocast_context("fp8_rowwise"):
            m(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad(), autocast_context("fp8_rowwise"):
        assert torch.equal(ours(input_ids=ids).logits, ao(input_ids=ids).logits)
    for (name, p), q in zip(ours.named_parameters(), ao.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert train_steps(ao, "fp8_rowwise", toy_batch(), steps=1)  # the torchao path trains on CPU too


def test_layers_the_kernel_cannot_take_are_skipped_with_a_reason(caplog):
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(tiny_config(intermediate_size=200))  # 200 % 16 != 0, % 128 != 0
    with caplog.at_level(logging.INFO, logger="fp8rl_core.precision.conversion"):
        report = convert_for_training(copy.deepcopy(model), "fp8_tensorwise")
    skipped = dict(report.skipped)
    assert set(skipped) == {f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")}
    assert (
        "divisible by 16" in skipped["model.layers.0.mlp.up_proj"]
        and "128->200" in skipped["model.layers.0.mlp.up_proj"]
    )
    assert "model.layers.1.mlp.down_proj" in caplog.text
    blockwise = copy.deepcopy(model)
    report = convert_for_training(blockwise, "fp8_blockwise")
    assert len(report.skipped) == 6 and "divisible by 128" in report.skipped[0][1]
    assert train_steps(blockwise, "fp8_blockwise", toy_batch(), steps=1)  # still runs


def test_bad_modes_and_options(base_model):
    with pytest.raises(KeyError, match="fp8_rowwise"):  # lists the valid modes
        convert_for_training(copy.deepcopy(base_model), "fp8_columnwise")
    with pytest.raises(ValueError, match="SM89"):
        convert_for_training(copy.deepcopy(base_model), "fp8_tensorwise", emulate=False)
    with pytest.raises(ValueError, match="backend"):
        convert_for_training(copy.deepcopy(base_model), "fp8_tensorwise", backend="cutlass")
    model = copy.deepcopy(base_model)
    convert_for_training(model, "fp8_rowwise")
    with pytest.raises(ValueError, match="already converted"):
        convert_for_training(model, "fp8_tensorwise")
    with pytest.raises(KeyError, match="valid"):
        autocast_context("fp16")
    with pytest.raises(KeyError, match="fp8_per_block"):
        convert_for_rollout(base_model, "int4")
    assert set(TRAIN_PRECISIONS.names()) == {"bf16", *FP8_MODES, "nvfp4", "mxfp4"}
    assert set(ROLLOUT_PRECISIONS.names()) == {"bf16", "fp8_per_tensor", "fp8_per_block", "nvfp4_w4a4", "mxfp4_w4a4"}


def test_autocast_context_and_fp32_master_upcast(base_model):
    with autocast_context("fp8_rowwise"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    model = copy.deepcopy(base_model).to(torch.bfloat16)
    convert_for_training(model, "bf16")
    assert all(p.dtype == torch.float32 for p in model.parameters())


# --------------------------------------------------------------------------- rollout


@pytest.mark.parametrize("mode", ["bf16", "fp8_per_tensor", "fp8_per_block"])
def test_rollout_copy_generates_and_leaves_the_trainer_alone(base_model, mode):
    train = copy.deepcopy(base_model)
    convert_for_training(train, "fp8_tensorwise")
    train_steps(train, "fp8_tensorwise", toy_batch(), steps=1)
    for p in train.parameters():
        p.grad = torch.ones_like(p)  # pretend mid-step
    rollout = convert_for_rollout(train, mode)
    assert all(p.grad is not None for p in train.parameters())  # grads kept, not copied
    assert all(p.grad is None and not p.requires_grad for p in rollout.parameters())
    assert all(p.dtype == torch.bfloat16 for p in rollout.parameters()) and not rollout.training
    n_fp8 = sum(isinstance(m, Fp8RolloutLinear) for m in rollout.modules())
    assert n_fp8 == (0 if mode == "bf16" else 14)
    assert sum(isinstance(m, Fp8TrainingLinear) for m in rollout.modules()) == 0
    assert sum(isinstance(m, Fp8TrainingLinear) for m in train.modules()) == 14
    prompt = toy_batch(4, 6)
    with torch.no_grad():
        out = rollout.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=5,
            min_new_tokens=5,
            do_sample=True,
            top_k=0,
        )
    assert out.shape == (4, 11) and torch.equal(out[:, :6], prompt)


def test_rollout_fp8_logits_close_to_bf16_rollout(base_model):
    ids = toy_batch(seed=3)
    with torch.no_grad():
        ref = convert_for_rollout(base_model, "bf16")(input_ids=ids).logits.float()
        for mode in ("fp8_per_tensor", "fp8_per_block"):
            got = convert_for_rollout(base_model, mode)(input_ids=ids).logits.float()
            assert 15.0 < sqnr_db(ref, got) < 60.0  # FP8 noise: present, and small


def test_sync_rollout_weights_requantizes_once_per_sync(base_model):
    train = copy.deepcopy(base_model)
    convert_for_training(train, "fp8_rowwise")
    rollout = convert_for_rollout(train, "fp8_per_tensor")
    bf16_rollout = convert_for_rollout(train, "bf16")
    ids = toy_batch(seed=4)
    up = rollout.model.layers[0].mlp.up_proj
    with torch.no_grad():
        before = rollout(input_ids=ids).logits
        cached = up.weight_values
        rollout(input_ids=ids)
        assert up.weight_values is cached  # forwards reuse the quantized weight
    train_steps(train, "fp8_rowwise", toy_batch(), steps=2)
    with torch.no_grad():
        assert torch.equal(rollout(input_ids=ids).logits, before)  # stale until synced
        sync_rollout_weights(rollout, train)
        sync_rollout_weights(bf16_rollout, train)
        assert not torch.equal(rollout(input_ids=ids).logits, before)
    w = train.model.layers[0].mlp.up_proj.weight.detach()
    wq = fake_quantize(w.bfloat16().float(), "tensorwise")  # the engine quantizes the BF16 weights it receives
    torch.testing.assert_close(up.weight_values.float() * up.weight_post, wq, rtol=2e-7, atol=0)
    q_rollout, q_train = bf16_rollout.model.layers[1].self_attn.q_proj, train.model.layers[1].self_attn.q_proj
    assert torch.equal(q_rollout.weight, q_train.weight.bfloat16())
    assert torch.equal(rollout.model.embed_tokens.weight, train.model.embed_tokens.weight.bfloat16())
    other = Qwen3ForCausalLM(tiny_config(num_hidden_layers=1))
    with pytest.raises(KeyError, match="lacks"):
        sync_rollout_weights(rollout, other)


@pytest.mark.parametrize("mode", ["fp8_per_tensor", "fp8_per_block"])
def test_weight_format_decides_what_the_engine_quantizes(base_model, mode):
    """bf16 transfer: the engine quantizes the BF16-rounded masters; native_fp8: the fp32 masters."""
    from fp8rl_core.precision.rollout import fused_rollout_groups

    sent_bf16 = convert_for_rollout(base_model, mode, dtype=torch.float32)
    native = convert_for_rollout(base_model, mode, dtype=torch.float32, weight_format="native_fp8")
    masters = base_model.state_dict()
    rounded = copy.deepcopy(base_model).bfloat16().float()
    reference = convert_for_rollout(rounded, mode, dtype=torch.float32, weight_format="native_fp8")
    differ = 0
    for g_b, g_n, g_r in zip(*(fused_rollout_groups(m) for m in (sent_bf16, native, reference))):
        for (name, b), (_, n), (_, r) in zip(g_b, g_n, g_r):
            assert torch.equal(b.weight_values, r.weight_values) and torch.equal(b.weight_post, r.weight_post)
            differ += int(not torch.equal(b.weight_values, n.weight_values))
        fused = torch.cat([masters[f"{name}.weight"] for name, _ in g_n])
        layout = "tensor" if g_n[0][1].scheme == "per_tensor" else "block"
        values, post = quantize_operand(fused, E4M3, layout, pow2=False, compute_dtype=torch.float32, rule="vllm")
        assert torch.equal(torch.cat([m.weight_values for _, m in g_n]), values)
    assert differ > 0  # BF16 rounding moves some FP8 values: the two formats are not the same grid
    with pytest.raises(ValueError, match="native_fp8"):
        convert_for_rollout(base_model, "nvfp4_w4a4", weight_format="native_fp8")


def test_vllm_scale_rule_breaks_ties_as_vllm_does():
    """vLLM multiplies by 1 / (amax / 448) in float32, torchao by 448 / amax: an ulp apart on some amaxes,
    which flips BF16-valued operands that sit on a tie between two FP8 values."""
    from fp8rl_core.precision.fp8 import amax_to_qscale

    amax, w = torch.tensor(0.26953125), torch.tensor([[0.2021484375, -0.26953125]])  # BF16 values; w/s = 336: a tie
    s = amax / 448.0
    assert torch.equal(amax_to_qscale(amax, E4M3, rule="vllm"), 1.0 / s)
    vllm_values, _ = quantize_operand(w, E4M3, "tensor", pow2=False, compute_dtype=torch.float32, rule="vllm")
    expected = (w * (1.0 / s)).to(torch.float8_e4m3fn).float()
    assert torch.equal(vllm_values, expected)
    torchao_values, _ = quantize_operand(w, E4M3, "tensor", pow2=False, compute_dtype=torch.float32)
    assert not torch.equal(torchao_values, vllm_values)  # the rules differ exactly here
    with pytest.raises(ValueError, match="rule"):
        amax_to_qscale(amax, E4M3, rule="cuda")


def _count_quantizations(monkeypatch) -> list[int]:
    """A list that grows by one at every operand quantization, the weights' and the shared-input cache's."""
    import fp8rl_core.precision.fp8_linear as fl
    import fp8rl_core.precision.fp8_operands as fo

    calls = []
    real = fl.quantize_operand
    counted = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(fl, "quantize_operand", counted)  # the weights' calls
    monkeypatch.setattr(fo, "quantize_operand", counted)  # the shared-input cache's calls
    return calls


def test_rollout_quantizes_shared_inputs_once(base_model, monkeypatch):
    """q/k/v (and gate/up) read one tensor: quantized once, same numbers as without the cache."""
    rollout = convert_for_rollout(base_model, "fp8_per_tensor")
    calls = _count_quantizations(monkeypatch)
    ids = toy_batch(seed=5)
    with torch.inference_mode():
        cached = rollout(input_ids=ids).logits
        assert len(calls) == 2 * 4  # per layer: qkv input, o input, gate/up input, down input
        for m in rollout.modules():
            if isinstance(m, Fp8RolloutLinear):
                m.input_cache = None
        uncached = rollout(input_ids=ids).logits
    assert len(calls) == 8 + 2 * LINEARS_PER_LAYER and torch.equal(cached, uncached)


def test_the_shared_input_cache_tells_fake_tensors_apart(monkeypatch):
    """The measured memory plan runs the step on fake tensors, whose data pointer is 0 for all: keyed
    by it, the attention and MLP inputs of a layer (same shape) shared one quantization, and the plan
    counted one quantized activation where the GPU allocates three."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    import fp8rl_core.precision.fp8_operands as fo

    calls = []
    real = fo.quantize_operand
    monkeypatch.setattr(fo, "quantize_operand", lambda *a, **k: calls.append(1) or real(*a, **k))
    cache = fo.SharedInputCache()
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("error")  # no data_ptr() of a fake tensor either (deprecated, to become an error)
        a, b = torch.randn(256, 128), torch.randn(256, 128)
        for t, quantizations in ((a, 1), (a, 1), (b, 2), (b[:128], 3), (a, 4)):
            cache.quantize(t, E4M3, "tensor", pow2=False, compute_dtype=torch.float32)
            assert len(calls) == quantizations


@pytest.mark.parametrize("mode", FP8_MODES)
def test_training_quantizes_shared_inputs_once(base_model, mode, monkeypatch):
    """Same logits and gradients with the shared-input cache as without; fewer roundings."""
    calls = _count_quantizations(monkeypatch)
    ids = toy_batch(seed=6)
    runs = []
    for use_cache in (True, False):
        model = copy.deepcopy(base_model)
        convert_for_training(model, mode)
        if not use_cache:
            for m in model.modules():
                if isinstance(m, Fp8TrainingLinear):
                    m.input_cache = None
        calls.clear()
        with autocast_context(mode):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        runs.append((out.logits, [p.grad for p in model.parameters()], len(calls)))
    (lc, gc, nc), (lu, gu, nu) = runs
    assert torch.equal(lc, lu) and all(torch.equal(a, b) for a, b in zip(gc, gu))
    saved = 2 * 3 * (2 if mode != "fp8_tensorwise" else 1)  # per layer: 3 sibling reads fwd (+3 bwd)
    assert nu - nc == saved, (nu, nc)
