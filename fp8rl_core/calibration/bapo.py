"""BAPO as published: clip bounds re-picked before every optimizer update.

Source: Xi et al. 2025, "BAPO: Stabilizing Off-Policy Reinforcement Learning for
LLMs via Balanced Policy Optimization with Adaptive Clipping", arXiv 2510.18927,
and its public verl recipe (github.com/WooooDyy/BAPO, ``recipe/bapo``). docs/method.md
("BAPO as published") states the rule; this module is its implementation.

Rule (the paper's pseudo-code; every choice is a ``BapoConfig`` field). On every
update, from the ratios ``r = pi_theta / pi_old`` of that update's tokens, with no
BF16 pass and no memory of earlier updates::

    c_low, c_high = a-, a+
    rho = S+ / (S+ + S-)                   S+ = sum r*A   over A>0 with r < c_high
                                           S- = sum r*|A| over A<0 with r > c_low
    while rho < rho0 and c_low + d2 <= b-:
        if c_high + d1 <= b+: c_high += d1
        else:                 c_low  += d2
        recompute rho

Published settings: rho0 = 0.5, [a-, b-] = [0.6, 0.9], [a+, b+] = [1.2, 3.0]. The
paper gives no step sizes; we take the recipe's (d2 = ratio_lower_step = 0.05, d1 =
ratio_upper_step = 0.1 in run_bapo_example.sh, whose own default is 0.05).

Where the recipe's code (``policy_loss.py``) differs from the paper, with the config
field that selects each behaviour (default: the paper):

* ``order``: the recipe raises c_low first, up to its max, and only then c_high; the
  paper raises c_high while it fits and c_low only after, and stops as soon as c_low
  has no room left (even if c_high still had).
* ``boundary``: the recipe counts *every* token at its clamped ratio,
  ``S+ = sum_{A>=0} min(r, c_high) A``, ``S- = sum_{A<0} max(r, c_low) |A|``; the
  paper counts only the tokens that keep a gradient, with strict inequalities
  (a token exactly at a bound is clipped, so it is excluded).
* ``target``: the recipe compares ``S+ / S-`` (its ``adv_ratio_target``, 0.5 in the
  example run, i.e. a positive share of 1/3) with the target; the paper compares
  the share ``S+ / (S+ + S-)``.
* ``last_step``: the recipe moves while ``bound < max`` and clamps the last step to
  land exactly on max; the paper moves only while ``bound + step <= max``.
* The recipe's example run also uses other ranges ([0.8, 0.95], [1.2, 2.0]) and adds
  1e-8 to the denominator; we use the paper's ranges and an exact division.

Degenerate input: S- = 0 (no negative token keeps a gradient) gives rho = 1 (met, as
the recipe's ``inf``), so the bounds stay at the start. Grid points are
``a + j*d`` rounded to 12 digits; ``bound + d <= max`` is tested with a 1e-9 slack
so that 0.6 + 6 x 0.05 reaches 0.9.

Cost. The loop moves at most ``(b+ - a+)/d1 + (b- - a-)/d2`` times (24 with the
defaults), each needing S+ or S- at one grid point. ``bapo_sums`` computes S+ at
every c_high grid point and S- at every c_low grid point in one bucketize pass per
side (float64 accumulation); ``bapo_search`` then walks the path on those
``G+ + G-`` numbers. Under several ranks the sums are what gets all-reduced (one
vector), so rho is over all ranks' tokens and every rank picks the same bounds:
pass ``reduce`` (e.g. ``dist_sum``) to ``bapo_bounds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    from fp8rl_core.config.method import BapoConfig

__all__ = ["BapoResult", "bapo_bounds", "bapo_grid", "bapo_search", "bapo_sums", "dist_sum", "summarize_updates"]

_SLACK = 1e-9


def bapo_grid(start: float, stop: float, step: float, last_step: str = "paper") -> list[float]:
    """The values a bound can take: start, start+step, ... (<= stop); with
    ``last_step="recipe"`` stop itself is appended when the steps miss it."""
    n = int(math.floor((stop - start) / step + _SLACK))
    pts = [round(start + j * step, 12) for j in range(n + 1)]
    if last_step == "recipe" and pts[-1] < stop - 1e-12:
        pts.append(float(stop))
    return pts


@dataclass(frozen=True)
class BapoResult:
    """Bounds picked for one update: ``lower`` (c_low), ``upper`` (c_high), the
    positive share ``rho`` at them (or S+/S- with ``target="ratio"``), ``rho_start``
    at (a-, a+), and ``iterations`` = moves made."""

    lower: float
    upper: float
    rho: float
    rho_start: float
    iterations: int


def bapo_sums(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: BapoConfig) -> torch.Tensor:
    """``[G+ + G-]`` float64: S+ at every c_high grid point, then S- at every c_low one.

    Args:
        ratio, advantages, mask: same shape (any), ratio detached or not (it is
            detached here); non-finite tokens are ignored.
    The result is additive over token sets: sum it over ranks before ``bapo_search``.
    """
    if not (ratio.shape == advantages.shape == mask.shape):
        raise ValueError(
            f"bapo_sums needs ratio, advantages and mask of one shape, got "
            f"{tuple(ratio.shape)}, {tuple(advantages.shape)}, {tuple(mask.shape)}"
        )
    r = ratio.detach().reshape(-1).to(torch.float64)
    a = advantages.detach().reshape(-1).to(torch.float64)
    m = mask.reshape(-1).bool() & torch.isfinite(r) & torch.isfinite(a)
    dev = r.device  # the grids live beside the ratios (a host grid beside device ratios fails on CUDA)
    hg = bapo_grid(cfg.upper_start, cfg.upper_max, cfg.upper_step, cfg.last_step)
    lg = bapo_grid(cfg.lower_start, cfg.lower_max, cfg.lower_step, cfg.last_step)
    hg, lg = (torch.tensor(g, dtype=torch.float64, device=dev) for g in (hg, lg))
    clamp = cfg.boundary == "recipe"
    pos = m & ((a >= 0) if clamp else (a > 0))
    rp, ap = r[pos], a[pos]
    neg = m & (a < 0)
    rn, an = r[neg], -a[neg]
    return torch.cat([_upper_side(rp, ap, hg, clamp), _lower_side(rn, an, lg, clamp)])


def _bins(idx: torch.Tensor, vals: torch.Tensor, nb: int) -> torch.Tensor:
    return torch.zeros(nb, dtype=torch.float64, device=vals.device).index_add_(0, idx, vals)


def _upper_side(r: torch.Tensor, a: torch.Tensor, g: torch.Tensor, clamp: bool) -> torch.Tensor:
    """S+(c) for every c in g: sum_{r<c} r a  (+ c * sum_{r>=c} a when clamping)."""
    idx = torch.bucketize(r, g, right=True)  # #{g <= r}: r < g[j] <=> idx <= j
    nb = g.numel() + 1
    below = torch.cumsum(_bins(idx, r * a, nb), 0)[:-1]
    if not clamp:
        return below
    a_cum = torch.cumsum(_bins(idx, a, nb), 0)[:-1]
    return below + g * (a.sum() - a_cum)


def _lower_side(r: torch.Tensor, a: torch.Tensor, g: torch.Tensor, clamp: bool) -> torch.Tensor:
    """S-(c) for every c in g: sum_{r>c} r |A|  (+ c * sum_{r<=c} |A| when clamping)."""
    idx = torch.bucketize(r, g, right=False)  # #{g < r}: r > g[j] <=> idx >= j + 1
    nb = g.numel() + 1
    ra = r * a
    upto = torch.cumsum(_bins(idx, ra, nb), 0)[:-1]  # sum over r <= g[j]
    above = ra.sum() - upto
    if not clamp:
        return above
    return above + g * torch.cumsum(_bins(idx, a, nb), 0)[:-1]


def _rho(pos: float, neg: float, target: str) -> float:
    if neg <= 0:
        return 1.0 if target == "share" else math.inf
    return pos / (pos + neg) if target == "share" else pos / neg


def bapo_search(sums: torch.Tensor | Sequence[float], cfg: BapoConfig) -> BapoResult:
    """Walk the published loop on pre-computed (and, under several ranks, pre-reduced) sums."""
    hg = bapo_grid(cfg.upper_start, cfg.upper_max, cfg.upper_step, cfg.last_step)
    lg = bapo_grid(cfg.lower_start, cfg.lower_max, cfg.lower_step, cfg.last_step)
    vals = [float(x) for x in (sums.tolist() if isinstance(sums, torch.Tensor) else sums)]
    if len(vals) != len(hg) + len(lg):
        raise ValueError(f"bapo_search: expected {len(hg) + len(lg)} sums for this config, got {len(vals)}")
    pos, neg = vals[: len(hg)], vals[len(hg) :]
    i = j = moves = 0
    rho = rho0 = _rho(pos[0], neg[0], cfg.target)
    if cfg.order == "paper":
        while rho < cfg.rho0 and j + 1 < len(lg):
            if i + 1 < len(hg):
                i += 1
            else:
                j += 1
            moves += 1
            rho = _rho(pos[i], neg[j], cfg.target)
    else:  # recipe: lower bound first, then the upper one
        while rho < cfg.rho0 and j + 1 < len(lg):
            j += 1
            moves += 1
            rho = _rho(pos[i], neg[j], cfg.target)
        while rho < cfg.rho0 and i + 1 < len(hg):
            i += 1
            moves += 1
            rho = _rho(pos[i], neg[j], cfg.target)
    return BapoResult(lower=lg[j], upper=hg[i], rho=rho, rho_start=rho0, iterations=moves)


def bapo_bounds(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: BapoConfig,
    *,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> BapoResult:
    """The bounds of one update (see the module docstring).

    Args:
        ratio: ``[B, T]`` (any shape) current ratios pi_theta / pi_old of the
            update's tokens; ``advantages``, ``mask``: same shape.
        cfg: the ``calibration.bapo`` block.
        reduce: optional hook summing the ``[G+ + G-]`` float64 sums over ranks
            (``dist_sum``), so rho is computed over all ranks' tokens.
    """
    sums = bapo_sums(ratio, advantages, mask, cfg)
    if reduce is not None:
        sums = reduce(sums)
    return bapo_search(sums, cfg)


def dist_sum(t: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) hook for ``bapo_bounds`` when torch.distributed is initialized; identity otherwise."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def summarize_updates(results: Sequence[BapoResult]) -> dict[str, float]:
    """Step metrics over the step's updates: mean/min/max of bounds and rho, mean iterations."""
    if not results:
        return {}
    out: dict[str, float] = {}
    for name, key in (("lower", "bapo_lower"), ("upper", "bapo_upper"), ("rho", "bapo_rho")):
        xs = [float(getattr(r, name)) for r in results]
        out[f"{key}_mean"], out[f"{key}_min"], out[f"{key}_max"] = sum(xs) / len(xs), min(xs), max(xs)
    out["bapo_iterations_mean"] = sum(r.iterations for r in results) / len(results)
    return out


