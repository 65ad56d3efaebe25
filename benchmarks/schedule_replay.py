"""Replay recalibration schedules on a diagnostic campaign.

A diagnostic campaign runs the BF16 shadow passes on every step
(``--set calibration.interval=1``), so its ``token_stats`` hold r8 and r16 for
every token of every step. Each schedule -- ``fixed`` at several K and
``drift`` at several thresholds of each signal (KS, quantile) -- is replayed on those records
(``fp8rl_core.calibration.drift.replay``): its decisions, the bounds it would have in
force, the shadow passes it spends, and its mean bound error against the
every-step schedule (K = 1). The K = 1 replay is checked against the run's own
``bounds`` table first (same rule, same inputs: they must agree).

    python benchmarks/schedule_replay.py RUN_DIR [--ks 2,5,10,20] [--thresholds 0.05,0.1,0.2] \
        [--dl-thresholds 0.02,0.05,0.1,0.2,0.3]

Prints one line per schedule and the verdict: does some drift setting reach the
bound error of the smallest K with fewer shadow passes than the largest K?

Estimators of the raw L (``calibration.estimator``, fp8rl_core.calibration.estimators) are
scored with ``--estimators quantile,pooled,k_floor,harrell_davis`` (fixed K of
``--estimator-ks``) by their *predictive clip-share error*: on every step s
after the first calibration, |FP8's lower-clip share of the A<0 tokens under
the L in force at s - BF16's share at 1 - eps_low|, averaged over the steps
(so a calibration at t is judged on t+1..t+K, the steps its L governs), next to
the shadow tokens the schedule spends and the tokens each estimate rests on.
Each estimator is replayed with the run's smoothing (``max_delta``) and without
it (``max_delta`` = 1: the raw L in force, clamped to [lower_min, lower_max]).

    python benchmarks/schedule_replay.py RUN_DIR --estimators quantile,pooled,k_floor,harrell_davis \
        --estimator-ks 1,5,10 --no-schedules
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fp8rl_core.calibration.calibrated_clipping import CalibratorState, StandardClip  # noqa: E402
from fp8rl_core.calibration.drift import Schedule, StepTokens, negative_ratios, replay  # noqa: E402
from fp8rl_core.calibration.estimators import LOWER_ESTIMATORS  # noqa: E402
from fp8rl_core.objective.losses import importance_ratio  # noqa: E402


def load_records(run_dir: Path) -> tuple[list[StepTokens], dict[int, tuple[float, float]], object]:
    from flows.campaign.configuration import load_config
    from storage.queries.catalog import connect, query

    cfg = load_config(run_dir / "config.yaml")
    con = connect(run_dir)
    # the steps the campaign recorded as shadow steps (steps.shadow), and their shadowed tokens
    t = query(
        con,
        "SELECT t.step, sample_id, position, advantage, logp_fp8, old_logp_fp8, logp_bf16, old_logp_bf16 "
        "FROM token_stats t JOIN steps s ON s.run_id = t.run_id AND s.step = t.step "
        "WHERE s.shadow = 1 AND logp_bf16 IS NOT NULL ORDER BY t.step, sample_id, position",
    )
    cols = {c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names}
    recs = []
    steps = cols["step"]
    for s in np.unique(steps):
        sel = steps == s

        def f(name):
            return torch.from_numpy(cols[name][sel].astype(np.float32))

        r8 = importance_ratio(f("logp_fp8"), f("old_logp_fp8"))
        r16 = importance_ratio(f("logp_bf16"), f("old_logp_bf16"))
        adv = f("advantage")
        recs.append(StepTokens(int(s), r8, r16, adv, torch.ones_like(adv, dtype=torch.bool)))
    b = query(con, "SELECT step, lower, upper FROM bounds ORDER BY step").to_pylist()
    return recs, {int(r["step"]): (r["lower"], r["upper"]) for r in b}, cfg


_NAN = float("nan")


def replay_estimator(
    recs: list[StepTokens], config, interval: int, *, eps_low: float, eps_high: float, dual_clip: float
) -> dict:
    """Fixed-K replay of one calibration config: predictive clip-share error and shadow-token costs."""
    state = CalibratorState.initial(eps_low=eps_low, eps_high=eps_high, config=config)
    sched = Schedule("fixed", interval=interval)
    errors, bias, spent, per_estimate, widths, share16, raw = [], [], 0, [], [], [], []
    for rec in recs:
        neg8 = negative_ratios(rec.r8, rec.advantages, rec.mask)
        if state.last_step is not None and neg8.numel():  # the L in force at this step vs BF16's share here
            neg16 = negative_ratios(rec.r16, rec.advantages, rec.mask)
            share16.append(float((neg16 < 1.0 - eps_low).double().mean()))
            d = float((neg8 < state.lower).double().mean()) - share16[-1]
            errors.append(abs(d))
            bias.append(d)
        if sched.calibrates(rec.step, state.last_step, None):
            state, res = rec.calibrated(state, StandardClip(eps_low, eps_high, dual_clip), config)
            spent += int(rec.mask.sum())
            per_estimate.append(res.shadow_tokens)
            raw.append(res.raw_lower)
            if res.lower_ci_low is not None:
                widths.append(res.lower_ci_high - res.lower_ci_low)
    return {
        "error": float(np.mean(errors)),
        "error_se": float(np.std(errors, ddof=1) / np.sqrt(len(errors))),
        "bias": float(np.mean(bias)),
        "spent": spent,
        "per_estimate": float(np.mean(per_estimate)),
        "ci_width": float(np.mean(widths)) if widths else _NAN,
        "calibrations": len(per_estimate),
        "raw_walk": float(np.mean(np.abs(np.diff(raw)))) if len(raw) > 1 else _NAN,
        "bf16_share": float(np.mean(share16)),
        "scored_steps": len(errors),
    }


def score_estimators(recs: list[StepTokens], cfg, names: list[str], ks: list[int]) -> list[tuple]:
    """One row per (estimator, K, smoothing): the scores of ``replay_estimator``."""
    a = cfg.algorithm
    kw = dict(eps_low=a.eps_low, eps_high=a.eps_high, dual_clip=a.dual_clip)
    rows = []
    for name in names:
        for smooth in (True, False):
            upd = {"estimator": name} | ({} if smooth else {"max_delta": 1.0})
            c = cfg.calibration.model_copy(update=upd)
            for k in ks:
                rows.append((name, k, smooth, replay_estimator(recs, c, k, **kw)))
    return rows


def print_estimators(rows: list[tuple], cfg) -> None:
    c = cfg.calibration
    print(
        f"estimators (window {c.estimator_window}, min clipped {c.estimator_min_clipped}, "
        f"CI level {c.estimator_ci_level}); error = mean |FP8 lower-clip share under L in force - BF16's|"
    )
    r0 = rows[0][3]
    print(
        f"BF16's mean lower-clip share of the A<0 tokens on the {r0['scored_steps']} scored steps: "
        f"{r0['bf16_share']:.5f}"
    )
    print(
        f"{'estimator':<14} {'K':>3} {'smoothing':>9} {'clip-share err':>14} {'(se)':>8} {'bias':>8} "
        f"{'shadow tokens':>13} {'tokens/estimate':>15} {'CI width':>9} {'mean |dL raw|':>13}"
    )
    for name, k, smooth, r in rows:
        print(
            f"{name:<14} {k:>3} {'on' if smooth else 'off':>9} {r['error']:>14.5f} {r['error_se']:>8.5f} "
            f"{r['bias']:>+8.5f} "
            f"{r['spent']:>13} {r['per_estimate']:>15.0f} {r['ci_width']:>9.4f} {r['raw_walk']:>13.4f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--ks", default="2,5,10,20")
    ap.add_argument("--thresholds", default="0.05,0.1,0.2", help="KS-signal thresholds")
    ap.add_argument("--dl-thresholds", default="0.02,0.05,0.1,0.2,0.3", help="quantile-signal (|dL|) thresholds")
    ap.add_argument("--min-interval", type=int, default=2)
    ap.add_argument(
        "--max-interval",
        type=int,
        default=50,
        help="drift's longest gap (above the largest K, or drift could never spend fewer passes)",
    )
    ap.add_argument("--estimators", default="", help="raw-L estimators to score, comma-separated (none: skip)")
    ap.add_argument("--estimator-ks", default="1,5,10", help="fixed K of the estimator replays")
    ap.add_argument("--no-schedules", action="store_true", help="skip the schedule table")
    args = ap.parse_args()
    names = [x for x in args.estimators.split(",") if x]
    bad = [x for x in names if x not in LOWER_ESTIMATORS]
    if bad:
        print(
            f"schedule_replay: unknown estimator {bad[0]!r}; valid: {', '.join(LOWER_ESTIMATORS.names())}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    recs, table_bounds, cfg = load_records(args.run_dir)
    steps = [r.step for r in recs]
    if steps != list(range(1, len(steps) + 1)):
        raise SystemExit(f"need shadow records on every step 1..T, got {steps[:5]}... ({len(steps)} steps)")
    a, c = cfg.algorithm, cfg.calibration
    kw = dict(eps_low=a.eps_low, eps_high=a.eps_high, config=c, dual_clip=a.dual_clip)
    every = replay(recs, Schedule("fixed", interval=1), **kw)
    worst = max(
        max(abs(lo - table_bounds[s][0]), abs(hi - table_bounds[s][1]))
        for s, lo, hi in zip(every.steps, every.lower, every.upper)
        if s in table_bounds
    )
    print(
        f"diagnostic run: {len(recs)} steps with shadow passes; K=1 replay vs the run's bounds table: max |diff| "
        f"{worst:.2e}"
    )
    if names:
        print_estimators(score_estimators(recs, cfg, names, [int(x) for x in args.estimator_ks.split(",")]), cfg)
    if args.no_schedules:
        return
    sig = [x for x in every.signal]
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        rows.append(replay(recs, Schedule("fixed", interval=k), **kw))
    for signal, ths in (("ks", args.thresholds), ("quantile", args.dl_thresholds)):
        for th in [float(x) for x in ths.split(",") if x]:
            rows.append(
                replay(
                    recs,
                    Schedule(
                        "drift",
                        threshold=th,
                        min_interval=args.min_interval,
                        max_interval=args.max_interval,
                        signal=signal,
                    ),
                    **kw,
                )
            )
    print(f"{'schedule':<28} {'shadow passes':>13} {'mean |dL|':>10} {'mean |dH|':>10} {'mean signal':>12}")
    for r in rows:
        el, eh = r.bound_error(every)
        d = [x for x, cal in zip(r.signal, r.calibrated) if not cal]
        print(f"{r.schedule.name:<28} {r.shadow_passes:>13} {el:>10.5f} {eh:>10.5f} {np.mean(d) if d else 0:>12.4f}")
    fixed = [r for r in rows if r.schedule.kind == "fixed"]
    drift = [r for r in rows if r.schedule.kind == "drift"]
    smallest, largest = fixed[0], fixed[-1]
    target = sum(smallest.bound_error(every))
    ok = [r for r in drift if sum(r.bound_error(every)) <= target and r.shadow_passes < largest.shadow_passes]
    print(
        f"goal (drift <= bound error of {smallest.schedule.name} = {target:.5f} with < {largest.shadow_passes} "
        f"shadow passes of {largest.schedule.name}): "
        f"{'MET by ' + ', '.join(r.schedule.name for r in ok) if ok else 'NOT met'}"
    )
    del sig


if __name__ == "__main__":
    main()
