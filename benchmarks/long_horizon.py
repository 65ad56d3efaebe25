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
draws the per-step curves themselves, and ``--png`` draws them as one figure: evaluation, entropy and
the A<0 lower-clip share against the step, each seed thin and the mean over seeds thick (entropy and
the clip share as means over a sliding window of 10 steps).

    python benchmarks/long_horizon.py runs/sweeps/regime-long [--reference bf16] [--from 40] [--partial]
        [--png docs/regime-long.png [--png-settings bf16,fp8-standard]]
    python benchmarks/long_horizon.py --archive benchmarks/results/regime-long.jsonl   # the archived cells

``--archive``: cells archived by ``benchmarks/cell_archive.py`` (each line holds its per-step metrics
and every evaluation outcome), alone or beside a sweep directory, whose own cells win.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cell_archive import ARCHIVE_PREFIX, as_rows  # noqa: E402
from benchmarks.seed_comparison import CELL, archived_cells, finished_cells  # noqa: E402

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


def archived_series(lines: dict[str, dict]) -> dict[str, dict[str, dict[int, float]]]:
    """As :func:`series`, for archived cells (run id ``archive:<cell>``), read through the archive's own
    row decoding (:func:`benchmarks.cell_archive.as_rows`)."""
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    cols = [c for c, _ in QUANTITIES.values() if c != "eval"]
    for cell, line in lines.items():
        evals, steps = as_rows({**line, "cell": cell})
        run = ARCHIVE_PREFIX + cell
        for row in steps:
            for c in cols:
                if row.get(c) is not None:
                    out[run][c][int(row["step"])] = float(row[c])
        outcomes: dict[int, list[bool]] = defaultdict(list)
        for row in evals:
            outcomes[row["step"]].append(row["correct"])
        for step, flags in outcomes.items():
            out[run]["eval"][step] = sum(flags) / len(flags)
    return out


def series(sweep_dir: Path | None, runs: list[str]) -> dict[str, dict[str, dict[int, float]]]:
    """run id -> quantity -> {step: value} (evaluation: the mean correctness of the step's evaluation)."""
    out: dict[str, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    if sweep_dir is None or not runs:
        return out
    from storage.queries.catalog import connect, query

    con = connect(sweep_dir, runs=runs)
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


def window_means(a: dict[int, float], b: dict[int, float], start: int) -> tuple[float, float] | None:
    """The means of two series over the steps of the window after ``start`` that both have."""
    common = [s for s in a if s in b and start < s <= start + WINDOW]
    if not common:
        return None
    return statistics.fmean(a[s] for s in common), statistics.fmean(b[s] for s in common)


def headroom(evals: dict[int, float]) -> float | None:
    """Points gained from steps 150-160 to steps 190-200 (None until all four evaluations exist)."""
    if not all(s in evals for s in (150, 160, 190, 200)):
        return None
    return 100.0 * ((evals[190] + evals[200]) / 2 - (evals[150] + evals[160]) / 2)


SMOOTH = 10  # steps in the sliding mean of the per-step curves (the evaluation is drawn as it is)


def _smoothed(points: dict[int, float], width: int) -> tuple[list[int], list[float]]:
    steps = sorted(points)
    vals = [points[s] for s in steps]
    if width <= 1:
        return steps, vals
    out = [statistics.fmean(vals[max(0, i - width + 1) : i + 1]) for i in range(len(vals))]
    return steps, out


COLOURS = {  # one colour per setting of the sweep file, the same in every figure
    "bf16": "tab:blue",
    "fp8-standard": "tab:red",
    "fp8-calibrated": "tab:green",
    "fp8-oracle": "tab:purple",
    "fp8-rollout-only": "tab:orange",
    "fp8-train-only": "tab:brown",
}
OTHER_COLOURS = ("tab:pink", "tab:gray", "tab:olive", "tab:cyan")


def colours_of(cells) -> dict[str, object]:
    """A colour per setting: the sweep's own settings keep theirs, other names take the rest in turn (any
    number of them: past the named colours, matplotlib's own cycle)."""
    import matplotlib

    spare = [*OTHER_COLOURS, *matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]]
    out, i = {}, 0
    for setting in sorted(cells):
        if setting in COLOURS:
            out[setting] = COLOURS[setting]
        else:
            out[setting] = spare[i % len(spare)]
            i += 1
    return out


