"""The tiny Qwen3 shape every small model of the project starts from.

The defaults are the embedded policy's (:func:`fp8rl_core.tasks.tiny_model.build_tiny_model` at
``ModelConfig()``'s sizes, its 128-entry character vocabulary and special-token ids): two decoder
layers of width 128, four heads of 32, an MLP of 384, a tied embedding. Callers pass only what
differs. The module imports transformers alone (no pydantic), so ``gpu_check`` may use it on a machine
without pydantic.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from transformers import Qwen3Config

TINY_QWEN3 = MappingProxyType(
    dict(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=True,
    )
)


def tiny_qwen3_config(**overrides: Any) -> Qwen3Config:
    """A ``Qwen3Config`` of :data:`TINY_QWEN3`'s values, ``overrides`` replacing any of them."""
    return Qwen3Config(**{**TINY_QWEN3, **overrides})
