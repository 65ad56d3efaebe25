"""Replay recalibration schedules on a diagnostic campaign.

A diagnostic campaign runs the BF16 shadow passes on every step
(``--set calibration.interval=1``), so its ``token_stats`` hold r8 and r16 for
every token of every step. Each schedule -- ``fixed`` at several K and
``drift`` at several thresholds of each signal (KS, quantile) -- is replayed on those records
(``fp8rl_core.drift.replay``): its decisions, the bounds it would have in
force, the shadow passes it spends, and its mean bound error against the
every-step schedule (K = 1). The K = 1 replay is checked against the run's own
``bounds`` table first (same rule, same inputs: they must agree).

    python benchmarks/schedule_replay.py RUN_DIR [--ks 2,5,10,20] [--thresholds 0.05,0.1,0.2] [--dl-thresholds 0.02,0.05,0.1,0.2,0.3]

Prints one line per schedule and the verdict of the issue's goal: does some
drift setting reach the bound error of the smallest K with fewer shadow passes
than the largest K?
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fp8rl_core.drift import Schedule, StepTokens, replay  # noqa: E402
from fp8rl_core.losses import importance_ratio  # noqa: E402


def load_records(run_dir: Path) -> tuple[list[StepTokens], dict[int, tuple[float, float]], object]:
    from flows.configuration import load_config
    from storage.catalog import connect, query

    cfg = load_config(run_dir / "config.yaml")
    con = connect(run_dir)
    # the steps the campaign recorded as shadow steps (steps.shadow), and their shadowed tokens
    t = query(con, "SELECT t.step, sample_id, position, advantage, logp_fp8, old_logp_fp8, logp_bf16, old_logp_bf16 "
                   "FROM token_stats t JOIN steps s ON s.run_id = t.run_id AND s.step = t.step "
                   "WHERE s.shadow = 1 AND logp_bf16 IS NOT NULL ORDER BY t.step, sample_id, position")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--ks", default="2,5,10,20")
    ap.add_argument("--thresholds", default="0.05,0.1,0.2", help="KS-signal thresholds")
    ap.add_argument("--dl-thresholds", default="0.02,0.05,0.1,0.2,0.3", help="quantile-signal (|dL|) thresholds")
    ap.add_argument("--min-interval", type=int, default=2)
    ap.add_argument("--max-interval", type=int, default=50,
                    help="drift's longest gap (above the largest K, or drift could never spend fewer passes)")
    args = ap.parse_args()
    recs, table_bounds, cfg = load_records(args.run_dir)
    steps = [r.step for r in recs]
    if steps != list(range(1, len(steps) + 1)):
        raise SystemExit(f"need shadow records on every step 1..T, got {steps[:5]}... ({len(steps)} steps)")
    a, c = cfg.algorithm, cfg.calibration
    kw = dict(eps_low=a.eps_low, eps_high=a.eps_high, config=c, dual_clip=a.dual_clip)
    every = replay(recs, Schedule("fixed", interval=1), **kw)
    worst = max(max(abs(lo - table_bounds[s][0]), abs(hi - table_bounds[s][1]))
                for s, lo, hi in zip(every.steps, every.lower, every.upper) if s in table_bounds)
    print(f"diagnostic run: {len(recs)} steps with shadow passes; K=1 replay vs the run's bounds table: max |diff| {worst:.2e}")
    sig = [x for x in every.signal]
    rows = []
    for k in [int(x) for x in args.ks.split(",")]:
        rows.append(replay(recs, Schedule("fixed", interval=k), **kw))
    for signal, ths in (("ks", args.thresholds), ("quantile", args.dl_thresholds)):
        for th in [float(x) for x in ths.split(",") if x]:
            rows.append(replay(recs, Schedule("drift", threshold=th, min_interval=args.min_interval,
                                              max_interval=args.max_interval, signal=signal), **kw))
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
    print(f"goal (drift <= bound error of {smallest.schedule.name} = {target:.5f} with < {largest.shadow_passes} "
          f"shadow passes of {largest.schedule.name}): {'MET by ' + ', '.join(r.schedule.name for r in ok) if ok else 'NOT met'}")
    del sig


if __name__ == "__main__":
    main()
