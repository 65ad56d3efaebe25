"""The token sets of one calibration: FP8 and BF16 ratios and |A| of the A<0 and A>0 tokens, with the
memoised statistics ``calibrate`` and the clip modes ask for (see ``calibrated_clipping``)."""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:  # annotations only: the trainer's numerics import without pydantic (the GPU script)
    pass

BALANCE_RTOL = 1e-9
_INF = float("inf")
_NAN = float("nan")


def _ratio(pos: float, neg: float) -> float:
    return _INF if neg == 0 else pos / neg


def _share(count: int, n: int) -> float:
    return count / n if n else _NAN


def _grid(lo: float, hi: float, step: float) -> list[float]:
    """Grid lo, lo+step, ... <= hi, with hi appended if the steps miss it."""
    n = int(math.floor((hi - lo) / step + 1e-9))
    pts = [round(lo + j * step, 12) for j in range(n + 1)]
    if pts[-1] < hi - 1e-12:
        pts.append(hi)
    return pts


def _work_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    dt = torch.promote_types(a.dtype, b.dtype)
    return dt if dt in (torch.float32, torch.float64) else torch.float32  # bf16/fp16 ratios: upcast


# --------------------------------------------------------------------------- token sets


class CalibrationTokens:
    """Compacted valid tokens of one calibration, split by advantage sign.

    ``r8n, r16n, absn``: ``[n_neg]`` FP8 ratio, BF16 ratio and |A| of the A<0
    tokens; ``r8p, r16p, ap``: ``[n_pos]`` the same for A>0 (one float dtype).
    Zero-advantage tokens carry no gradient and are only counted. Statistics are
    memoised per (token set, bound): ``calibrate`` asks for a bound repeatedly.
    """

    def __init__(
        self,
        r8: torch.Tensor,
        r16: torch.Tensor,
        adv: torch.Tensor,
        mask: torch.Tensor,
        dual_clip: float = 3.0,
        weights: torch.Tensor | None = None,
    ) -> None:
        if weights is not None:  # Pos/Neg weighted by TIS: r * |A| * w, the factor that scales the gradient
            if weights.shape != adv.shape:
                raise ValueError(
                    f"calibrate: weights must have the advantages' shape {tuple(adv.shape)}, got {tuple(weights.shape)}"
                )
            adv = adv * weights.to(adv.dtype if adv.dtype.is_floating_point else torch.float32)
        if not (r8.shape == r16.shape == adv.shape == mask.shape):
            raise ValueError(
                "calibrate needs r_fp8, r_bf16, advantages and mask of one shape, got "
                f"{tuple(r8.shape)}, {tuple(r16.shape)}, {tuple(adv.shape)}, {tuple(mask.shape)}"
            )
        dt = _work_dtype(r8, r16)
        r8, r16 = r8.reshape(-1).to(dt), r16.reshape(-1).to(dt)
        adv = adv.reshape(-1).to(dt)
        m = mask.reshape(-1).bool()
        self.n_masked = int(torch.count_nonzero(m))
        # A sum is finite only if every term is (inf/NaN propagate); a finite
        # overflow merely sends us down the exact path. Saves 3 full passes.
        if bool(torch.isfinite(r8.sum() + r16.sum() + adv.sum())):
            valid = m
            self.n_tokens = self.n_masked
        else:
            valid = m & torch.isfinite(r8)
            valid &= torch.isfinite(r16)
            valid &= torch.isfinite(adv)
            self.n_tokens = int(torch.count_nonzero(valid))
        self.n_nonfinite = self.n_masked - self.n_tokens
        neg_idx = torch.nonzero(valid & (adv < 0)).squeeze(1)  # one nonzero per sign, then cheap gathers
        pos_idx = torch.nonzero(valid & (adv > 0)).squeeze(1)
        self.dtype = dt
        self.dual_clip = dual_clip
        self.r8n, self.r16n = r8.index_select(0, neg_idx), r16.index_select(0, neg_idx)
        self.absn = adv.index_select(0, neg_idx).neg_()
        self.r8p, self.r16p, self.ap = (
            r8.index_select(0, pos_idx),
            r16.index_select(0, pos_idx),
            adv.index_select(0, pos_idx),
        )
        self.n_neg, self.n_pos = int(neg_idx.numel()), int(pos_idx.numel())
        self._memo: dict[str, dict[float, tuple[int, float]]] = {}

    def _bound(self, x: float) -> float:
        """``x`` as the ratios' dtype will see it."""
        return float(torch.tensor(x, dtype=self.dtype))

    def _arrays(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ratios, |A|) of ``key``: "n8", "n16" (A<0; FP8, BF16) or "p8", "p16" (A>0)."""
        return {
            "n8": (self.r8n, self.absn),
            "n16": (self.r16n, self.absn),
            "p8": (self.r8p, self.ap),
            "p16": (self.r16p, self.ap),
        }[key]

    def _side(self, key: str, bounds: Sequence[float]) -> list[tuple[int, float]]:
        """Per bound: (count, contribution). One pass answers every bound not yet seen.

        Lower side (keys "n*"), bound L: ``(#{r < L}, Neg = sum r|A| over L <= r <= c)``.
        Upper side (keys "p*"), bound H: ``(#{r > H}, Pos = sum r A over r <= H)``.
        The pass: bucketize r into the sorted bounds (plus c), count and sum the
        float64 contributions per bin, then prefix sums over the (few) bins.
        """
        lower = key.startswith("n")
        memo = self._memo.setdefault(key, {})
        rounded = [self._bound(b) for b in bounds]
        missing = sorted(set(rounded) - set(memo))
        if missing:
            r, a = self._arrays(key)
            vals = missing
            if lower:  # r <= c  <=>  r < nextafter(c)
                c = torch.tensor(self._bound(self.dual_clip), dtype=self.dtype)
                c_next = float(torch.nextafter(c, torch.tensor(_INF, dtype=self.dtype)))
                vals = sorted(set(missing) | {c_next})
            g = torch.tensor(vals, dtype=self.dtype, device=r.device)
            # lower: idx = #{g <= r}, so r < g[j] <=> idx <= j; upper: idx = #{g < r}, so r <= g[j] <=> idx <= j
            idx = torch.bucketize(r, g, right=lower)
            nb = len(vals) + 1
            ones = torch.ones(1, dtype=torch.int64, device=r.device).expand(r.numel())  # no n-sized allocation
            cnt = torch.zeros(nb, dtype=torch.int64, device=r.device).index_add_(0, idx, ones).tolist()
            # product in the ratios' dtype (as the loss computes it), accumulated in float64
            sums = torch.zeros(nb, dtype=torch.float64, device=r.device)
            sums = sums.index_add_(0, idx, (r * a).to(torch.float64)).tolist()
            cum_cnt = list(itertools.accumulate(cnt))
            if lower:
                jc = vals.index(c_next)
                for j, v in enumerate(vals):
                    memo[v] = (cum_cnt[j], math.fsum(sums[j + 1 : jc + 1]) if j < jc else 0.0)
            else:
                cum_sum = list(itertools.accumulate(sums))
                for j, v in enumerate(vals):
                    memo[v] = (r.numel() - cum_cnt[j], cum_sum[j])
        return [memo[v] for v in rounded]

    def prefetch(self, key: str, bounds: Sequence[float]) -> None:
        """Compute the statistics of several bounds in one pass (later calls hit the memo)."""
        self._side(key, bounds)

    def neg_contrib(self, key: str, lower: float) -> float:
        """Neg = sum r*|A| over A<0 with lower <= r <= dual_clip; key "n8" (FP8) or "n16" (BF16)."""
        return self._side(key, [lower])[0][1]

    def pos_contrib(self, key: str, upper: float) -> float:
        """Pos = sum r*A over A>0 with r <= upper; key "p8" (FP8) or "p16" (BF16)."""
        return self._side(key, [upper])[0][1]

    def count_below(self, key: str, bound: float) -> int:
        """#{r < bound} of the A<0 tokens ("n8", "n16")."""
        return self._side(key, [bound])[0][0]

    def count_above(self, key: str, bound: float) -> int:
        """#{r > bound} of the A>0 tokens ("p8", "p16")."""
        return self._side(key, [bound])[0][0]

    def curve(self, key: str, grid: Sequence[float]) -> torch.Tensor:
        """``[G]`` float64 contributions (Pos for "p*", Neg for "n*") at every grid point, one pass."""
        return torch.tensor([c for _, c in self._side(key, grid)], dtype=torch.float64)

    def quantile_lower(self, k: int) -> float:
        """Raw L of the sorted-quantile rule: FP8 clips exactly the k lowest r8 (ties aside)."""
        n = self.n_neg
        if n == 0:
            raise ValueError("quantile_lower needs at least one negative-advantage token")
        if k <= 0:
            return float(self.r8n.min())
        if k >= n:
            vn = float(self.r8n.max())
            return self._strictly_above(vn, vn + 1e-6)
        vk = float(torch.kthvalue(self.r8n, k).values)
        if int(torch.count_nonzero(self.r8n <= vk)) > k:
            vk1 = vk  # a tie straddles the cut
        else:  # v_{k+1} is the smallest value above v_k: one pass instead of a second selection
            vk1 = float(torch.where(self.r8n > vk, self.r8n, _INF).amin())
        if vk == vk1:
            return vk
        return self._strictly_above(vk, (vk + vk1) / 2)

    def _strictly_above(self, v: float, candidate: float) -> float:
        """``candidate`` if the dtype still sees it above ``v``, else the next value above ``v``."""
        if self._bound(candidate) > v:
            return candidate
        t = torch.tensor(v, dtype=self.dtype)
        return float(torch.nextafter(t, torch.tensor(_INF, dtype=self.dtype)))
