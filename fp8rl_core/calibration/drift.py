"""Drift-triggered recalibration and the replay of calibration schedules.

The paper recalibrates on a fixed schedule: every K steps, two extra BF16
forwards over the whole batch. This module adds a schedule that recalibrates
when the FP8 ratio distribution has *moved* since the last calibration, and the
machinery to compare schedules on one run instead of on runs that diverge.

Drift signal (no BF16 pass). On every step the train stage knows the FP8 ratios
r8 of its A<0 tokens (the tokens whose lower clip Calibrated Clipping sets).
The signal of step t is the two-sample Kolmogorov-Smirnov distance

    D_t = sup_x | F_t(x) - F_c(x) |

between the empirical CDF of those ratios at step t and at the last calibration
step c (``ks_distance``; 0 when either side is empty). ``D`` is in [0, 1],
scale-free, and sensitive to the lower quantiles that set L.

A second signal (``calibration.drift_signal: quantile``) is in the bound's own
units: the L a recalibration would give *if BF16's lower-clip share had not
moved since step c*,

    Q_t = |q_t(alpha_c) - L|

with alpha_c the BF16 share below 1 - eps_low at step c (kept in the
calibrator's state and checkpoints), q_t(alpha) the sorted-quantile rule of
the calibration (the midpoint of v_k and v_k+1, k = round(alpha n), over the
A<0 FP8 ratios of step t) and L the lower bound in force
(``quantile_shift``). It sees both a moved FP8 distribution and an L still
walking towards its raw value under the step cap, and its threshold reads as
"recalibrate when L would move by more than this". Both signals are 0 on a
calibration step itself (its bounds were just set).

Decision (``drift_decision``), for step t+1 given the signal of t and ``since`` = t+1 - c:
calibrate when ``since >= max_interval``, or when ``since >= min_interval`` and
``D_t > threshold``. The live schedule can only act on the *previous* step's
signal: the shadow passes of step t+1 must start before its FP8 ratios exist.
Step 1 always calibrates. With ``schedule: fixed`` steps 1, 1+K, 1+2K, ...
calibrate. Whatever the schedule, the train stage records its decision in
``steps.shadow``, which every later reader (re-run, sweep, report) uses.

Schedule replay (``replay``). A diagnostic campaign runs the shadow passes on
every step (``calibration.interval: 1``) and so records, per step, the tokens a
full calibration would use and the bounds it gives. A schedule is replayed on
those records: walk the steps, decide as the schedule would, calibrate with the
schedule's own previous bounds on the steps it picks, keep its bounds in force
otherwise. Its score: the shadow passes it spent (= calibrations) and its bound
error against the every-step schedule, ``mean_t |L_s(t) - L_1(t)|`` (and H),
over the steps in force t = 2 .. T+1 (bounds set at step t apply from t+1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Sequence

import torch

from fp8rl_core.calibration.calibrated_clipping import CalibrationResult, CalibratorState, StandardClip, calibrate
from fp8rl_core.config.method import CalibrationConfig

__all__ = [
    "ReplayResult",
    "Schedule",
    "StepTokens",
    "drift_decision",
    "ks_distance",
    "negative_ratios",
    "quantile_shift",
    "replay",
]

REFERENCE_CAP = 8192  # the reference sample is thinned to this many order statistics


def negative_ratios(r8: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sorted float64 FP8 ratios of the valid, finite A<0 tokens (any shapes, flattened)."""
    r8, adv, m = r8.reshape(-1), adv.reshape(-1), mask.reshape(-1).bool()
    sel = m & (adv < 0) & torch.isfinite(r8) & torch.isfinite(adv)
    return torch.sort(r8[sel].to(torch.float64)).values


def thin(sorted_x: torch.Tensor, cap: int = REFERENCE_CAP) -> torch.Tensor:
    """At most ``cap`` evenly spaced order statistics of a sorted sample (a KS reference)."""
    n = sorted_x.numel()
    if n <= cap:
        return sorted_x
    idx = torch.linspace(0, n - 1, cap).round().long()
    return sorted_x[idx]


