"""The long horizon in the over-clipping regime: headroom, then drift (``configs/sweeps/regime-long.yaml``).

Question answered: over 200 steps, does FP8 drift away from BF16 in a way the 40-step cells cannot
show? The rules are the sweep file's, fixed before its cells ran:

* **headroom** (each reference cell, finished or still running): the mean of its evaluations at
  steps 190 and 200 minus the mean at 150 and 160, in points; the question can be asked of the
  preset only if this is at least 1 point on the reference's first seed;
* **drift** (each other setting, paired by seed with the reference): the least-squares slope, per 100
  steps over steps ``--from`` to the end, of FP8 minus BF16 in entropy, in the A<0 lower-clip share,
  and in evaluation accuracy. A quantity drifts if its slope has one sign on every seed.

Also printed: each quantity's mean over windows of 40 steps, per setting (means over seeds), the
table behind a reader's curve; the sweep's HTML report (``fp8rl report runs/sweeps/regime-long``)
draws the per-step curves themselves.

    python benchmarks/long_horizon.py runs/sweeps/regime-long [--reference bf16] [--from 40] [--partial]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.seed_comparison import CELL, finished_cells  # noqa: E402

QUANTITIES = {  # name -> (steps column or "eval", scale to print)
    "entropy": ("entropy_mean", 1.0),
    "A<0 lower-clip %": ("clipfrac_lower", 100.0),
    "eval %": ("eval", 100.0),
}
WINDOW = 40


def cells_of(sweep_dir: Path, partial: bool) -> dict[str, dict[int, str]]:
    """setting -> {seed: run id}: the finished cells, and with ``partial`` also the runs still going."""
    cells = finished_cells(sweep_dir)
    if partial:
        for run in sorted(p.name for p in sweep_dir.iterdir() if p.is_dir() and not p.name.startswith("_")):
            m = CELL.match(run)
            if m:
                cells.setdefault(m["setting"], {}).setdefault(int(m["seed"]), run)
    return cells


def series(sweep_dir: Path, runs: list[str]) -> dict[str, dict[str, dict[int, float]]]:
    """run id -> quantity -> {step: value} (evaluation: the mean correctness of the step's evaluation)."""
    from storage.queries.catalog import connect, query

    con = connect(sweep_dir, runs=runs)
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    cols = [c for c, _ in QUANTITIES.values() if c != "eval"]
    for row in query(con, f"SELECT run_id, step, {', '.join(cols)} FROM steps WHERE variant = 'main'").to_pylist():
        for c in cols:
            if row[c] is not None:
                out[row["run_id"]][c][int(row["step"])] = float(row[c])
    evals = query(
        con, "SELECT run_id, step, avg(correct::DOUBLE) AS acc FROM evals WHERE variant = 'main' GROUP BY ALL"
    ).to_pylist()
    for row in evals:
        out[row["run_id"]]["eval"][int(row["step"])] = float(row["acc"])
    return out


def slope_per_100(points: dict[int, float]) -> float:
    """Least-squares slope of value against step, per 100 steps (nan with fewer than 3 points)."""
    if len(points) < 3:
        return float("nan")
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return 100.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


def headroom(evals: dict[int, float]) -> float | None:
    """Points gained from steps 150-160 to steps 190-200 (None until all four evaluations exist)."""
    if not all(s in evals for s in (150, 160, 190, 200)):
        return None
    return 100.0 * ((evals[190] + evals[200]) / 2 - (evals[150] + evals[160]) / 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--reference", default="bf16")
    ap.add_argument("--from", dest="start", type=int, default=40, help="first step of the drift slopes")
    ap.add_argument("--partial", action="store_true", help="include cells still running")
    args = ap.parse_args()
    cells = cells_of(args.sweep_dir, args.partial)
    if args.reference not in cells:
        ap.error(f"{args.sweep_dir}: no {args.reference} cell (finished; --partial for running ones)")
    runs = sorted({r for by_seed in cells.values() for r in by_seed.values()})
    data = series(args.sweep_dir, runs)

    print("headroom (eval at 190-200 minus 150-160, points; the rule asks >= 1 on the first seed):")
    for seed, run in sorted(cells[args.reference].items()):
        h = headroom(data[run]["eval"])
        last = max(data[run]["eval"], default=0)
        said = f"{h:+.2f}" if h is not None else f"not yet (evaluated to step {last})"
        print(f"  {args.reference}.s{seed}: {said}")

    print(f"\nmeans over windows of {WINDOW} steps (over seeds):")
    print("| setting | quantity | " + " | ".join(f"{a + 1}-{a + WINDOW}" for a in range(0, 200, WINDOW)) + " |")
    print("|---|---|" + "---:|" * (200 // WINDOW))
    for setting, by_seed in sorted(cells.items()):
        for name, (col, scale) in QUANTITIES.items():
            row = []
            for a in range(0, 200, WINDOW):
                vals = [v for r in by_seed.values() for s, v in data[r][col].items() if a < s <= a + WINDOW]
                row.append(f"{scale * statistics.fmean(vals):.3f}" if vals else "-")
            print(f"| {setting} | {name} | " + " | ".join(row) + " |")

    print(f"\ndrift: slope per 100 steps of setting - {args.reference}, steps {args.start} on, by seed:")
    print("| setting | quantity | slopes by seed | one sign on every seed |")
    print("|---|---|---|---|")
    for setting, by_seed in sorted(cells.items()):
        if setting == args.reference:
            continue
        for name, (col, scale) in QUANTITIES.items():
            slopes = {}
            for seed, run in sorted(by_seed.items()):
                ref = cells[args.reference].get(seed)
                if ref is None:
                    continue
                a, b = data[run][col], data[ref][col]
                diff = {s: scale * (a[s] - b[s]) for s in a if s in b and s >= args.start}
                slopes[seed] = slope_per_100(diff)
            shown = ", ".join(f"s{s} {v:+.3f}" for s, v in slopes.items()) or "no paired seed"
            signs = {v > 0 for v in slopes.values() if v == v and v != 0}
            drift = "yes" if len(slopes) > 1 and len(signs) == 1 and all(v == v for v in slopes.values()) else "no"
            print(f"| {setting} | {name} | {shown} | {drift} |")


if __name__ == "__main__":
    main()
