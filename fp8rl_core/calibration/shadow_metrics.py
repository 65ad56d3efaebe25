"""What one shadow step measures of FP8's noise: the numbers its ``steps`` row records.

On a step whose train stage ran the BF16 shadow passes, every token has its log-probs under
π_θ and π_old in the training precision (FP8) and in BF16. From them (docs/method.md, "Clip
metrics" and "NMAE"): the probability and ratio NMAE and the noise amplification, the noise
sources (ratio noise against TIS-weight noise), the over- and under-clipped shares (FP8
clips a token BF16 would not, and the reverse), the lower-clip shares of A<0 tokens in FP8
and in BF16, and the clip shares by entropy bin. Tensors in, a dict of floats out.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fp8rl_core.calibration.noise_sources import noise_sources
from fp8rl_core.objective.losses import importance_ratio
from fp8rl_core.signals.diagnostics import (
    entropy_binned_clip_shares,
    noise_amplification,
    over_clipped_mask,
    under_clipped_mask,
)

__all__ = ["ENTROPY_BIN_EDGES", "ShadowTokens", "shadow_metrics"]

ENTROPY_BIN_EDGES = (0.0, 0.1, 0.5, 1.0, 2.0, float("inf"))


class ShadowTokens(Protocol):
    """The per-token results of one update a shadow step measures (all ``[N, T]`` float32)."""

    logp_fp8: torch.Tensor
    old_logp_fp8: torch.Tensor
    logp_bf16: torch.Tensor | None  # None: no shadow passes ran
    old_logp_bf16: torch.Tensor | None
    entropy: torch.Tensor
    row_bounds: torch.Tensor | None  # [N, 2]: each row's (L, H) where the clip mode sets them per row (BAPO)


def shadow_metrics(
    res: ShadowTokens,
    *,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_logp: torch.Tensor,
    bounds: tuple[float, float],
    standard: tuple[float, float],
    tis_cap: float = 2.0,
) -> dict[str, float]:
    """Probability/ratio NMAE, noise amplification, over/under-clipped shares, entropy bins, noise sources.

    ``advantages`` ``[N]``, ``response_mask`` and ``rollout_logp`` ``[N, T]``; ``bounds`` the (L, H) in
    force, ``standard`` the unclipped-by-calibration (1 - eps_low, 1 + eps_high). Empty without shadow passes.
    """
    if res.logp_bf16 is None:
        return {}
    # subsampled shadow: its rows
    mask = (response_mask > 0) & torch.isfinite(res.logp_bf16) & torch.isfinite(res.old_logp_bf16)
    amp = noise_amplification(res.logp_fp8, res.logp_bf16, res.old_logp_fp8, res.old_logp_bf16, mask)
    out = {k: float(v) for k, v in amp.items()}
    out.update(noise_sources(res.logp_fp8, res.old_logp_fp8, res.logp_bf16, res.old_logp_bf16, rollout_logp, mask,
                             tis_cap=tis_cap))  # ratio noise vs TIS-weight noise
    r8 = importance_ratio(res.logp_fp8, res.old_logp_fp8)
    r16 = importance_ratio(res.logp_bf16, res.old_logp_bf16)
    adv = advantages[:, None].expand_as(r8)
    neg = mask & (adv < 0)
    n_valid = max(int(mask.sum()), 1)
    eps_low = 1.0 - standard[0]
    low = bounds[0] if res.row_bounds is None else res.row_bounds[:, :1]  # [N, 1]: each row's L (BAPO)
    over = over_clipped_mask(r8, r16, adv, mask, eps_low=eps_low, lower=low)
    under = under_clipped_mask(r8, r16, adv, mask, eps_low=eps_low, lower=low)
    out["overclipped_share"] = float(over.sum()) / n_valid
    out["underclipped_share"] = float(under.sum()) / n_valid
    n_neg = max(int(neg.sum()), 1)
    out["lower_clip_share_neg_fp8"] = float((neg & (r8 < low)).sum()) / n_neg
    out["lower_clip_share_neg_bf16"] = float((neg & (r16 < standard[0])).sum()) / n_neg
    bins = entropy_binned_clip_shares(res.entropy, r8, adv, mask, edges=ENTROPY_BIN_EDGES, lower=bounds[0],
                                      upper=bounds[1])
    for i, b in enumerate(bins):
        out[f"clipfrac_lower_entropy_bin{i}"] = b["clipfrac_lower"]
        out[f"clipfrac_upper_entropy_bin{i}"] = b["clipfrac_upper"]
    return out