def ks_distance(x: torch.Tensor, y: torch.Tensor) -> float:
    """Two-sample KS statistic ``sup |F_x - F_y|`` of 1-D samples; 0.0 if either is empty.

    One sort per side and two ``searchsorted`` over the pooled values: the sup
    of the difference of two right-continuous step CDFs is attained at a sample
    point, so evaluating both CDFs (``right=True``) at every pooled value is exact.
    """
    x = torch.sort(x.reshape(-1).to(torch.float64)).values
    y = torch.sort(y.reshape(-1).to(torch.float64)).values
    if x.numel() == 0 or y.numel() == 0:
        return 0.0
    pooled = torch.cat([x, y])
    fx = torch.searchsorted(x, pooled, right=True).to(torch.float64) / x.numel()
    fy = torch.searchsorted(y, pooled, right=True).to(torch.float64) / y.numel()
    return float((fx - fy).abs().max())


def quantile_shift(x: torch.Tensor, alpha: float | None, lower: float) -> float:
    """``|q(alpha) - lower|`` over the sample ``x`` (A<0 FP8 ratios); 0.0 if ``x`` is empty or ``alpha`` unknown.

    ``q`` is the calibration's sorted-quantile rule: ``k = round(alpha n)``;
    v1 if k = 0, vn if k = n, else (vk + vk+1) / 2 (the tie and dtype niceties
    of ``CalibrationTokens.quantile_lower`` change nothing at this resolution).
    """
    x = torch.sort(x.reshape(-1).to(torch.float64)).values
    n = x.numel()
    if n == 0 or alpha is None or not math.isfinite(alpha):
        return 0.0
    k = min(max(int(round(alpha * n)), 0), n)
    q = float(x[0]) if k == 0 else float(x[-1]) if k == n else float(x[k - 1] + x[k]) / 2
    return abs(q - float(lower))


def drift_decision(signal: float | None, since: int, *, threshold: float, min_interval: int, max_interval: int) -> bool:
    """Recalibrate now? ``signal`` = D of the previous step (None = unknown), ``since`` = steps since
    the last calibration."""
    if since >= max_interval:
        return True
    if since < min_interval or signal is None or not math.isfinite(signal):
        return False
    return signal > threshold


@dataclass(frozen=True)
class Schedule:
    """A recalibration schedule: ``fixed`` every ``interval`` steps or ``drift``."""

    kind: Literal["fixed", "drift"]
    interval: int = 20
    threshold: float = 0.1
    min_interval: int = 2
    max_interval: int = 20
    signal: Literal["ks", "quantile"] = "ks"

    @classmethod
    def from_config(cls, cfg: CalibrationConfig) -> "Schedule":
        return cls(
            cfg.schedule,
            cfg.interval,
            cfg.drift_threshold,
            cfg.drift_min_interval,
            cfg.drift_max_interval,
            cfg.drift_signal,
        )

    @property
    def name(self) -> str:
        if self.kind == "fixed":
            return f"fixed K={self.interval}"
        sym = "D" if self.signal == "ks" else "dL"
        return f"drift {sym}>{self.threshold:g} [{self.min_interval},{self.max_interval}]"

    def measure(self, neg: torch.Tensor, reference: torch.Tensor | None, state: CalibratorState) -> float:
        """The drift signal of a step that did not calibrate: its sorted A<0 FP8 ratios ``neg`` against the
        last calibration (``reference``: that step's A<0 FP8 ratios; ``state``: the calibrator after it)."""
        if state.last_step is None:
            return float("nan")
        if self.signal == "quantile":
            return quantile_shift(neg, state.alpha, state.lower)
        return ks_distance(neg, reference) if reference is not None else float("nan")

    def calibrates(self, step: int, last: int | None, prev_signal: float | None) -> bool:
        """Does ``step`` (>= 1) calibrate, given the last calibration step and the previous step's D?"""
        if step < 1:
            return False
        if self.kind == "fixed":
            return (step - 1) % self.interval == 0
        if last is None:
            return True
        return drift_decision(
            prev_signal,
            step - last,
            threshold=self.threshold,
            min_interval=self.min_interval,
            max_interval=self.max_interval,
        )

    @classmethod
    def decide(
        cls, config: CalibrationConfig, step: int, last: int | None, previous_signal: Callable[[], float | None]
    ) -> bool:
        """The schedule's one answer for ``step``: :meth:`calibrates` under ``config``, reading the previous
        step's drift signal (``previous_signal()``) only where the drift rule needs it."""
        sched = cls.from_config(config)
        if sched.kind == "fixed":
            return sched.calibrates(step, None, None)
        prev = previous_signal() if last is not None and step - 1 >= 1 else None
        return sched.calibrates(step, last, prev)


