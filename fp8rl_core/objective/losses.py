"""Policy losses: PPO clip with dual clip, CISPO, TIS weights, aggregation.

Definitions are docs/method.md, "Ratio and policy loss"; the form is verl's
``compute_policy_loss``. Per valid token, with ratio
``r = exp(clamp(logp - old_logp, -20, 20))`` and bounds ``(L, H)``::

    pg1 = -A * r
    pg2 = -A * clamp(r, L, H)
    c1  = max(pg1, pg2)                     # pessimistic PPO surrogate
    loss = min(-A * c, c1)  if A < 0        # dual clip (Ye et al. 2020), c = 3
    loss = c1               otherwise

The gradient w.r.t. ``logp`` is ``-A * r`` where the unclipped term is active
and 0 where a clip wins: for A < 0 below L (``clipfrac_lower``) and above c
(``dualclip_frac``), for A > 0 above H (``clipfrac_upper``). That zero gradient
below L is what FP8 ratio noise inflates (Chen et al. 2026, section 3) and what
Calibrated Clipping (``fp8rl_core.calibration.calibrated_clipping``) corrects by moving L and H.

Clip decisions taken outside the loss (``clip_decision``, the oracle clip mode of
``fp8rl_core.config.clip_mode_kinds``): a ``[B, T]`` code per token from
``clip_decisions`` (0 unclipped, 1 below L with A < 0, 2 above H with A > 0, 3 above c
with A < 0), computed on another ratio (the BF16 one). A token with code 0 contributes the
unclipped term ``-A * r`` (gradient ``-A * r``), whatever ``r`` is; a clipped one its clipped
term ``-A * L``, ``-A * H`` or ``-A * c``, a constant (gradient 0): what standard clipping
gives a token it clips. Where the codes are those of ``r`` itself, the loss is the standard
one token for token.

Truncated importance sampling (Yao et al. 2025) multiplies each token's loss by
``w = min(exp(old_logp - rollout_logp), C)``, detached, to correct the
rollout-engine vs trainer mismatch (``tis_weights``).

CISPO (MiniMax-M1, arXiv 2506.13585) never drops a token's gradient: it clips
and detaches the importance weight and uses it as a REINFORCE coefficient,
``loss = -sg(clamp(r, L, H)) * A * logp``, gradient ``-clamp(r, L, H) * A``.
With the same signature as ``policy_loss``, ``lower``/``upper`` are the IS
truncation bounds. M1 sets no lower bound and tunes only ``1 + eps_high_IS``;
verl's CISPO example (examples/cispo_trainer) runs it with ``clip_ratio_high =
0.2`` and ``clip_ratio_low = 10`` (lower side unclamped), so our default is
``lower=0.0, upper=1 + algorithm.cispo_eps_high = 1.2``. ``dual_clip`` only
feeds the ``dualclip_frac`` metric.

Which bounds a loss takes is the loss's business, not the trainer's:
``LOSS_BOUNDS`` maps each registered loss to ``(lower, upper, algorithm) ->
(lower, upper)`` (PPO: the clip bounds in force; CISPO: its IS cap), and
``loss_bounds`` looks it up, so the trainer never names a loss.

Aggregation (``aggregate``) of the masked ``[B, T]`` per-token loss, with
``S_b = sum_t loss[b, t]`` over valid tokens:

* ``token-mean``: ``sum_b S_b / n_tokens`` (default; DAPO's token-level loss);
* ``seq-mean-token-sum``: ``sum_b S_b / n_seqs``;
* ``seq-mean-token-mean``: ``sum_b (S_b / n_tokens_b) / n_seqs``;
* ``seq-mean-token-sum-norm``: ``sum_b S_b / norm_len / n_seqs`` (Dr.GRPO), with
  the constant ``norm_len`` defaulting to ``T = loss.shape[-1]``, the padded
  response length; pass ``norm_len = max_new_tokens`` to keep it constant across
  batches whose padding differs.

``n_seqs`` counts every row (a row without valid tokens adds 0), as verl does.

Gradient accumulation: when a mini-batch is processed in micro-batches, pass the
mini-batch totals ``global_token_count`` (valid tokens, used by token-mean) and
``global_seq_count`` (rows, used by the seq-mean modes). Each micro-batch loss is
then its share of the mini-batch aggregate, and the sum of the micro-batch
losses (and of their gradients) equals the loss of the whole mini-batch. Without
them the local counts are used. Metrics are always shares of the *local* valid
tokens; ``metrics["n_tokens"]`` lets the caller weight them.

Shapes and dtypes: every per-token input is ``[B, T]``; ``logp``/``old_logp``
float32 (or float64; bf16 works but ratios lose precision); ``mask`` bool or
0/1 float. Padding positions may hold any value, NaN included: they are
selected away with ``torch.where``, never multiplied by 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from fp8rl_core.registry import Registry

__all__ = [
    "AGGREGATIONS",
    "POLICY_LOSSES",
    "PolicyLoss",
    "aggregate",
    "cispo_loss",
    "clip_decisions",
    "clip_metrics",
    "importance_ratio",
    "LOSS_BOUNDS",
    "LossSpec",
    "loss_bounds",
    "policy_loss",
    "ppo_token_losses",
    "tis_weights",
]

LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class LossSpec:
    """What a policy loss takes beyond the four ``[B, T]`` tensors (log pi_theta, log pi_old, advantages,
    mask): one object for every loss of :data:`POLICY_LOSSES`.

    ``lower``/``upper``: the ratio clip bounds L and H (e.g. 0.8, 1.28, or calibrated; CISPO: the
    truncation of its detached IS weight); ``dual_clip``: c > 1 for A < 0; ``is_weights``: optional
    ``[B, T]`` TIS weights (detached); ``agg`` (None: the loss's own default, ``token-mean``, GSPO
    ``seq-mean-token-mean``), ``global_token_count``, ``global_seq_count``, ``norm_len``: see
    :func:`aggregate`; ``clip_decision``: optional ``[B, T]`` codes of :func:`clip_decisions` taken on
    another ratio (the oracle clip mode; the PPO loss only), None: decided on this ratio.
    """

    lower: float
    upper: float
    dual_clip: float = 3.0
    is_weights: torch.Tensor | None = None
    agg: str | None = None
    global_token_count: float | None = None
    global_seq_count: float | None = None
    norm_len: float | None = None
    clip_decision: torch.Tensor | None = None

    def aggregation(self, default: str) -> str:
        return default if self.agg is None else self.agg

    def counts(self) -> dict[str, float | None]:
        """The keyword arguments of :func:`aggregate` beyond the mode."""
        return dict(
            global_token_count=self.global_token_count, global_seq_count=self.global_seq_count, norm_len=self.norm_len
        )


class PolicyLoss(Protocol):
    def __call__(
        self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, spec: LossSpec
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
AGGREGATIONS: Registry[Callable[..., torch.Tensor]] = Registry("loss aggregation mode")
LOSS_BOUNDS: Registry[Callable[[float, float, object], tuple[float, float]]] = Registry("policy loss bounds")
# Hooks of a loss beyond the loss itself, by loss name (every loss registers in each):
LOSS_STATISTICS: Registry[PolicyLoss] = Registry("policy loss statistics")
"""The function whose metrics are a step's clip statistics at the bounds in force (token losses: ``policy_loss``)."""
CALIBRATION_UNITS: Registry[Callable | None] = Registry("policy loss calibration units")
"""None: calibrate on tokens; else ``(columns, sample_ids, token_mask, calibration_config) -> (r8, r16, A, valid,
calibration_config)``, the units the loss clips (``fp8rl_core.objective.gspo``: sequences)."""


