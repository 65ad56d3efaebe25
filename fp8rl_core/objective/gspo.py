"""GSPO: sequence-level ratio and clipping, and Calibrated Clipping on sequence ratios.

Source: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv
2507.18071 (docs/method.md, "Sequence level (GSPO)"). For response i of length
|y_i| (valid tokens):

    s_i = exp( mean_t (logp_it - old_logp_it) )      (geometric mean of token ratios)

GSPO clips s_i with the sequence advantage A_i. The paper's clip range
(section 5.1) is 3e-4 below and 4e-4 above 1: ``GSPO_EPS_LOW``,
``GSPO_EPS_HIGH`` (set ``algorithm.eps_low/eps_high`` to them; the ablation
cell ``configs/sweeps/gspo-tiny.yaml`` does).

Loss (registered as ``"gspo"`` in ``POLICY_LOSSES``, the signature of
``policy_loss``), in the GSPO-token form: every token of sequence i carries
``s_it = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))`` -- the value of s_i,
the gradient of its own log-prob -- and

    loss_it = max(-A_it * s_it, -A_it * clamp(s_it, L, H))

aggregated by ``agg``. With one advantage per sequence (GRPO) and
``seq-mean-token-mean`` this is the sequence-level GSPO objective and its
gradient (the paper's eq. for GSPO-token); the paper uses no dual clip, so
``dual_clip`` only feeds the ``dualclip_frac`` metric. TIS weights multiply
the per-token loss as in ``policy_loss``. Clip shares are shares of valid
tokens (as the contract's), plus ``seq_clipfrac_lower/upper`` (shares of
sequences) and the sequence-ratio statistics.

Calibrated Clipping on sequences (``sequence_calibration_inputs``,
``gspo_calibration_config``): the same rule as the token level
(``fp8rl_core.calibration.calibrated_clipping.calibrate``) with sequences as the units: alpha from
the BF16 sequence ratios of A<0 sequences at 1 - eps_low, L the matching
quantile of the FP8 sequence ratios, H by the balance rule over sequences
(Pos = sum s*A over A>0 sequences with s <= H, ...), on a grid and step cap of
their own: the token grid's 0.01 steps are ~25x GSPO's whole range. Our
defaults scale the token-level ones by the clip ranges (0.2 -> 3e-4): L in
[1 - 2 eps_low, 1] = [0.9994, 1], H in [1, 1 + 3 eps_high] = [1, 1.0012],
step 1e-5, max change per calibration 7.5e-5 (config ``gspo_*`` fields).
"""

from __future__ import annotations

import numpy as np
import torch

from fp8rl_core.objective.losses import (
    AGGREGATIONS,
    CALIBRATION_UNITS,
    LOG_RATIO_CLAMP,
    LOSS_BOUNDS,
    LOSS_STATISTICS,
    POLICY_LOSSES,
    LossSpec,
    _add_common_metrics,
    _check_inputs,
    _no_decision,
    _sanitize,
    aggregate,
    clip_metrics,
)

# The calibration config arrives as an argument (``fp8rl_core.config.method.CalibrationConfig``), never imported:
# fp8rl_core.config imports the loss registries to validate ``algorithm.loss``, so the arrow points that way.

__all__ = [
    "GSPO_EPS_HIGH",
    "GSPO_EPS_LOW",
    "gspo_calibration_config",
    "gspo_loss",
    "sequence_calibration_inputs",
    "sequence_log_ratio",
    "sequence_ratio",
]

