"""Activation outliers put into a policy without changing what it computes (``model.outliers``).

Pretrained LLMs carry a few hidden channels whose activations are orders of magnitude above
the rest, the same channels in every block; a per-tensor FP8 scale is set by them and leaves
the other channels few levels. A tiny model trained from scratch has none. This makes them:
in ``channels`` hidden channels every RMSNorm that feeds projections multiplies its weight by
``2**log2_scale`` and those projections divide the matching input columns by it. Powers of
two make both exact in fp32 and in bf16 (barring overflow and underflow), so the BF16 forward
is the same bits; only FP8 quantization sees the outliers.
"""

from __future__ import annotations

import torch
from torch import nn

# RMSNorm of a Qwen3/Llama decoder block -> the projections that read its output
FEEDS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def outlier_channels(hidden_size: int, channels: int, seed: int) -> list[int]:
    """The ``channels`` hidden channels made outliers: a seeded choice, the same in every block."""
    g = torch.Generator().manual_seed(int(seed))
    return sorted(torch.randperm(hidden_size, generator=g)[:channels].tolist())


@torch.no_grad()
def inject_outliers(model: nn.Module, channels: int, log2_scale: int, seed: int) -> list[int]:
    """Scale ``channels`` hidden channels of ``model``'s decoder blocks (module docstring), in place,
    before any conversion; returns the channels. A no-op for ``channels == 0``."""
    if channels == 0:
        return []
    layers = model.model.layers
    hidden = layers[0].input_layernorm.weight.shape[0]
    chosen = outlier_channels(hidden, channels, seed)
    idx = torch.tensor(chosen)
    scale = float(2**log2_scale)
    for block in layers:
        for norm_name, projections in FEEDS.items():
            getattr(block, norm_name).weight[idx] *= scale
            for path in projections:
                block.get_submodule(path).weight[:, idx] /= scale
    return chosen


__all__ = ["FEEDS", "inject_outliers", "outlier_channels"]
