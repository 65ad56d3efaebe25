"""The train step's one forward path, and the kernels' shape contracts.

Every forward of a step — π_old, π_θ and both shadow passes —
goes through :func:`policy_logprobs` (the no-grad ones through :func:`no_grad_logprobs`), which calls
:func:`fp8rl_core.objective.logprobs.sequence_logprobs` (autocast of the inputs' device,
position ids counted over real tokens, log-softmax chunked over the vocabulary).

Kernel shape contracts (docs/method.md, "Precision modes"): :func:`policy_logprobs` pads each
micro-batch on the right (attention mask 0, so no real token sees the padding;
loss mask 0, so no padded column enters a loss or a statistic) until its token
count ``rows x T`` is a multiple of :func:`token_multiple` of the precision mode
(16 for tensorwise/rowwise ``_scaled_mm``, 128 for torchao's blockwise backward).
Padding tokens do enter a tensorwise activation amax, as they would on the GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8rl_core.config.precision_kinds import PRECISION_MODES
from fp8rl_core.objective.logprobs import master_logprobs


def token_multiple(mode: str) -> int:
    """Token-count multiple a micro-batch must meet for ``mode``'s FP8 kernels (1 for bf16)."""
    return PRECISION_MODES.get(mode).token_multiple


def padded_width(rows: int, width: int, multiple: int) -> int:
    """Smallest ``T >= width`` with ``rows * T`` a multiple of ``multiple``."""
    step = multiple // math.gcd(rows, multiple) if rows else 1
    return -(-width // step) * step


def pad_to_contract(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, multiple: int, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``[m, T]`` to ``[m, T']`` with ``m * T'`` a multiple of ``multiple`` (mask 0)."""
    m, t = input_ids.shape
    extra = padded_width(m, t, multiple) - t
    if extra == 0:
        return input_ids, attention_mask
    pad = (0, extra)
    return (
        torch.nn.functional.pad(input_ids, pad, value=pad_id),
        torch.nn.functional.pad(attention_mask, pad, value=0),
    )


def _widen(x: torch.Tensor, t: int) -> torch.Tensor:
    """``[m, w]`` -> ``[m, t]``, zeros on the right (the columns a trimmed micro-batch did not compute)."""
    return x if x.shape[1] == t else torch.nn.functional.pad(x, (0, t - x.shape[1]))


def _widen3(x: torch.Tensor, t: int) -> torch.Tensor:
    """``[m, w, K]`` -> ``[m, t, K]``, zeros in the added columns."""
    return x if x.shape[1] == t else torch.nn.functional.pad(x, (0, 0, 0, t - x.shape[1]))


@dataclass(frozen=True)
class ForwardSpec:
    """How :func:`policy_logprobs` runs a forward: the precision mode, the pass, what it returns, its micro-batches."""

    mode: str  # the precision mode (``precision.train``)
    shadow: bool = False  # the BF16 shadow pass: same master weights, FP8 linears bypassed
    with_entropy: bool = False  # the per-token entropy beside the log-probs
    micro_batch_size: int | None = None  # rows a micro-batch (None: all at once)
    # each micro-batch cut to its own longest row before the kernel padding (token-budget micro-batches),
    # its outputs padded back with zeros
    trim: bool = False


def policy_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    spec: ForwardSpec,
    *,
    centering: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropy) of ``model`` over ``[N, T]``: the step's one forward path.

    Micro-batches of ``spec.micro_batch_size`` rows, each padded to ``spec.mode``'s kernel
    contract (:class:`ForwardSpec`). Every forward computes on the bf16 casts of the
    fp32 masters, as FSDP2's all-gather hands them over (``bf16_parameters``), so
    one process and N ranks compute alike. Differentiable when grad is enabled. Returns float32 ``[N, T]``
    (padding columns removed). ``centering``: ``(ids, mu)`` ``[N, T, K]`` of score centering
    (:func:`fp8rl_core.objective.logprobs.center_scores`; the values stay, the gradient is centered).
    """
    shadow, with_entropy, trim = spec.shadow, spec.with_entropy, spec.trim
    n, t = input_ids.shape
    step = n if spec.micro_batch_size is None else spec.micro_batch_size
    run_mode = "bf16" if shadow else spec.mode
    multiple = token_multiple(run_mode)
    lps, ents = [], []
    for s in range(0, n, max(step, 1)):
        w = int(attention_mask[s : s + step].sum(1).max()) if trim else t  # rows are right-padded
        ids, am = pad_to_contract(input_ids[s : s + step, :w], attention_mask[s : s + step, :w], multiple)
        center = None if centering is None else tuple(_widen3(c[s : s + step, :w], ids.shape[1]) for c in centering)
        lp, ent = master_logprobs(model, ids, am, mode=run_mode, shadow=shadow, with_entropy=with_entropy,
                                  centering=center)
        lps.append(_widen(lp[:, :w], t))
        ents.append(None if ent is None else _widen(ent[:, :w], t))
    if not lps:
        empty = torch.zeros(0, t, device=input_ids.device)
        return empty, (empty if with_entropy else None)
    lp = torch.cat(lps) if len(lps) > 1 else lps[0]
    ent = None if not with_entropy else (torch.cat(ents) if len(ents) > 1 else ents[0])
    return lp, ent


def no_grad_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micros: list[torch.Tensor],
    spec: ForwardSpec,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`policy_logprobs` without grad of each non-empty micro-batch ``r`` (row indices of the
    ``[N, T]`` ``input_ids`` and ``attention_mask``), one at a time: ``[(r, [len(r), T] float32)]``."""
    with torch.no_grad():
        return [(r, policy_logprobs(model, input_ids[r], attention_mask[r], spec)[0]) for r in micros if r.numel()]


def response_logprobs(
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    *,
    mode: str,
    micro_batch_size: int | None,
    pad_id: int,
) -> list[list[float]]:
    """Per response token, its log-prob under ``model`` in ``mode``, without grad: the rows laid out as the
    train stage lays them (prompt then response, right-padded), through :func:`policy_logprobs`. What the
    rollout side records of the trainer's policy with the weights that sampled a row (``rollouts.train_logp``)."""
    n = len(prompt_ids)
    if n == 0:
        return []
    width = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids))
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    am = torch.zeros((n, width), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        am[i, : len(p) + len(r)] = 1
    device = next(model.parameters()).device
    with torch.no_grad():
        spec = ForwardSpec(mode, micro_batch_size=micro_batch_size)
        lp, _ = policy_logprobs(model, ids.to(device), am.to(device), spec)
    lp = lp.float().cpu()
    return [lp[i, len(p) : len(p) + len(r)].tolist() for i, (p, r) in enumerate(zip(prompt_ids, response_ids))]
