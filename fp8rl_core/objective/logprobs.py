"""Per-token log-probabilities and entropies of a causal LM, without a float32 vocab copy.

For logits z [B, T, V] and labels y [B, T]:

    logp[b, t]    = z[b, t, y] - logsumexp(z[b, t])
    entropy[b, t] = -sum_v p_v log p_v = logsumexp(z[b, t]) - sum_v p_v z[b, t, v]

For a real vocabulary the float32 copy of the logits is the largest tensor of an
RL step (Qwen3: V = 151,936; 256 sequences x 16K tokens would be 2.5 TB), so
``token_logprobs_and_entropy`` walks the flattened tokens in chunks, upcasting
one chunk at a time, and its backward recomputes the softmax chunk by chunk
from the saved (BF16) logits and per-token log-sum-exp, using

    d logp / dz    = onehot(y) - p
    d entropy / dz = -p * (log p + entropy)

so autograd holds no float32 [tokens, V] tensor either.

``sequence_logprobs`` runs a model over padded sequences under the autocast of
a precision mode and returns logp[:, t] = log pi(x_t | x_<t) (0 where there is no
real context: column 0, padded positions, the first token after left padding),
with position ids counted over real tokens.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from fp8rl_core.cpu_numerics import cpu_gemm
from fp8rl_core.precision.autocast import autocast_context
from fp8rl_core.precision.bf16_pass import bf16_parameters, bf16_shadow

# Elements of one float32 chunk (64 MiB) when chunk_size is not given.
_DEFAULT_CHUNK_ELEMS = 1 << 24


def _blocks(b: int, t: int, v: int, chunk_size: int | None) -> list[tuple[slice, slice]]:
    """(batch slice, time slice) blocks of at most ``chunk_size`` tokens (default: 64 MiB of float32).

    Whole sequences are grouped while they fit, long sequences are split in time,
    so a block of any [B, T, V] view (e.g. ``logits[:, :-1]``) is sliced, never copied whole.
    """
    if chunk_size is None:
        chunk_size = max(1, _DEFAULT_CHUNK_ELEMS // v)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}")
    if t == 0:
        return []
    if chunk_size >= t:
        per = chunk_size // t
        return [(slice(b0, b0 + per), slice(0, t)) for b0 in range(0, b, per)]
    return [(slice(b0, b0 + 1), slice(t0, t0 + chunk_size)) for b0 in range(b) for t0 in range(0, t, chunk_size)]


class _ChunkedLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, blocks: list[tuple[slice, slice]]):
        # logits: [B, T, V] (any float dtype, any strides), labels: [B, T] int64
        b, t, _ = logits.shape
        logp = torch.empty(b, t, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(b, t, dtype=torch.float32, device=logits.device)
        lse = torch.empty(b, t, dtype=torch.float32, device=logits.device)
        for bs, ts in blocks:
            z = logits[bs, ts].to(torch.float32, copy=True)  # [nb, nt, V]: the one float32 copy, per block
            l = torch.logsumexp(z, dim=-1)  # [nb, nt]
            lse[bs, ts] = l
            logp[bs, ts] = z.gather(-1, labels[bs, ts, None]).squeeze(-1) - l
            log_q = z.sub_(l[..., None])  # log softmax, in place
            entropy[bs, ts] = -(log_q.exp() * log_q).sum(-1)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.blocks = blocks
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)  # [B, T, V]
        for bs, ts in ctx.blocks:
            log_q = logits[bs, ts].to(torch.float32, copy=True).sub_(lse[bs, ts, None])  # [nb, nt, V]
            p = cpu_gemm.exp(log_q)  # the campaign's exp, also here where modes do not reach
            gz = torch.zeros_like(p)
            if grad_logp is not None:
                gl = grad_logp[bs, ts, None]
                gz.addcmul_(p, gl, value=-1.0)
                gz.scatter_add_(-1, labels[bs, ts, None], gl)
            if grad_entropy is not None:
                gz.addcmul_(p * log_q.add_(entropy[bs, ts, None]), grad_entropy[bs, ts, None], value=-1.0)
            grad[bs, ts] = gz
        return grad, None, None


def token_logprobs_and_entropy(
    logits: torch.Tensor, labels: torch.Tensor, *, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label and entropy of each distribution, both float32 [B, T].

    logits: [B, T, V] (BF16 or float32; a strided view such as ``logits[:, :-1]`` is
    fine), labels: [B, T] int in [0, V). chunk_size: tokens upcast to float32 at
    once (default: 64 MiB worth). Differentiable w.r.t. logits, with the same
    chunked memory in backward.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must be [B, T] = {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    b, t, v = logits.shape
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= v):
        raise ValueError(f"labels must lie in [0, {v}), got range [{int(labels.min())}, {int(labels.max())}]")
    blocks = _blocks(b, t, v, chunk_size)
    return _ChunkedLogprobEntropy.apply(logits, labels.long(), blocks)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 0/1 mask -> [B, T] positions counting real tokens only (0 on left padding)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min_(0)


def center_scores(
    logits: torch.Tensor, labels: torch.Tensor, logp: torch.Tensor, ids: torch.Tensor, mu: torch.Tensor
) -> torch.Tensor:
    """``logp`` with the same values and a centered gradient: d/dz = onehot(y) - mu instead of onehot(y) - p.

    The score of a sampled token, grad log p(y) = onehot(y) - p for logits z, has the mean
    mu - p under the distribution ``mu`` it was drawn from, which is not zero when ``mu`` (the
    rollout engine's) differs from ``p`` (the trainer's). Subtracting it centers the score:
    grad log p(y) - sum_v mu_v grad log p(v). With the cross-entropy
    ce = -sum_v mu_v log p(v) = logsumexp(z) - sum_v mu_v z_v (``mu`` sums to 1), whose gradient
    is p - mu, the centered score is grad(log p(y) + ce); so ``logp + ce - ce.detach()`` keeps every
    value (ratios, clipping, metrics) and carries the centered gradient into whatever loss uses it.
    ``logsumexp(z) = z_y - log p(y)``, so no second pass over the vocabulary is needed.

    logits ``[B, T, V]``, labels ``[B, T]``, logp ``[B, T]`` (from ``logits``), ids ``[B, T, K]``
    and mu ``[B, T, K]`` (rows summing to 1, or 0 where a position has none: no term there).
    """
    z_y = logits.gather(-1, labels[..., None]).squeeze(-1).float()
    z_k = logits.gather(-1, ids.long()).float()  # [B, T, K]
    has = (mu.sum(-1) > 0).to(logp.dtype)
    ce = (z_y - logp) * has - (mu * z_k).sum(-1)
    return logp + (ce - ce.detach())


def sequence_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    mode: str = "bf16",
    micro_batch_size: int | None = None,
    with_entropy: bool = True,
    chunk_size: int | None = None,
    centering: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log pi(x_t | x_<t) and entropy of pi(. | x_<t) of ``model``, float32 [B, T].

    ``centering = (ids [B, T, K], mu [B, T, K])``: score centering (:func:`center_scores`) with the
    sampling distribution ``mu`` of token ``t`` over ``ids`` (rows summing to 1; 0 where none).

    input_ids, attention_mask: [B, T] (1 = real token; right-padded responses,
    left or right padded prompts). Positions without a real token and a real
    predecessor (column 0, padding, the first token after left padding) are 0. Runs
    under ``autocast_context(mode)``; an FP8-converted model computes in FP8,
    wrap the call in ``precision.bf16_shadow(model)`` for its BF16 shadow pass.
    Differentiable when grad is enabled. entropy is None if ``with_entropy`` is False.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            "input_ids and attention_mask must both be [B, T], got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    b, t = input_ids.shape
    if micro_batch_size is not None and micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or None, got {micro_batch_size}")
    step = b if micro_batch_size is None else micro_batch_size
    mask = attention_mask.to(torch.long)
    positions = position_ids_from_mask(mask)  # [B, T]
    logps, ents = [], []
    for s in range(0, b, step):
        sl = slice(s, s + step)
        with autocast_context(mode, input_ids.device):
            out = model(input_ids=input_ids[sl], attention_mask=mask[sl], position_ids=positions[sl], use_cache=False)
            logits = out.logits  # [b, T, V] (BF16 under autocast)
        # logits[:, t] predicts x_{t+1}: a strided view, sliced block by block, not copied
        lp, ent = token_logprobs_and_entropy(logits[:, :-1], input_ids[sl, 1:], chunk_size=chunk_size)  # [b, T-1]
        if centering is not None:
            lp = center_scores(logits[:, :-1], input_ids[sl, 1:], lp, centering[0][sl, 1:], centering[1][sl, 1:])
        logps.append(lp)
        ents.append(ent)
    valid = (mask[:, 1:] * mask[:, :-1]).bool()  # [B, T-1]: token t and its predecessor are real
    zero = torch.zeros(b, 1, dtype=torch.float32, device=input_ids.device)

    def place(parts: list[torch.Tensor]) -> torch.Tensor:  # [B, T-1] for x_1.. -> [B, T] for x_0..
        return torch.cat([zero, torch.where(valid, torch.cat(parts), 0.0)], dim=1)

    return place(logps), (place(ents) if with_entropy else None)


def master_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    mode: str,
    shadow: bool = False,
    with_entropy: bool = False,
    centering: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`sequence_logprobs` computed on the bf16 casts of ``model``'s fp32 masters, as FSDP2's all-gather
    hands them over (:func:`fp8rl_core.precision.bf16_pass.bf16_parameters`), so one process and N ranks
    compute alike; ``shadow``: the BF16 shadow pass (the same weights, FP8 linears bypassed; ``mode`` bf16)."""
    with bf16_parameters(model), bf16_shadow(model) if shadow else contextlib.nullcontext():
        return sequence_logprobs(model, input_ids, attention_mask, mode=mode, with_entropy=with_entropy,
                                 centering=centering)
