"""Qwen3-0.6B's shape: where gpu_check's random-init models of the real model's size start from.

Plain data and the standard library only, so a gpu_check module reads it when it is imported without loading
torch or transformers (:mod:`fp8rl_core.tasks.tiny_config` imports transformers, and with it torch).
"""

from __future__ import annotations

from types import MappingProxyType

# Qwen3-0.6B's config: 28 decoder layers of width 1024, GQA 16/8 heads of 128, an MLP of 3072, a tied
# vocabulary of 151,936 (~0.6 B parameters)
QWEN3_06B = MappingProxyType(
    dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
)