@dataclass(frozen=True)
class StepTokens:
    """One diagnostic step's calibration inputs (flattened tokens, every one with r8 and r16)."""

    step: int
    r8: torch.Tensor
    r16: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor

    def calibrated(
        self, state: CalibratorState, standard: StandardClip, config: CalibrationConfig
    ) -> tuple[CalibratorState, CalibrationResult]:
        """A calibration on this step's tokens from ``state``: the state after it, and its result."""
        res = calibrate(self.r8, self.r16, self.advantages, self.mask, standard=standard, config=config, previous=state)
        return state.updated(res, self.step), res


@dataclass
class ReplayResult:
    """Per step (sorted): decision, signal, bounds in force from the next step; and the totals."""

    schedule: Schedule
    steps: list[int] = field(default_factory=list)
    calibrated: list[bool] = field(default_factory=list)
    signal: list[float] = field(default_factory=list)  # D of the step vs the reference in force
    lower: list[float] = field(default_factory=list)  # bounds in force from step + 1
    upper: list[float] = field(default_factory=list)

    @property
    def shadow_passes(self) -> int:
        return sum(self.calibrated)

    def bound_error(self, reference: "ReplayResult") -> tuple[float, float]:
        """(mean |L - L_ref|, mean |H - H_ref|) over the steps both replays cover."""
        if self.steps != reference.steps:
            raise ValueError("bound_error needs replays over the same steps")
        n = max(len(self.steps), 1)
        el = math.fsum(abs(a - b) for a, b in zip(self.lower, reference.lower)) / n
        eh = math.fsum(abs(a - b) for a, b in zip(self.upper, reference.upper)) / n
        return el, eh


def replay(
    records: Sequence[StepTokens] | Iterable[StepTokens],
    schedule: Schedule,
    *,
    eps_low: float,
    eps_high: float,
    config: CalibrationConfig,
    dual_clip: float = 3.0,
) -> ReplayResult:
    """Replay ``schedule`` over diagnostic records (steps 1..T, every one with a shadow pass).

    Returns the decisions, the drift signal of every step against the schedule's
    own reference (the A<0 FP8 ratios of its last calibration step) and the
    bounds in force after each step. ``config.mode`` picks the clip mode.
    """
    out = ReplayResult(schedule)
    state = CalibratorState.initial(eps_low=eps_low, eps_high=eps_high, config=config)
    ref: torch.Tensor | None = None
    prev_signal: float | None = None
    for rec in sorted(records, key=lambda r: r.step):
        cal = schedule.calibrates(rec.step, state.last_step, prev_signal)
        neg = negative_ratios(rec.r8, rec.advantages, rec.mask)
        if cal:
            state, _ = rec.calibrated(state, StandardClip(eps_low, eps_high, dual_clip), config)
            ref = thin(neg)
        signal = 0.0 if cal else schedule.measure(neg, ref, state)  # as the live train stage records it
        prev_signal = signal
        out.steps.append(rec.step)
        out.calibrated.append(cal)
        out.signal.append(signal)
        out.lower.append(state.lower)
        out.upper.append(state.upper)
    return out
