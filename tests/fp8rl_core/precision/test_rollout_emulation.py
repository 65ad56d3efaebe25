"""The CPU emulation of FP8 rollout equals vLLM 0.33's numerics (Hopper), rule by rule.

The reference below is written from vLLM's source, independently of
``fp8rl_core``: ``Fp8PerTensorOnlineLinearMethod`` / ``Fp8PerBlockOnlineLinearMethod``
(``model_executor/layers/quantization/online/fp8.py``), ``QuantFP8.forward_native``
(``input_quant_fp8.py``) and ``per_block_cast_to_fp8`` (``utils/deep_gemm.py``):

* the engine holds BF16 weights (the trainer's fp32 masters rounded on the way in,
  ``rollout.weight_format: bf16``) and quantizes those;
* weights are quantized after q/k/v and gate/up are fused: per tensor, ONE scale
  ``s = amax(fused) / 448`` (under TP the amax is all-reduced over shards, so
  the same); per block, 128x128 blocks of the fused weight, amax floored at 1e-4;
  values ``fp8(w * (1 / s))``;
* activations: dynamic per token (CUTLASS on Hopper) or per 1x128 group,
  ``s = max(amax / 448, 1 / (448 * 512))``, values ``fp8(x * (1 / s))`` /
  ``fp8(x / s)``;
* the matmul accumulates exactly (float32 here) and rescales.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8rl_core.config.model import ModelConfig
from fp8rl_core.precision.fp8_linear import Fp8RolloutLinear
from fp8rl_core.precision.rollout import convert_for_rollout, fused_rollout_groups
from fp8rl_core.tasks.tiny_model import build_tiny_model

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
FUSE = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def fp8(x):
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def ref_weight_per_tensor(w):
    s = w.abs().amax().float() / torch.tensor(FP8_MAX)
    return fp8(w * (1.0 / s)) * s


def ref_weight_per_block(w, b=128):
    m, n = w.shape
    pad = torch.zeros(-(-m // b) * b, -(-n // b) * b)
    pad[:m, :n] = w
    v = pad.view(-1, b, pad.shape[1] // b, b)
    sf = v.abs().amax(dim=(1, 3), keepdim=True).clamp(1e-4) / FP8_MAX
    return (fp8(v * (1.0 / sf)) * sf).view_as(pad)[:m, :n]


def ref_act(x, scheme, b=128):
    if scheme == "per_tensor":  # dynamic per token
        s = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return fp8(x * s.reciprocal()) * s
    g = x.reshape(*x.shape[:-1], -1, b)
    s = (g.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    return (fp8(g / s) * s).reshape(x.shape)


class RefLinear(nn.Module):
    def __init__(self, w_deq, scheme):
        super().__init__()
        self.w, self.scheme = w_deq, scheme

    def forward(self, x):
        return F.linear(ref_act(x.float(), self.scheme), self.w)


def vllm_reference(model, scheme, *, fused=True):
    """A float32 copy of ``model`` whose decoder linears follow vLLM's rules (``fused=False``: one scale
    per projection)."""
    import copy

    ref = copy.deepcopy(model).float().eval()
    quant = ref_weight_per_tensor if scheme == "per_tensor" else ref_weight_per_block
    for layer in ref.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            lins = {k: m for k, m in parent.named_children() if isinstance(m, nn.Linear)}
            groups: dict[str, list[str]] = {}
            for k in lins:
                groups.setdefault(FUSE.get(k, k) if fused else k, []).append(k)
            for members in groups.values():
                w = quant(torch.cat([lins[k].weight.detach().bfloat16().float() for k in members]))
                row = 0
                for k in members:
                    n = lins[k].out_features
                    setattr(parent, k, RefLinear(w[row : row + n], scheme))
                    row += n
    return ref


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_tiny_model(ModelConfig())
    with torch.no_grad():  # spread the projections' ranges so one fused scale differs from per-projection ones
        for layer in m.model.layers:
            layer.self_attn.k_proj.weight.mul_(4.0)
            layer.mlp.gate_proj.weight.mul_(3.0)
    return m.float().eval()


def logprobs(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float().log_softmax(-1)


@pytest.mark.parametrize("mode", ["fp8_per_tensor", "fp8_per_block"])
def test_emulation_matches_hand_built_vllm_reference(model, mode):
    scheme = mode.removeprefix("fp8_")
    ids = torch.randint(4, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(1))
    emulated = convert_for_rollout(model, mode, dtype=torch.float32)
    groups = [[n.rsplit(".", 1)[1] for n, _ in g] for g in fused_rollout_groups(emulated)]
    assert ["q_proj", "k_proj", "v_proj"] in groups and ["gate_proj", "up_proj"] in groups
    if scheme == "per_tensor":  # one scale per fused layer, shared by its projections
        attn = emulated.model.layers[0].self_attn
        assert attn.q_proj.weight_post is attn.k_proj.weight_post is attn.v_proj.weight_post
    ref = logprobs(vllm_reference(model, scheme), ids)
    emu = logprobs(emulated, ids)
    old = logprobs(vllm_reference(model, scheme, fused=False), ids)
    err = (emu - ref).abs().max().item()
    old_gap = (old - ref).abs().mean().item()
    print(
        f"{mode}: max |emulation - vLLM reference| = {err:.2e} nats; "
        f"mean |per-projection scales - fused| = {old_gap:.2e} nats"
    )
    # float32 sums in another order (scale after vs before the matmul) and the 1-ulp
    # scale difference (448/amax vs 1/(amax/448)) are all that may differ
    assert err < 2e-4
    if scheme == "per_tensor":
        assert old_gap > 20 * (emu - ref).abs().mean().item()  # the old scheme is measurably not vLLM's
    else:  # projection rows are multiples of 128 (as in every Qwen3): no block straddles q/k, fusing changes nothing
        assert all(m.out_features % 128 == 0 for _, m in emulated.named_modules() if isinstance(m, Fp8RolloutLinear))
        assert old_gap == 0.0


def test_fused_refresh_rejects_mismatched_members():
    a = Fp8RolloutLinear(8, 4, scheme="per_tensor")
    b = Fp8RolloutLinear(8, 4, scheme="per_block")
    with pytest.raises(ValueError, match="one scheme"):
        Fp8RolloutLinear.refresh_fused([a, b], [torch.ones(4, 8), torch.ones(4, 8)], [None, None])
