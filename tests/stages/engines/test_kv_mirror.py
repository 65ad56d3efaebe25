"""The mirrored KV cache (stages.engines.kv_mirror): the rollout's tokens and log-probs bit for bit
those of the plain ``DynamicCache``, and no whole-cache conversion at a decoding step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.pipeline import RolloutConfig
from fp8rl_core.cpu_numerics import bf16_rule, cpu_gemm
from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
from stages.engines import SamplingRequest, make_engine
from stages.engines.kv_mirror import MirroredKVCache, MirrorLayer

MANY_EOS = frozenset(range(2, 12))  # rows finish at staggered steps: the batch is compacted


def rollout(policy, tokenizer, prompts, *, mode: str = "bf16", many_eos: bool = False, **options):
    engine = make_engine(
        "transformers",
        model=policy,
        tokenizer=tokenizer,
        precision=PrecisionConfig(rollout=mode),
        config=RolloutConfig(generation_batch_size=64),
        **options,
    )
    if many_eos:
        engine.eos_ids = MANY_EOS
    with cpu_bf16_gemm("fp32"):
        batch = engine.generate(prompts, SamplingRequest(n=6, temperature=1.0, top_p=1.0, max_new_tokens=16, seed=1))
    return [(s.response_ids, s.response_logprobs, s.finish_reason) for s in batch.samples]


@pytest.mark.parametrize("mode", ["bf16", "nvfp4_w4a4"])
def test_mirrored_cache_gives_the_plain_caches_tokens_and_logprobs(policy, tokenizer, prompts, mode, monkeypatch):
    selected = []
    original = MirrorLayer.batch_select_indices
    monkeypatch.setattr(
        MirrorLayer, "batch_select_indices", lambda self, idx: (selected.append(len(idx)), original(self, idx))[1]
    )
    mirrored = rollout(policy, tokenizer, prompts, mode=mode, many_eos=True)
    plain = rollout(policy, tokenizer, prompts, mode=mode, many_eos=True, kv_mirror=False)
    lengths = sorted(len(ids) for ids, _, _ in mirrored)
    # Rows finished early and were dropped from the mirrored cache (every layer, at least twice).
    assert lengths[0] < 4 and lengths[-1] > 10 and len(selected) >= 2 * policy.config.num_hidden_layers
    assert mirrored == plain  # token ids, log-probs (Python floats, compared exactly), finish reasons


def test_decoding_converts_the_query_only(policy, tokenizer, prompts, monkeypatch):
    """Attention operands the fp32 GEMM path converts to BF16 values: with the mirrored cache only
    the queries; with a plain cache the whole cached keys and values at every decoding step."""
    queries, converted = [], []
    sdpa = F.scaled_dot_product_attention

    def counting_sdpa(q, *args, **kwargs):
        queries.append(q.numel())
        return sdpa(q, *args, **kwargs)

    operand = bf16_rule._bf16_operand

    def counting_operand(a):
        out = operand(a)
        if out is not a and a.dim() == 4:
            converted.append(a.numel())
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(bf16_rule, "_bf16_operand", counting_operand)
    rollout(policy, tokenizer, prompts)
    assert len(queries) > 2 * policy.config.num_hidden_layers and converted == queries

    queries.clear(), converted.clear()
    rollout(policy, tokenizer, prompts, kv_mirror=False)
    assert len(converted) == 3 * len(queries)  # the counter does see a plain cache's conversions


def test_mirror_only_where_attention_consumes_bf16_values_in_float32(policy, tokenizer):
    def cache(**options):
        engine = make_engine(
            "transformers", model=policy, tokenizer=tokenizer, precision=PrecisionConfig(), config=RolloutConfig()
        )
        for name, value in options.items():
            setattr(engine, name, value)
        return type(engine._new_cache(engine.model, torch.device("cpu"), capacity=8))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cache() is not MirroredKVCache  # native BF16 kernels read the BF16 cache as it is
        with cpu_bf16_gemm("fp32"):
            assert cache() is MirroredKVCache
            assert cache(kv_mirror=False) is not MirroredKVCache
            assert cache(bf16_autocast=False) is not MirroredKVCache  # fp32 compute: rounding would change it
    with cpu_bf16_gemm("fp32"):
        assert cache() is not MirroredKVCache  # no autocast


def test_mirror_layer_rounds_on_arrival_and_follows_row_selection():
    layer = MirrorLayer(capacity=5)
    gen = torch.Generator().manual_seed(0)
    k1, v1 = torch.randn(3, 2, 2, 4, generator=gen), torch.randn(3, 2, 2, 4, generator=gen).bfloat16()
    keys, values = layer.update(k1, v1)
    assert keys.dtype == values.dtype == torch.float32 and getattr(keys, cpu_gemm._BF16_EXACT)
    assert torch.equal(keys, k1.bfloat16().float()) and torch.equal(values, v1.float())
    layer.batch_select_indices(torch.tensor([2, 0]))
    k2, v2 = torch.randn(2, 2, 1, 4, generator=gen), torch.randn(2, 2, 1, 4, generator=gen).bfloat16()
    keys, values = layer.update(k2, v2)
    assert torch.equal(keys, torch.cat([k1[[2, 0]], k2], dim=2).bfloat16().float())
    assert torch.equal(values, torch.cat([v1[[2, 0]], v2], dim=2).float()) and layer.get_seq_length() == 3
    with pytest.raises(ValueError, match="capacity"):
        layer.update(torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))