GSPO_EPS_LOW = 3e-4  # Zheng et al. 2025, section 5.1
GSPO_EPS_HIGH = 4e-4


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` mean over valid tokens of ``logp - old_logp`` (0 for a row without valid tokens)."""
    m = mask.bool()
    d = torch.where(m, logp - old_logp, torch.zeros_like(logp))
    return d.sum(-1) / m.sum(-1).clamp_min(1).to(d.dtype)


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` s = exp(clamp(mean log ratio, -20, 20))."""
    return torch.exp(torch.clamp(sequence_log_ratio(logp, old_logp, mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


# GSPO clips the sequence ratio at the bounds in force (1 - eps, 1 + eps, or the calibrated pair).
LOSS_BOUNDS.register("gspo")(lambda lower, upper, algorithm: (lower, upper))


@LOSS_STATISTICS.register("gspo")  # clip statistics on sequence ratios
@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, spec: LossSpec
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO(-token) loss; arguments and return as ``fp8rl_core.objective.losses.policy_loss`` (its default
    aggregation ``seq-mean-token-mean``; no clip decision from outside: its clipping is the sequence's)."""
    _no_decision("gspo", spec.clip_decision)
    lower, upper, dual_clip, agg = spec.lower, spec.upper, spec.dual_clip, spec.aggregation("seq-mean-token-mean")
    AGGREGATIONS.get(agg)
    _check_inputs(logp, old_logp, advantages, mask, spec.is_weights, lower, upper)
    m = mask.bool()
    lp, old, a, w = _sanitize(logp, old_logp, advantages, m, spec.is_weights)
    seq_lr = sequence_log_ratio(lp.detach(), old, m)  # [B]
    s = torch.exp(torch.clamp(seq_lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B]
    s_tok = s.detach()[:, None] * torch.exp(lp - lp.detach())  # [B, T]: value s_i, gradient of its own logp
    pg1 = -a * s_tok
    pg2 = -a * torch.clamp(s_tok, lower, upper)
    loss_mat = torch.maximum(pg1, pg2)
    if w is not None:
        loss_mat = loss_mat * w
    loss = aggregate(loss_mat, m, agg, **spec.counts())
    with torch.no_grad():
        s_b = s[:, None].expand_as(lp)
        metrics = clip_metrics(s_b, (lp.detach() - old), a, m, lower=lower, upper=upper, dual_clip=dual_clip)
        rows = m.any(-1)
        a_seq = torch.where(m, a, torch.zeros_like(a)).sum(-1) / m.sum(-1).clamp_min(1)
        n_seq = max(int(rows.sum()), 1)
        metrics["seq_clipfrac_lower"] = float((rows & (a_seq < 0) & (s < lower)).sum()) / n_seq
        metrics["seq_clipfrac_upper"] = float((rows & (a_seq > 0) & (s > upper)).sum()) / n_seq
        sv = s[rows]
        metrics["seq_ratio_mean"] = float(sv.mean()) if sv.numel() else float("nan")
        metrics["seq_ratio_min"] = float(sv.min()) if sv.numel() else float("nan")
        metrics["seq_ratio_max"] = float(sv.max()) if sv.numel() else float("nan")
    _add_common_metrics(metrics, loss, w)
    return loss, metrics


def sequence_calibration_inputs(
    logp8: torch.Tensor,
    old_logp8: torch.Tensor,
    logp16: torch.Tensor,
    old_logp16: torch.Tensor,
    advantages: torch.Tensor,
    seq_index: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (s8, s16, A, valid) from flat token columns (``[N]`` each, ``seq_index`` the
    sequence of each token).

    Sequences with any masked-out or non-finite token are left out (their
    s16 is unknown, e.g. not shadowed). Float64. A = mean token advantage of the sequence.
    """
    seq_index = seq_index.reshape(-1).long()
    uniq, inv = torch.unique(seq_index, return_inverse=True)
    k = uniq.numel()
    d8 = (logp8 - old_logp8).reshape(-1).double()
    d16 = (logp16 - old_logp16).reshape(-1).double()
    adv = advantages.reshape(-1).double()
    ok = mask.reshape(-1).bool() & torch.isfinite(d8) & torch.isfinite(d16) & torch.isfinite(adv)
    z = torch.zeros(k, dtype=torch.float64)
    cnt = z.index_add(0, inv, torch.ones_like(d8))
    bad = z.index_add(0, inv, (~ok).double()) > 0
    s8 = torch.exp(torch.clamp(z.index_add(0, inv, torch.where(ok, d8, 0.0)) / cnt, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    s16 = torch.exp(
        torch.clamp(z.index_add(0, inv, torch.where(ok, d16, 0.0)) / cnt, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    )
    a = z.index_add(0, inv, torch.where(ok, adv, 0.0)) / cnt
    return s8, s16, a, ~bad


def gspo_calibration_config(cfg):
    """``cfg`` with the sequence-level grid, search intervals and step cap (``gspo_*`` fields)."""
    return cfg.model_copy(
        update={
            "lower_min": cfg.gspo_lower_min,
            "lower_max": cfg.gspo_lower_max,
            "upper_min": cfg.gspo_upper_min,
            "upper_max": cfg.gspo_upper_max,
            "upper_step": cfg.gspo_upper_step,
            "max_delta": cfg.gspo_max_delta,
        }
    )


@CALIBRATION_UNITS.register("gspo")
def sequence_calibration_units(cols: dict[str, np.ndarray], sample_ids: np.ndarray, token_mask: torch.Tensor, cfg):
    """(s8, s16, A, valid, config) of a calibration step for GSPO: sequences as the calibration units."""
    t = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in cols.items()}
    s8, s16, a, ok = sequence_calibration_inputs(
        t["logp_fp8"],
        t["old_logp_fp8"],
        t["logp_bf16"],
        t["old_logp_bf16"],
        t["advantage"],
        torch.from_numpy(np.asarray(sample_ids, dtype=np.int64)),
        token_mask,
    )
    return s8, s16, a, ok, gspo_calibration_config(cfg)