def loss_bounds(loss: str, lower: float, upper: float, algorithm) -> tuple[float, float]:
    """The ``(lower, upper)`` to pass to loss ``loss`` given the ratio clip bounds in
    force; ``algorithm`` is the ``AlgorithmConfig`` (for a loss's own settings)."""
    POLICY_LOSSES.get(loss)
    return LOSS_BOUNDS.get(loss)(lower, upper, algorithm)


LOSS_BOUNDS.register("ppo")(lambda lower, upper, algorithm: (lower, upper))
# CISPO: IS weight capped from above only (verl's example: 1 + 0.2); 0 never binds since r > 0.
LOSS_BOUNDS.register("cispo")(lambda lower, upper, algorithm: (0.0, 1.0 + algorithm.cispo_eps_high))


# --------------------------------------------------------------------------- aggregation


def _masked_rows(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` per-row sums of the valid tokens' loss."""
    return torch.where(mask, loss_mat, torch.zeros_like(loss_mat)).sum(dim=-1)


def _denominator(count: float | None, local: torch.Tensor | float) -> torch.Tensor | float:
    if count is None:
        return local
    if count <= 0:
        raise ValueError(f"global normalizer must be > 0, got {count}")
    return float(count)


@AGGREGATIONS.register("token-mean")
def _token_mean(loss_mat, mask, *, global_token_count, global_seq_count, norm_len):
    local = mask.sum().clamp_min(1).to(loss_mat.dtype)
    return _masked_rows(loss_mat, mask).sum() / _denominator(global_token_count, local)


@AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, *, global_token_count, global_seq_count, norm_len):
    return _masked_rows(loss_mat, mask).sum() / _denominator(global_seq_count, float(max(loss_mat.shape[0], 1)))


@AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, *, global_token_count, global_seq_count, norm_len):
    per_seq = _masked_rows(loss_mat, mask) / mask.sum(dim=-1).clamp_min(1).to(loss_mat.dtype)  # [B]
    return per_seq.sum() / _denominator(global_seq_count, float(max(loss_mat.shape[0], 1)))


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, *, global_token_count, global_seq_count, norm_len):
    norm = float(norm_len) if norm_len is not None else float(max(loss_mat.shape[-1], 1))
    if norm <= 0:
        raise ValueError(f"norm_len must be > 0, got {norm_len}")
    return _masked_rows(loss_mat, mask).sum() / norm / _denominator(global_seq_count, float(max(loss_mat.shape[0], 1)))


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    *,
    global_token_count: float | None = None,
    global_seq_count: float | None = None,
    norm_len: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar (see the module docstring).

    Args:
        loss_mat: ``[B, T]`` float per-token loss.
        mask: ``[B, T]`` bool or 0/1 valid-token mask.
        agg: one of ``AGGREGATIONS.names()``; anything else raises ``KeyError``
            listing the valid modes.
        global_token_count / global_seq_count: mini-batch totals for gradient
            accumulation (None = local counts).
        norm_len: the constant of ``seq-mean-token-sum-norm`` (None = ``T``).
    Returns:
        0-dim tensor, dtype of ``loss_mat``, differentiable.
    """
    fn = AGGREGATIONS.get(agg)
    if loss_mat.dim() != 2 or loss_mat.shape != mask.shape:
        raise ValueError(
            f"aggregate expects loss_mat and mask of the same [B, T] shape, got "
            f"{tuple(loss_mat.shape)} and {tuple(mask.shape)}"
        )
    return fn(
        loss_mat,
        mask.bool(),
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_len=norm_len,
    )


# --------------------------------------------------------------------------- pieces


def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """``r = exp(clamp(logp - old_logp, -20, 20))``, same shape and dtype; differentiable in ``logp``."""
    return torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Truncated importance-sampling weights ``min(exp(old_logp - rollout_logp), cap)``.

    ``[B, T]`` in, ``[B, T]`` out (dtype of ``old_logp``), detached. The log
    difference is clamped to ±20 like the ratio, so no inf appears.
    """
    if cap <= 0:
        raise ValueError(f"TIS cap must be > 0, got {cap}")
    with torch.no_grad():
        w = torch.exp(torch.clamp(old_logp.detach() - rollout_logp.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        return torch.clamp(w, max=cap)


CLIP_NONE, CLIP_LOWER, CLIP_UPPER, CLIP_DUAL = 0, 1, 2, 3  # the codes of ``clip_decisions``


@torch.no_grad()
def clip_decisions(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, lower: float, upper: float, dual_clip: float
) -> torch.Tensor:
    """``[B, T]`` int8 clip decision of each token at ratio ``ratio`` (all ``[B, T]``): ``CLIP_LOWER`` for
    A < 0 and r < L, ``CLIP_UPPER`` for A > 0 and r > H, ``CLIP_DUAL`` for A < 0 and r > c, else (and at
    padding) ``CLIP_NONE``: the tokens whose clipped term wins in ``policy_loss``, as ``clip_metrics`` counts
    them."""
    m = mask.bool()
    neg, pos = m & (advantages < 0), m & (advantages > 0)
    codes = torch.zeros(ratio.shape, dtype=torch.int8, device=ratio.device)
    codes[neg & (ratio < lower)] = CLIP_LOWER
    codes[pos & (ratio > upper)] = CLIP_UPPER
    codes[neg & (ratio > dual_clip)] = CLIP_DUAL
    return codes


def ppo_token_losses(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    lower: float,
    upper: float,
    dual_clip: float,
    clip_decision: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token PPO loss ``[B, T]`` before weights and aggregation (module docstring), differentiable in
    ``ratio``: the pessimistic surrogate with dual clip, or, given ``clip_decision`` (``[B, T]`` codes of
    :func:`clip_decisions` taken on another ratio), ``-A * r`` where a code is 0 and the clipped term
    ``-A * L``, ``-A * H`` or ``-A * c`` (a constant) where it is not."""
    a = advantages
    if clip_decision is None:
        pg1 = -a * ratio
        pg2 = -a * torch.clamp(ratio, lower, upper)
        c1 = torch.maximum(pg1, pg2)
        pg3 = -a * dual_clip
        return torch.where(a < 0, torch.minimum(pg3, c1), c1)
    d = clip_decision
    bound = torch.where(d == CLIP_LOWER, lower, torch.where(d == CLIP_UPPER, upper, dual_clip)).to(ratio.dtype)
    return torch.where(d == CLIP_NONE, -a * ratio, -a * bound)


def _check_inputs(logp, old_logp, advantages, mask, is_weights, lower, upper) -> None:
    shapes = {"logp": logp.shape, "old_logp": old_logp.shape, "advantages": advantages.shape, "mask": mask.shape}
    if is_weights is not None:
        shapes["is_weights"] = is_weights.shape
    if logp.dim() != 2 or len(set(shapes.values())) != 1:
        raise ValueError(
            f"policy loss expects [B, T] tensors of one shape, got { ({k: tuple(v) for k, v in shapes.items()}) }"
        )
    if not lower <= upper:
        raise ValueError(f"clip bounds need lower <= upper, got lower={lower}, upper={upper}")


@torch.no_grad()
def clip_metrics(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    lower: float,
    upper: float,
    dual_clip: float,
) -> dict[str, float]:
    """Clip statistics of docs/method.md ("Clip metrics"), each a share of all valid tokens.

    Args:
        ratio: ``[B, T]`` importance ratios; ``log_ratio``: ``[B, T]`` the
            *unclamped* ``logp - old_logp`` (for ``ppo_kl``); ``advantages``,
            ``mask``: ``[B, T]``.
    Returns:
        Python floats: ``clipfrac_lower`` [A<0, r<L], ``clipfrac_upper``
        [A>0, r>H], ``clipfrac`` = their sum, ``pg_clipfrac`` (verl's
        [pg2 > pg1], computed independently; equals ``clipfrac`` up to rounding
        of ``A*r``), ``dualclip_frac`` [A<0, r>c], ``ppo_kl`` =
        mean(old_logp - logp), ``ratio_mean/min/max``, ``n_tokens``. With no
        valid token the shares are 0 and the ratio statistics NaN.
    """
    m = mask.bool()
    a = advantages
    neg, pos = m & (a < 0), m & (a > 0)
    n = m.sum()
    lower_c = (neg & (ratio < lower)).sum()
    upper_c = (pos & (ratio > upper)).sum()
    pg1 = -a * ratio
    pg2 = -a * torch.clamp(ratio, lower, upper)
    pg_c = (m & (pg2 > pg1)).sum()
    dual_c = (neg & (ratio > dual_clip)).sum()
    zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
    r_valid_sum = torch.where(m, ratio, zero).sum(dtype=torch.float64)
    kl_sum = torch.where(m, -log_ratio, zero).sum(dtype=torch.float64)
    inf = torch.tensor(float("inf"), dtype=ratio.dtype, device=ratio.device)
    r_min = torch.where(m, ratio, inf).amin() if ratio.numel() else inf
    r_max = torch.where(m, ratio, -inf).amax() if ratio.numel() else -inf
    counts = torch.stack([lower_c, upper_c, pg_c, dual_c, n]).to(torch.float64)
    vals = torch.stack([r_valid_sum, kl_sum, r_min.to(torch.float64), r_max.to(torch.float64)])
    (lo, up, pgc, dual, n_tok), (rsum, klsum, rmin, rmax) = counts.tolist(), vals.tolist()
    d = max(n_tok, 1.0)
    nan = float("nan")
    return {
        "clipfrac": (lo + up) / d,
        "clipfrac_lower": lo / d,
        "clipfrac_upper": up / d,
        "pg_clipfrac": pgc / d,
        "dualclip_frac": dual / d,
        "ppo_kl": klsum / d,
        "ratio_mean": rsum / n_tok if n_tok else nan,
        "ratio_min": rmin if n_tok else nan,
        "ratio_max": rmax if n_tok else nan,
        "n_tokens": n_tok,
    }


# --------------------------------------------------------------------------- losses


@POLICY_LOSSES.register("ppo")
def policy_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, spec: LossSpec
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clip loss with dual clip (docs/method.md, "Ratio and policy loss").

    Args:
        logp: ``[B, T]`` log pi_theta of the sampled tokens (carries the grad).
        old_logp: ``[B, T]`` log pi_old (treated as a constant).
        advantages: ``[B, T]`` per-token advantages.
        mask: ``[B, T]`` bool/0-1 valid response tokens.
        spec: the bounds, dual clip, TIS weights, aggregation and outside clip decisions (:class:`LossSpec`).
    Returns:
        ``(loss, metrics)``: 0-dim differentiable tensor (dtype of ``logp``) and
        the ``clip_metrics`` dict (of this ratio) plus ``loss`` (and ``is_weight_mean``).
    """
    lower, upper, dual_clip, agg = spec.lower, spec.upper, spec.dual_clip, spec.aggregation("token-mean")
    AGGREGATIONS.get(agg)  # fail fast on a typo, before any compute
    _check_inputs(logp, old_logp, advantages, mask, spec.is_weights, lower, upper)
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    m = mask.bool()
    lp, old, a, w = _sanitize(logp, old_logp, advantages, m, spec.is_weights)
    log_ratio = lp - old  # [B, T]
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]
    loss_mat = ppo_token_losses(
        ratio, a, lower=lower, upper=upper, dual_clip=dual_clip, clip_decision=spec.clip_decision
    )
    if w is not None:
        loss_mat = loss_mat * w
    loss = aggregate(loss_mat, m, agg, **spec.counts())
    metrics = clip_metrics(ratio.detach(), log_ratio.detach(), a, m, lower=lower, upper=upper, dual_clip=dual_clip)
    _add_common_metrics(metrics, loss, w)
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, spec: LossSpec
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1): ``loss = -sg(clamp(r, lower, upper)) * A * logp``.

    Same signature, shapes and metrics as ``policy_loss``; here the spec's ``lower`` and
    ``upper`` truncate the detached IS weight (every token keeps a gradient),
    and ``dual_clip`` is only used by the ``dualclip_frac`` metric. The clip
    shares report how many tokens had their weight truncated, by sign, with the
    same definitions as for PPO so the two are comparable in the tables. It takes no clip decision
    from outside (the spec's ``clip_decision`` must be None): it never drops a token.
    """
    _no_decision("cispo", spec.clip_decision)
    lower, upper, agg = spec.lower, spec.upper, spec.aggregation("token-mean")
    AGGREGATIONS.get(agg)
    _check_inputs(logp, old_logp, advantages, mask, spec.is_weights, lower, upper)
    m = mask.bool()
    lp, old, a, w = _sanitize(logp, old_logp, advantages, m, spec.is_weights)
    with torch.no_grad():
        log_ratio = lp.detach() - old
        ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weight = torch.clamp(ratio, lower, upper)
        if w is not None:
            weight = weight * w
    loss_mat = -weight * a * lp  # [B, T]
    loss = aggregate(loss_mat, m, agg, **spec.counts())
    metrics = clip_metrics(ratio, log_ratio, a, m, lower=lower, upper=upper, dual_clip=spec.dual_clip)
    _add_common_metrics(metrics, loss, w)
    return loss, metrics


def _no_decision(loss: str, clip_decision: torch.Tensor | None) -> None:
    if clip_decision is not None:
        raise ValueError(f"the {loss} loss takes no clip decision from outside; only the ppo loss does")


def _sanitize(logp, old_logp, advantages, m, is_weights):
    """Zero every input at padding positions (``torch.where``, whose backward
    sends exactly 0 there), so NaN/inf padding reaches neither the loss nor the
    gradient (``0 * NaN`` would, through ``exp`` or a product). Everything but
    ``logp`` is detached."""
    lp = torch.where(m, logp, torch.zeros_like(logp))
    old = torch.where(m, old_logp.detach(), torch.zeros_like(lp))
    a = torch.where(m, advantages.detach(), torch.zeros_like(lp))
    w = None if is_weights is None else torch.where(m, is_weights.detach(), torch.zeros_like(lp))
    return lp, old, a, w


def _add_common_metrics(metrics: dict[str, float], loss: torch.Tensor, is_weights: torch.Tensor | None) -> None:
    metrics["loss"] = float(loss.detach())
    if is_weights is not None:
        w_sum = is_weights.sum(dtype=torch.float64)  # already zero at padding
        metrics["is_weight_mean"] = float(w_sum) / max(metrics["n_tokens"], 1.0)


for _name in ("ppo", "cispo"):  # token losses: clip statistics of the PPO rule, calibration on tokens
    LOSS_STATISTICS.register(_name)(policy_loss)
    CALIBRATION_UNITS.register(_name)(None)
