"""Where the noise comes from, on calibration steps: ratio noise vs TIS-weight noise.

pi_old is recomputed in the *training* precision, so the PPO ratio
r = pi_theta / pi_old carries training-quantization noise only; rollout
quantization enters through the TIS weight w = min(pi_old / pi_rollout, C).
With a BF16 shadow pass both can be measured against their BF16 references
(every statistic is an NMAE, ``fp8rl_core.signals.diagnostics.nmae``: sum|x - ref| /
sum|ref| over valid tokens where both are finite):

- ``ratio_noise_nmae``: r8 vs r16 (training noise in the ratio; the same
  quantity as ``ratio_nmae``, repeated here so the two sources sit side by side);
- ``tis_weight_nmae``: w computed from the FP8 pi_old vs from the BF16 pi_old,
  both against the rollout log-probs (training noise that reaches the weight);
- ``rollout_bf16_prob_nmae``: rollout-engine probabilities vs the BF16
  pi_old (the rollout-vs-trainer mismatch itself: rollout quantization plus
  engine differences), and ``rollout_bf16_tis_nmae``: the TIS weight the
  mismatch implies, w16 vs 1 (what TIS corrects);
- ``rollout_fp8_prob_nmae``: rollout probabilities vs the FP8 pi_old (the
  mismatch TIS actually sees in an FP8 run).
"""

from __future__ import annotations

import torch

from fp8rl_core.objective.losses import importance_ratio, tis_weights
from fp8rl_core.signals.diagnostics import nmae

__all__ = ["noise_sources"]


def noise_sources(
    logp8: torch.Tensor,
    old_logp8: torch.Tensor,
    logp16: torch.Tensor,
    old_logp16: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    tis_cap: float = 2.0,
) -> dict[str, float]:
    """The five NMAEs of the module docstring; ``[B, T]`` log-probs (any one shape) and the valid mask."""
    r8, r16 = importance_ratio(logp8, old_logp8), importance_ratio(logp16, old_logp16)
    w8 = tis_weights(old_logp8, rollout_logp, cap=tis_cap)
    w16 = tis_weights(old_logp16, rollout_logp, cap=tis_cap)
    p_roll = torch.exp(rollout_logp.double())
    return {
        "ratio_noise_nmae": nmae(r8, r16, mask),
        "tis_weight_nmae": nmae(w8, w16, mask),
        "rollout_bf16_prob_nmae": nmae(p_roll, torch.exp(old_logp16.double()), mask),
        "rollout_bf16_tis_nmae": nmae(torch.ones_like(w16), w16, mask),
        "rollout_fp8_prob_nmae": nmae(p_roll, torch.exp(old_logp8.double()), mask),
    }
