"""The transformers rollout engine: a lean batched sampling loop over a KV cache.

Runs on CPU (the tiny default campaign) and on small GPU runs. It does not call
``model.generate``; it drives the model forward itself, because that is both
faster for small models (no logits-processor / stopping-criteria machinery per
step) and the simplest way to get the exact log-prob of every sampled token:
the loop holds the very logits it samples from.

The loop, for a chunk of ``B`` sequences (``config.generation_batch_size``):

1. **Prefill.** Prompts of unequal length are *left*-padded to ``T`` tokens:
   ``input_ids [B, T]`` with ``pad_id`` on the left, ``attention_mask [B, T]``
   0 there, and ``position_ids = cumsum(mask) - 1`` (clamped at 0), so every
   prompt's first real token sits at position 0 exactly as it would unpadded.
   One forward fills a ``DynamicCache`` and returns the last position's logits
   (``logits_to_keep=1``: the LM head runs on one position, not ``T``).
2. **Decode.** Sample ``y [B]`` from the ``[B, V]`` logits (below), append it,
   extend the mask by a column of ones, advance each row's position by one, and
   run a one-token forward against the cache. Rows that already emitted EOS keep
   being fed ``pad_id`` (their outputs are discarded) until a quarter of the
   rows are done; then the finished rows are dropped from the batch and from the
   KV cache (``cache.batch_select_indices``), so short answers stop costing
   compute — the loop ends when every row is done or at ``max_new_tokens``.
3. **Sampling.** Logits are taken in fp32. ``T = 0``: greedy (argmax). Otherwise
   ``z = logits / T``; for ``top_p < 1`` the tokens outside the nucleus (the
   smallest top set whose mass reaches ``top_p``) get ``-inf``; then
   ``y ~ softmax(z)`` by an exponential race (``argmax p / E``, ``E ~ Exp(1)``,
   as vLLM samples and as ``torch.multinomial`` does inside) driven by a
   ``torch.Generator`` seeded from ``seed``. There is no top-k (vLLM's
   ``top_k=0``/``-1``; ``model.generate`` defaults to ``top_k=50``, which is
   *not* true sampling).
   The returned log-prob is ``log_softmax(z)[y]`` (``logprobs_mode="processed"``,
   vLLM's ``processed_logprobs``) or ``log_softmax(logits)[y]`` (``"raw"``).

Sequences are bucketed by prompt length (stable sort) before chunking, to cut
padding, and put back in group layout afterwards. The same seed, prompts and
config give the same samples.

**Precision.** The engine samples from an *inference copy* of the policy made by
``fp8rl_core.precision.rollout.convert_for_rollout(model, precision.rollout, dtype=copy_dtype)``:
plain linears (``bf16``) or FP8 W8A8 emulation (``fp8_per_tensor``: per-tensor
weight scale, dynamic per-token activation scale; ``fp8_per_block``: 128x128
weight / 1x128 activation blocks, as vLLM's online FP8), refreshed by
``sync_rollout_weights`` (which re-quantizes the FP8 layers) in
:meth:`TransformersEngine.load_weights`. Forwards run under the mode's BF16
autocast (``precision.autocast_context``). With the default fp32 copy this is
exactly the trainer's BF16-mode numerics (docs/method.md, "Precision modes": fp32 values,
bf16 matmuls), so the rollout log-probs match the train stage's recomputation
to within KV-cache rounding (tiny model: mean |diff| 0.008 nats; 0.03 for the
FP8 modes against a forward of the same FP8 copy, whose discontinuous rounding
amplifies the bf16 differences; all exact in fp32). ``copy_dtype=torch.bfloat16`` halves the copy's
memory and keeps the whole residual stream in bf16, like vLLM.
``bf16_autocast=False`` computes in ``copy_dtype`` (fp32: the exact reference
the tests use). On the CPU ``fp32`` GEMM path (``cpu_bf16_gemm``) the KV cache is
held as the float32 BF16 values attention consumes, converted once per token
instead of whole at every step (:mod:`stages.engines.kv_mirror`; same bits).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import DynamicCache

from fp8rl_core.cpu_numerics.cpu_gemm import fp32_gemms_active
from fp8rl_core.cpu_numerics.portable_math import reuse_weight_grids
from fp8rl_core.precision.autocast import autocast_context
from fp8rl_core.precision.rollout import convert_for_rollout, sync_rollout_weights
from stages.engines.base import (
    LOGPROBS_MODES,
    EngineInputs,
    LogprobsMode,
    RolloutBatch,
    RolloutEngine,
    RolloutSample,
    SamplingRequest,
    register_engine,
    validate_generate_args,
)
from stages.engines.kv_mirror import MirroredKVCache
from stages.engines.weight_transfer import full_parameter

if TYPE_CHECKING:
    from typing_extensions import Unpack


def _token_id_set(*values: Any) -> frozenset[int]:
    ids: set[int] = set()
    for v in values:
        if v is None:
            continue
        ids.update(int(x) for x in (v if isinstance(v, (list, tuple, set, frozenset)) else [v]))
    return frozenset(ids)


def top_p_mask(scaled_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set the logits outside the nucleus to ``-inf``.

    ``scaled_logits [B, V]`` fp32. The nucleus of a row is the smallest set of
    top tokens whose softmax mass reaches ``top_p``; the most likely token is
    always kept. Returns a new ``[B, V]`` tensor.
    """
    sorted_logits, order = scaled_logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(scaled_logits).scatter_(-1, order, sorted_logits)


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    logprobs_mode: LogprobsMode,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row. ``logits [B, V]`` fp32 -> ``(tokens [B] int64, logprobs [B] fp32, source
    [B, V])``: ``source`` holds the log-probs the tokens are reported under (the distribution sampled
    from, or the raw one), where a token's log-prob and its row's top-k come from."""
    if temperature == 0.0:
        tokens, source = logits.argmax(dim=-1), logits.log_softmax(dim=-1)
        return tokens, source.gather(-1, tokens[:, None]).squeeze(-1), source
    scaled = logits / temperature
    if top_p < 1.0:
        scaled = top_p_mask(scaled, top_p)
    processed = scaled.log_softmax(dim=-1)
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) i.i.d. draws i with
    # probability p_i (as vLLM samples); cheaper than torch.multinomial per step.
    race = (
        torch.empty_like(processed).exponential_(1.0, generator=generator).clamp_(min=torch.finfo(torch.float32).tiny)
    )
    tokens = (processed.exp() / race).argmax(dim=-1)
    source = processed if logprobs_mode == "processed" else logits.log_softmax(dim=-1)
    return tokens, source.gather(-1, tokens[:, None]).squeeze(-1), source


class _FullStateView:
    """What ``sync_rollout_weights`` reads of a policy (``state_dict()``), each sharded tensor gathered."""

    def __init__(self, state: dict) -> None:
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def full_view(train_model: nn.Module) -> nn.Module | _FullStateView:
    """``train_model`` itself, or (FSDP2) a view of its full fp32 state, gathered one parameter at a time."""
    from torch.distributed.tensor import DTensor

    state = train_model.state_dict()
    if not any(isinstance(t, DTensor) for t in state.values()):
        return train_model
    return _FullStateView({name: full_parameter(t) for name, t in state.items()})


@register_engine("transformers")
class TransformersEngine(RolloutEngine):
    """Batched KV-cache sampling with a transformers causal LM (see the module docstring).

    Args:
        model: the trainer's policy (fp32 masters); it is copied, not modified.
        tokenizer: supplies ``eos_token_id`` / ``pad_token_id`` (may be ``None``
            when ``model.generation_config`` has them).
        precision: ``precision.rollout`` picks bf16 / ``fp8_per_tensor`` / ``fp8_per_block``.
        config: ``config.generation_batch_size`` sequences are generated at once.
        logprobs_mode: ``"processed"`` (default) or ``"raw"``; see :mod:`stages.engines.base`.
        copy_dtype: dtype of the inference copy's values (fp32 default; bf16 halves memory).
        bf16_autocast: run forwards under the rollout mode's BF16 autocast (default);
            ``False`` computes in ``copy_dtype``.
        kv_mirror: on the CPU ``fp32`` GEMM path, keep the KV cache as the float32 values attention
            consumes (:mod:`stages.engines.kv_mirror`; same bits, faster decoding; ``False``: plain cache).
    """

    COMPACT_FRACTION_INV = 4
    """Drop finished rows from the batch once ``1 / COMPACT_FRACTION_INV`` of it is finished."""

    def __init__(
        self,
        *,
        logprobs_mode: LogprobsMode = "processed",
        copy_dtype: torch.dtype = torch.float32,
        bf16_autocast: bool = True,
        kv_mirror: bool = True,
        **inputs: Unpack[EngineInputs],
    ) -> None:
        model, tokenizer, precision, config = self._take_inputs(inputs)
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self.bf16_autocast = bf16_autocast
        self.kv_mirror = kv_mirror
        self.model: nn.Module | None = convert_for_rollout(
            model, precision.rollout, dtype=copy_dtype, weight_format=config.weight_format
        )
        gen_cfg = getattr(model, "generation_config", None)
        self.eos_ids = _token_id_set(getattr(tokenizer, "eos_token_id", None), getattr(gen_cfg, "eos_token_id", None))
        if not self.eos_ids:
            raise ValueError("no EOS id: neither the tokenizer nor model.generation_config defines eos_token_id")
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else getattr(gen_cfg, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else min(self.eos_ids)
        self.max_positions: int | None = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        # transformers >= 5.2x names the cache argument `cache`; earlier 5.x `past_key_values`.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ API
    def generate(self, prompt_ids: list[list[int]], request: SamplingRequest) -> RolloutBatch:
        """Samples of the whole call come from one generator seeded by ``request.seed``; per-prompt
        ``seeds`` are checked and otherwise not used (one stream per call is what makes a
        call's samples reproducible: ``stages.runtime.rollout_plan`` keeps calls rank-independent)."""
        model = self._require_model()
        validate_generate_args(prompt_ids, request)
        n, max_new_tokens = request.n, request.max_new_tokens
        longest = max(len(p) for p in prompt_ids)
        if self.max_positions is not None and longest + max_new_tokens > self.max_positions:
            raise ValueError(
                f"generate: longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's max_position_embeddings ({self.max_positions}); shorten prompts or lower max_new_tokens"
            )
        start = time.perf_counter()
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(request.seed)
        # Bucket by prompt length (stable), generate in chunks, then restore group layout.
        by_length = sorted(range(len(prompt_ids)), key=lambda p: len(prompt_ids[p]))
        rows = [(p, i) for p in by_length for i in range(n)]
        results: dict[tuple[int, int], RolloutSample] = {}
        chunk = self.config.generation_batch_size
        compute = autocast_context(self.precision_mode, device) if self.bf16_autocast else contextlib.nullcontext()
        # one weight version for the whole call: under the portable CPU numerics each weight is put on its
        # grid once, not at the prefill and every decoding step
        with torch.inference_mode(), compute, reuse_weight_grids():
            for lo in range(0, len(rows), chunk):
                part = rows[lo : lo + chunk]
                outs = self._generate_chunk(
                    [prompt_ids[p] for p, _ in part],
                    temperature=request.temperature,
                    top_p=request.top_p,
                    max_new_tokens=max_new_tokens,
                    generator=generator,
                    device=device,
                    top_k=request.top_k,
                )
                for (p, i), (ids, logps, reason, top) in zip(part, outs):
                    results[(p, i)] = RolloutSample(p, i, ids, logps, reason, *top)
        samples = [results[(p, i)] for p in range(len(prompt_ids)) for i in range(n)]
        return self.batch(samples, len(prompt_ids), n, start)

    def load_weights(self, train_model: nn.Module) -> None:
        """Copy the trainer's weights in; an FSDP2-sharded trainer is gathered parameter by parameter
        (every rank together) into this engine's own full copy."""
        sync_rollout_weights(self._require_model(), full_view(train_model))

    def close(self) -> None:
        self.model = None

    # ------------------------------------------------------------ internals
    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("this TransformersEngine was closed; build a new one with make_engine(...)")
        return self.model

    def _forward(self, model: nn.Module, cache: DynamicCache, **inputs: torch.Tensor) -> torch.Tensor:
        """One forward against ``cache``; returns the last position's logits ``[B, V]`` in fp32."""
        out = model(**inputs, **{self._cache_kw: cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float()

    def _new_cache(self, model: nn.Module, device: torch.device, *, capacity: int) -> DynamicCache:
        """A :class:`MirroredKVCache` where attention consumes the cache as BF16 values in float32 (CPU,
        BF16 autocast, ``cpu_bf16_gemm: fp32``; bit-identical, no per-step conversion); else a ``DynamicCache``."""
        mirror = (
            self.kv_mirror
            and self.bf16_autocast
            and device.type == "cpu"
            and fp32_gemms_active()
            and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16
        )
        return MirroredKVCache(model.config, capacity) if mirror else DynamicCache(config=model.config)

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        generator: torch.Generator,
        device: torch.device,
        top_k: int = 0,
    ) -> list[tuple[list[int], list[float], str, tuple]]:
        """Sample one response per prompt row; returns ``(ids, logprobs, finish_reason, top)`` per row, ``top``
        the row's ``(top ids, top log-probs)`` per token with ``top_k``, else ``(None, None)``."""
        model = self._require_model()
        batch, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)  # [B, T], left-padded
        attention_mask = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
        for r, p in enumerate(prompts):
            input_ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[r, width - len(p) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, T]
        eos = torch.tensor(sorted(self.eos_ids), dtype=torch.long, device=device)

        cache = self._new_cache(model, device, capacity=width + max_new_tokens)
        logits = self._forward(
            model, cache, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        )  # [B, V]
        next_position = position_ids[:, -1:] + 1  # [A, 1]
        tokens = torch.full((batch, max_new_tokens), self.pad_id, dtype=torch.long, device=device)  # [B, S]
        logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)  # [B, S]
        top_ids = torch.zeros((batch, max_new_tokens, top_k), dtype=torch.long, device=device)  # [B, S, K]
        top_lps = torch.zeros((batch, max_new_tokens, top_k), dtype=torch.float32, device=device)  # [B, S, K]
        rows = torch.arange(batch, device=device)  # [A]: output row of each sequence still in the batch
        finished = torch.zeros(batch, dtype=torch.bool, device=device)  # [A]
        for step in range(max_new_tokens):
            tok, logp, source = sample_next(
                logits, temperature=temperature, top_p=top_p, generator=generator, logprobs_mode=self.logprobs_mode
            )
            if top_k:
                top_lps[rows, step], top_ids[rows, step] = source.topk(top_k, dim=-1)
            tok = tok.masked_fill(finished, self.pad_id)
            tokens[rows, step], logprobs[rows, step] = tok, logp
            finished |= torch.isin(tok, eos)
            done = int(finished.sum())
            if step == max_new_tokens - 1 or done == len(rows):
                break
            if done * self.COMPACT_FRACTION_INV >= len(rows):
                keep = (~finished).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, tok, finished = rows[keep], tok[keep], finished[keep]
                attention_mask, next_position = attention_mask[keep], next_position[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], dim=1)
            logits = self._forward(
                model, cache, input_ids=tok[:, None], attention_mask=attention_mask, position_ids=next_position
            )
            next_position = next_position + 1

        # Response length: through the first EOS, else the whole (max_new_tokens) row.
        is_eos = torch.isin(tokens, eos)  # [B, S]
        has_eos = is_eos.any(dim=1)
        lengths = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, max_new_tokens)
        token_rows, logprob_rows = tokens.tolist(), logprobs.tolist()
        id_rows, lp_rows = (top_ids.tolist(), top_lps.tolist()) if top_k else ([None] * batch, [None] * batch)
        out = []
        for r, k in enumerate(lengths.tolist()):
            top = (id_rows[r][:k], lp_rows[r][:k]) if top_k else (None, None)
            out.append((token_rows[r][:k], logprob_rows[r][:k], "stop" if bool(has_eos[r]) else "length", top))
        return out
