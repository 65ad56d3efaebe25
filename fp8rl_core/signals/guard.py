"""The guard's detectors: entropy surge, garbled surge, reward collapse, non-finite updates.

Pure functions over the sequence of step rows (``steps`` table values, in step
order); the campaign hook (``flows.campaign.guard``) acts on a trip: restore the last
good checkpoint on all ranks, record why in the ledger, continue with a remedy.

Surge (docs/method.md, "Failure signals"): step s starts a surge of a series x when x_s and
the next ``persist - 1`` steps all exceed ``factor`` x the median of the
``window`` steps before s (the reference stays the one before the surge
started), and exceed ``floor`` (an absolute level below which a rise is not a
surge: 1.5 x a garbled share of 0 would be any garbled answer). It is
*detected* at step s + persist - 1. A median needs ``window`` earlier steps;
before that nothing is detected. Defaults (config ``guard.*``): factor 1.5,
window 10, persist 3 (docs/method.md), entropy floor 0.2 nats and garbled floor 0.05
(our choices: the tiny task's entropy is 0.05-0.15 nats).

Reward collapse: the mirror image on reward_mean: ``persist`` steps below
``reward_collapse_factor`` x the median of the ``window`` steps before, while
that median is at least ``reward_min`` (a collapse needs something to lose).

Non-finite update: a step with a skipped update (non-finite loss or gradient,
``skipped_updates > 0``) or a non-finite loss, grad norm or entropy: detected
at once, the step itself is the first bad one.

Rollback target: the policy that produced step s's rows is the one after
update s - 1, so the newest checkpoint of a step <= s - 2 is the last good one
(``last_good_step``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["Trip", "check", "last_good_step", "surge_start"]


@dataclass(frozen=True)
class Trip:
    """Why the guard tripped: ``kind``, the step it was detected at, the first bad step, a one-line detail."""

    kind: str  # entropy_surge | garbled_surge | reward_collapse | non_finite
    detected_step: int
    first_bad_step: int
    detail: str


def surge_start(
    values: Sequence[float],
    *,
    factor: float,
    window: int,
    persist: int,
    floor: float = 0.0,
    below: bool = False,
    ref_min: float = 0.0,
    only_last: bool = False,
) -> int | None:
    """Index s of the first surge (or collapse, ``below=True``) that is complete by the end of ``values``, else None.

    ``values[i]`` is the series at the i-th step; NaN values never count as above/below.
    ``only_last``: only a surge *detected* at the last value (s = len - persist).
    """
    n = len(values)

    def starts_at(s: int) -> bool:
        if s < window or s + persist > n:
            return False
        ref_vals = [v for v in values[s - window : s] if math.isfinite(v)]
        if len(ref_vals) < window:
            return False
        ref = statistics.median(ref_vals)
        if below:
            return ref >= ref_min and all(math.isfinite(v) and v < factor * ref for v in values[s : s + persist])
        return all(math.isfinite(v) and v > factor * ref and v > floor for v in values[s : s + persist])

    if only_last:  # detected now: a surge starts at n - persist and was not already running one step earlier
        s = n - persist
        return s if starts_at(s) and not starts_at(s - 1) else None
    return next((s for s in range(window, n - persist + 1) if starts_at(s)), None)


def check(rows: Sequence[Mapping[str, float]], cfg, *, at_last: bool = False) -> Trip | None:
    """The first trip in ``rows`` (step rows in step order, keys as the ``steps`` columns), or None.

    ``cfg``: a ``GuardConfig``. ``at_last``: only a trip detected at the last
    row (what the campaign asks after each step, so an old surge the guard
    did not act on -- e.g. from before it was enabled -- cannot mask a new one).
    """
    steps = [int(r["step"]) for r in rows]
    for r in rows[-1:] if at_last else rows:
        vals = [r.get(k, 0.0) for k in ("loss", "grad_norm", "entropy_mean")]
        if (r.get("skipped_updates") or 0) > 0 or any(v is not None and not math.isfinite(v) for v in vals):
            return Trip("non_finite", int(r["step"]), int(r["step"]), "non-finite loss, gradient or entropy")

    def series(key: str) -> list[float]:
        return [float("nan") if r.get(key) is None else float(r[key]) for r in rows]

    # (trip, step column, surge_start's thresholds, the line naming the value v at the first bad step s)
    watched = (
        ("entropy_surge", "entropy_mean", dict(factor=cfg.surge_factor, floor=cfg.entropy_floor),
         lambda v, s: f"entropy {v:.3f} > {cfg.surge_factor} x median of the {cfg.window} steps before step {s}"),
        ("garbled_surge", "garbled_share", dict(factor=cfg.surge_factor, floor=cfg.garbled_floor),
         lambda v, s: f"garbled share {v:.3f} > {cfg.surge_factor} x median before step {s}"),
        ("reward_collapse", "reward_mean",
         dict(factor=cfg.reward_collapse_factor, below=True, ref_min=cfg.reward_min),
         lambda v, s: f"reward {v:.3f} < {cfg.reward_collapse_factor} x median before step {s}"),
    )
    found: list[Trip] = []
    for name, column, thresholds, line in watched:
        values = series(column)
        s = surge_start(values, window=cfg.window, persist=cfg.persist, only_last=at_last, **thresholds)
        if s is not None:
            found.append(Trip(name, steps[s + cfg.persist - 1], steps[s], line(values[s], steps[s])))
    return min(found, key=lambda t: (t.detected_step, t.first_bad_step)) if found else None


def last_good_step(first_bad_step: int, checkpoint_steps: Sequence[int]) -> int | None:
    """The newest checkpoint step <= first_bad_step - 2, or None."""
    ok = [c for c in checkpoint_steps if c <= first_bad_step - 2]
    return max(ok) if ok else None
