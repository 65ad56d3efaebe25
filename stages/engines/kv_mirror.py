"""A KV cache held as the float32 values attention consumes on the CPU ``fp32`` GEMM path.

Under ``cpu_bf16_gemm: fp32`` (:mod:`fp8rl_core.cpu_numerics.cpu_gemm`) a Qwen3 attention call under BF16
autocast is ``scaled_dot_product_attention(q, k, v)`` with every float operand rounded to BF16
and held in float32, the output rounded to BF16. With a transformers ``DynamicCache`` the cached
keys are float32 (the k-norm's float32 weight promotes the BF16 projection) and the values BF16,
so every decoding step converts the *whole* cache again: keys float32 -> BF16 -> float32, values
BF16 -> float32, and ``torch.cat`` copies both to grow them by one token.

:class:`MirroredKVCache` stores instead, per layer, preallocated float32 buffers holding each
token's keys and values rounded to BF16, converted once when the token arrives, and hands
attention views of them tagged BF16-exact (:func:`fp8rl_core.cpu_numerics.cpu_gemm.mark_bf16_exact`), which
the ``fp32`` path takes as they are. Attention sees the same float32 values as with the plain
cache, so the logits are bit-identical; what goes is the per-step conversion and the growth copy.

Memory: ``4 * batch * kv_heads * capacity * head_dim`` bytes each for keys and values, allocated
at the prefill for the whole chunk's length (prompt width + ``max_new_tokens``); the plain cache
holds float32 keys and BF16 values of the tokens so far, so at full length this is 4/3 of it
(2x against an all-BF16 cache). CPU only: on CUDA the GEMMs are the hardware's BF16 kernels,
which read the BF16 cache directly, and nothing is converted.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from fp8rl_core.cpu_numerics.cpu_gemm import mark_bf16_exact


class MirrorLayer(DynamicLayer):
    """One layer's keys and values in float32 buffers of ``capacity`` positions, BF16-rounded on arrival."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        if capacity < 1:
            raise ValueError(f"MirrorLayer: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._k: torch.Tensor | None = None  # [B, H, capacity, D] float32
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        b, h, _, dk = key_states.shape
        self._k = torch.empty((b, h, self.capacity, dk), dtype=torch.float32, device=self.device)
        self._v = torch.empty((b, h, self.capacity, value_states.shape[-1]), dtype=torch.float32, device=self.device)
        self._publish(0)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new positions (rounded to BF16, held in float32); return tagged views of all so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"MirrorLayer: {end} positions exceed the capacity of {self.capacity}")
        self._k[:, :, start:end].copy_(key_states.to(torch.bfloat16))
        self._v[:, :, start:end].copy_(value_states.to(torch.bfloat16))
        self._publish(end)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (finished rows dropped), buffers and views alike."""
        if self.is_initialized:
            length = self.keys.shape[-2]
            self._k, self._v = self._k[indices], self._v[indices]
            self._publish(length)

    def _publish(self, length: int) -> None:
        self.keys = mark_bf16_exact(self._k[:, :, :length])
        self.values = mark_bf16_exact(self._v[:, :, :length])

    def _unsupported(self, *args, **kwargs) -> None:
        raise NotImplementedError("MirrorLayer supports update and batch_select_indices only (the rollout loop)")

    crop = batch_repeat_interleave = reorder_cache = reset = _unsupported


class MirroredKVCache(DynamicCache):
    """A ``DynamicCache`` whose layers are :class:`MirrorLayer` of ``capacity`` positions (full attention only)."""

    def __init__(self, config, capacity: int) -> None:
        super().__init__(config=config)
        if any(type(layer) is not DynamicLayer for layer in self.layers):
            raise ValueError("MirroredKVCache: only models whose every layer has full attention")
        self.layers = [MirrorLayer(capacity) for _ in self.layers]