@dataclass(frozen=True)
class UpdateBoundsRule:
    """The trainer's hooks of a clip mode that picks (L, H) before every update (BAPO as published).

    ``bounds(ratio, advantages, mask, calibration_config, distributed)``: the
    update's bounds (a result with ``.lower`` and ``.upper``) from its current
    ratios, summed over ranks when ``distributed``; ``clip_stats``: the step's
    clip statistics with each row at its own update's bounds
    (:func:`step_clip_stats`); ``summarize``: step metrics over the updates'
    results (:func:`summarize_updates`). Registered by clip-mode name in
    ``fp8rl_core.calibration.clip_modes.UPDATE_BOUNDS``.
    """

    bounds: Callable[..., BapoResult]
    clip_stats: Callable[..., dict[str, float]]
    summarize: Callable[[Sequence[BapoResult]], dict[str, float]]


def _published_bounds(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, calibration, distributed: bool
) -> BapoResult:
    return bapo_bounds(ratio, advantages, mask, calibration.bapo, reduce=dist_sum if distributed else None)


def step_clip_stats(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    minibatch: torch.Tensor,
    bounds: dict[int, tuple[float, float]],
    *,
    dual_clip: float,
    is_weights: torch.Tensor | None = None,
) -> dict[str, float]:
    """The step's clip statistics (``policy_loss`` metrics) when every mini-batch had its
    own bounds: each row measured at its mini-batch's bounds, shares weighted by tokens.
    ``minibatch``: ``[N]`` mini-batch index of each row; ``bounds``: index -> (L, H)."""
    from fp8rl_core.objective.losses import LossSpec, policy_loss

    parts: list[dict[str, float]] = []
    for k, (lo, hi) in sorted(bounds.items()):
        rows = minibatch == k
        weights = None if is_weights is None else is_weights[rows]
        spec = LossSpec(lower=lo, upper=hi, dual_clip=dual_clip, is_weights=weights)
        with torch.no_grad():
            _, m = policy_loss(logp[rows], old_logp[rows], advantages[rows], mask[rows], spec)
        parts.append(m)
    n = sum(p["n_tokens"] for p in parts)
    out: dict[str, float] = {"n_tokens": float(n)}
    for key in parts[0] if parts else []:
        if key in ("n_tokens",):
            continue
        if key == "ratio_min":
            out[key] = min(p[key] for p in parts)
        elif key == "ratio_max":
            out[key] = max(p[key] for p in parts)
        else:  # shares and means over tokens
            vals = [(p[key], p["n_tokens"]) for p in parts if p["n_tokens"]]
            out[key] = sum(v * w for v, w in vals) / n if n else 0.0
    return out


PUBLISHED = UpdateBoundsRule(_published_bounds, step_clip_stats, summarize_updates)
"""BAPO as published: bounds per update from its current ratios (registered as clip mode ``bapo``)."""
