"""Advantage estimators and DAPO reward shaping (docs/method.md, "Advantages").

GRPO (Shao et al. 2024) samples a group of G responses per prompt and scores each
sequence against its own group instead of a learned value function::

    A_i = (R_i - mean_g R) / (std_g R + eps)        std unbiased (divisor G - 1)

A group of size 1 has no spread to normalise by; following verl it uses mean 0
and std 1, so its advantage is ``R / (1 + eps)``. Dr.GRPO (Liu et al. 2025,
"Understanding R1-Zero-like training") drops the std division, which biases
updates toward low-variance (too easy or too hard) prompts: ``A_i = R_i - mean_g R``.
The sequence advantage is broadcast to every response token by the caller.

DAPO (Yu et al. 2025) adds two reward-side pieces, both here:

* dynamic sampling: a group whose *accuracies* are all 0 or all 1 is dropped (and
  the rollout stage refills the batch with new generations). DAPO filters on
  accuracy (verl's ``filter_groups.metric: acc``), not on the shaped reward: a
  group of all-correct answers whose overlong penalties differ has unequal
  rewards, hence nonzero advantages, but they only rank lengths, not answers;
* overlong shaping, a soft length penalty in the last ``L_cache`` tokens before
  ``L_max``: ``R_len = min(-(|y| - (L_max - L_cache)) / L_cache * factor, 0)``.

All functions are vectorised with scatter/index ops (no Python loop over groups)
and pure: tensors in, tensors out. Estimators are selected by name through
``ADVANTAGE_ESTIMATORS`` with the uniform signature
``fn(rewards [N] float, group_index [N] long) -> advantages [N] float``.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8rl_core.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "drgrpo_advantages",
    "dynamic_sampling_mask",
    "grpo_advantages",
    "overlong_penalty",
]

AdvantageEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _check_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> None:
    if rewards.dim() != 1 or group_index.dim() != 1 or rewards.shape != group_index.shape:
        raise ValueError(
            f"rewards and group_index must be 1-D of the same length, got {tuple(rewards.shape)} "
            f"and {tuple(group_index.shape)}"
        )
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
        raise TypeError(f"group_index must be an integer tensor (one group id per sequence), got {group_index.dtype}")


def _out_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.dtype.is_floating_point else torch.float32


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-sequence GRPO (``std_normalize=True``) or Dr.GRPO advantages.

    Args:
        rewards: ``[N]`` float (or int) sequence rewards.
        group_index: ``[N]`` integer group id of each sequence (the prompt); ids
            need not be contiguous or sorted.
        std_normalize: divide by the unbiased group std + ``eps`` (GRPO); False
            gives Dr.GRPO (centering only).
        eps: added to the std before dividing.

    Returns:
        ``[N]`` advantages, dtype of ``rewards`` (float32 for integer rewards).
        Statistics are accumulated in float64.
    """
    _check_groups(rewards, group_index)
    out_dtype = _out_dtype(rewards)
    if rewards.numel() == 0:
        return torch.empty(0, dtype=out_dtype, device=rewards.device)
    r = rewards.to(torch.float64)  # [N]
    _, inv = torch.unique(group_index, return_inverse=True)  # inv: [N] in [0, G)
    n_groups = int(inv.max()) + 1
    counts = torch.bincount(inv, minlength=n_groups).to(torch.float64)  # [G]
    sums = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, r)
    mean = sums / counts  # [G]
    dev = r - mean[inv]  # [N]
    sq = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, dev * dev)
    single = counts == 1
    std = torch.sqrt(sq / (counts - 1).clamp_min(1.0))  # [G], unbiased
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    adv = r - mean[inv]
    if std_normalize:
        adv = adv / (std[inv] + eps)
    return adv.to(out_dtype)


def drgrpo_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: ``R - mean_g R`` (a group of size 1 keeps ``R``). Shapes as ``grpo_advantages``."""
    return grpo_advantages(rewards, group_index, std_normalize=False)


ADVANTAGE_ESTIMATORS.register("grpo")(lambda rewards, group_index: grpo_advantages(rewards, group_index))
ADVANTAGE_ESTIMATORS.register("drgrpo")(drgrpo_advantages)


def dynamic_sampling_mask(accuracy: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: ``[N]`` bool, True = keep the sequence.

    Args:
        accuracy: ``[N]`` per-sequence accuracy (1 correct, 0 wrong; the
            verifier's judgement, NOT the shaped reward).
        group_index: ``[N]`` integer group ids.

    A sequence is dropped when every accuracy of its group is equal (exact
    equality: all 0 or all 1; this includes groups of size 1).
    """
    rewards = accuracy
    _check_groups(rewards, group_index)
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    r = rewards.to(torch.float64)
    _, inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(inv.max()) + 1
    gmax = torch.full((n_groups,), float("-inf"), dtype=torch.float64, device=r.device)
    gmin = torch.full((n_groups,), float("inf"), dtype=torch.float64, device=r.device)
    gmax = gmax.scatter_reduce(0, inv, r, reduce="amax", include_self=False)
    gmin = gmin.scatter_reduce(0, inv, r, reduce="amin", include_self=False)
    return (gmax != gmin)[inv]


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, cache_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO overlong reward shaping, exactly the formula of docs/method.md, "Advantages".

    ``R_len = min(-(|y| - (max_len - cache_len)) / cache_len * factor, 0)``: zero
    up to ``max_len - cache_len`` tokens, then a linear ramp reaching
    ``-factor`` at ``max_len``. Unlike the DAPO paper the ramp is not floored at
    ``-factor`` beyond ``max_len`` (responses are capped at ``max_len`` by the
    rollout, so the case does not arise when ``max_len = max_new_tokens``).

    Args:
        lengths: ``[N]`` response lengths in tokens (any numeric dtype).
    Returns:
        ``[N]`` float32 penalties (<= 0), to be added to the rewards.
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(
            f"overlong_penalty needs 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}"
        )
    y = lengths.to(torch.float32)
    return torch.clamp(-(y - (max_len - cache_len)) / cache_len * factor, max=0.0) + 0.0  # + 0.0: no -0.0