def draw(cells: dict[str, dict[int, str]], data, path: Path, caption: str) -> None:
    """The per-step curves as one PNG: a panel per quantity, a colour per setting, each seed thin and
    the mean over the seeds thick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(QUANTITIES), figsize=(5.2 * len(QUANTITIES), 4.0))
    colours = colours_of(cells)
    for ax, (name, (col, scale)) in zip(axes, QUANTITIES.items()):
        width = 1 if col == "eval" else SMOOTH
        for setting, by_seed in sorted(cells.items()):
            per_seed = []
            for run in by_seed.values():
                pts = {s: scale * v for s, v in data[run][col].items()}
                if not pts:
                    continue
                xs, ys = _smoothed(pts, width)
                ax.plot(xs, ys, color=colours[setting], linewidth=0.6, alpha=0.35)
                per_seed.append(dict(zip(xs, ys)))
            common = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
            if common:
                mean = [statistics.fmean(p[s] for p in per_seed) for s in common]
                ax.plot(common, mean, color=colours[setting], linewidth=2.0, label=f"{setting} ({len(per_seed)} seeds)")
        ax.set_title(name + ("" if width == 1 else f" (mean of {width} steps)"))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.text(0.01, 0.01, caption, fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"\nwrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path, nargs="?", help="a sweep directory (optional with --archive)")
    ap.add_argument("--archive", type=Path, action="append", default=[],
                    help="cells archived by benchmarks/cell_archive.py (repeatable)")
    ap.add_argument("--reference", default="bf16")
    ap.add_argument("--from", dest="start", type=int, default=40, help="first step of the drift slopes")
    ap.add_argument("--partial", action="store_true", help="include cells still running")
    ap.add_argument("--png", type=Path, help="also draw the per-step curves into this PNG")
    ap.add_argument("--caption", default="", help="a line under the figure (its date and command)")
    ap.add_argument("--png-settings", default="",
                    help="comma-separated settings to draw (default: every setting; the tables keep them all)")
    args = ap.parse_args()
    if args.sweep_dir is None and not args.archive:
        ap.error("give a sweep directory, --archive FILE, or both")
    cells = cells_of(args.sweep_dir, args.partial) if args.sweep_dir is not None else {}
    live = sorted({r for by_seed in cells.values() for r in by_seed.values()})
    archived = archived_cells(args.archive, cells)
    for cell in archived:
        m = CELL.match(cell)
        cells.setdefault(m["setting"], {})[int(m["seed"])] = ARCHIVE_PREFIX + cell
    if args.reference not in cells:
        ap.error(f"no {args.reference} cell (finished; --partial for running ones)")
    data = series(args.sweep_dir, live)
    data.update(archived_series(archived))

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

    print(f"\npaired by seed, means over windows of {WINDOW} steps: setting - {args.reference} (and setting / "
          f"{args.reference}), over the seeds both have:")
    print("| setting | quantity | seeds | " + " | ".join(f"{a + 1}-{a + WINDOW}" for a in range(0, 200, WINDOW)) + " |")
    print("|---|---|---:|" + "---:|" * (200 // WINDOW))
    for setting, by_seed in sorted(cells.items()):
        if setting == args.reference:
            continue
        seeds = sorted(s for s in by_seed if s in cells[args.reference])
        for name, (col, scale) in QUANTITIES.items():
            row = []
            for a in range(0, 200, WINDOW):
                pairs = [window_means(data[by_seed[s]][col], data[cells[args.reference][s]][col], a) for s in seeds]
                pairs = [p for p in pairs if p is not None]
                if not pairs:
                    row.append("-")
                    continue
                mine, ref = statistics.fmean(p[0] for p in pairs), statistics.fmean(p[1] for p in pairs)
                ratio = f" ({mine / ref:.2f}x)" if ref else ""
                row.append(f"{scale * (mine - ref):+.3f}{ratio}")
            print(f"| {setting} | {name} | {len(seeds)} | " + " | ".join(row) + " |")

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

    if args.png:
        drawn = cells
        said = " ".join([*([str(args.sweep_dir)] if args.sweep_dir else []), *(f"--archive {a}" for a in args.archive)])
        if args.png_settings:
            wanted = [w.strip() for w in args.png_settings.split(",") if w.strip()]
            unknown = [w for w in wanted if w not in cells]
            if unknown:
                ap.error(f"--png-settings: no cell of {', '.join(unknown)} (the cells hold {', '.join(sorted(cells))})")
            drawn = {w: cells[w] for w in wanted}
            said += f" --png-settings {','.join(wanted)}"
        draw(drawn, data, args.png, args.caption or f"python benchmarks/long_horizon.py {said} --png {args.png}")


if __name__ == "__main__":
    main()
