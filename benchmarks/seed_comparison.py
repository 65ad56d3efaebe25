"""Paired comparison of a seed sweep's cells: second-half accuracy, clip shares, entropy surges.

Question answered: across the seeds of ``configs/sweeps/stress-seeds.yaml`` (or any sweep whose
cells are ``<precision>.<clip>.s<seed>``), does FP8 with standard clipping fall below BF16, and
does Calibrated Clipping close the gap, by more than seed-to-seed noise?

Per finished cell (its ``_cells/<cell>.json`` marker): **second-half eval** = the mean of the
evaluation accuracies at steps >= half the campaign (the evaluations of steps 100-200 in a
200-step cell); the mean A<0 lower-clip share in FP8 and under BF16's bounds on shadow steps
and their quotient; the over-clipped share; every entropy surge (``fp8rl_core.signals.failure_signals``,
the campaign's own surge rule). Per pair of settings, over the seeds both finished:

* across seeds: mean difference of second-half eval (points), a 95% percentile bootstrap
  interval, the exact two-sided sign-flip p-value (``fp8rl_core.signals.paired_stats``);
* per evaluation problem: pairs (seed, step, problem) judged in both cells in the second half,
  how many only A got right / only B, and the exact McNemar p-value (pairs within a seed share
  a policy: a lower bound on the true p).

    python benchmarks/seed_comparison.py runs/sweeps/stress-seeds [--baseline bf16.standard]
    python benchmarks/seed_comparison.py [SWEEP_DIR] --archive benchmarks/results/regime-seeds.jsonl

``--archive``: cells archived by ``benchmarks/cell_archive.py`` (run on other days or machines) join
the sweep directory's own.

Its last line is the calibrated cell's mean gap to the baseline and its sign-flip p-value.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CELL = re.compile(r"^(?P<setting>.+)\.s(?P<seed>\d+)$")

from benchmarks.cell_archive import ARCHIVE_PREFIX, as_rows, read_archive, same_content  # noqa: E402


def finished_cells(sweep_dir: Path) -> dict[str, dict[int, str]]:
    """setting -> {seed: run id} of the cells with a finished marker (a pilot's cells left out: their
    seeds are the pilot's own, paired with nothing). A twin (a cell whose config another cell ran,
    marker ``same_as``) reads that cell's run."""
    out: dict[str, dict[int, str]] = defaultdict(dict)
    for marker in sorted((sweep_dir / "_cells").glob("*.json")):
        m = CELL.match(marker.stem)
        if not m or m["setting"].startswith("pilot-"):
            continue
        run = marker.stem if (sweep_dir / marker.stem).is_dir() else json.loads(marker.read_text()).get("same_as")
        if run and (sweep_dir / run).is_dir():
            out[m["setting"]][int(m["seed"])] = run
    return dict(out)


def archived_cells(archives: list[Path], live: dict[str, dict[int, str]]) -> dict[str, dict]:
    """cell id -> archived line, for the cells of ``archives`` that ``live`` (a sweep directory's
    finished cells) does not have; a cell in two archives must be the same in both."""
    out: dict[str, dict] = {}
    for path in archives:
        if not path.is_file():
            raise SystemExit(f"seed_comparison: {path}: no such archive")
        for cell, line in read_archive(path).items():
            m = CELL.match(cell)
            if not m or m["setting"].startswith("pilot-") or int(m["seed"]) in live.get(m["setting"], {}):
                continue
            if cell in out and same_content(out[cell], line):
                raise SystemExit(f"seed_comparison: {cell} differs between archives ({path})")
            out[cell] = line
    return out


def load(sweep_dir: Path, runs: list[str]):
    """Evaluation outcomes and step metrics of ``runs`` through the catalog (DuckDB)."""
    from storage.queries.catalog import connect, query

    con = connect(sweep_dir, runs=runs)
    evals = query(
        con,
        "SELECT run_id, step, problem_id, sample_index, correct FROM evals "
        "WHERE variant = 'main' ORDER BY run_id, step, problem_id, sample_index",
    ).to_pylist()
    steps = query(
        con,
        "SELECT run_id, step, entropy_mean, shadow, lower_clip_share_neg_fp8, lower_clip_share_neg_bf16, "
        "overclipped_share FROM steps WHERE variant = 'main' ORDER BY run_id, step",
    ).to_pylist()
    return evals, steps


def per_run(evals: list[dict], steps: list[dict]) -> dict[str, dict]:
    """run id -> second-half eval, outcomes by (step, problem, sample), clip shares, surges."""
    from flows.sweep.choice import second_half
    from fp8rl_core.signals.failure_signals import surge_onsets

    out: dict[str, dict] = defaultdict(lambda: {"outcomes": {}, "acc": defaultdict(list), "steps": []})
    for e in evals:
        r = out[e["run_id"]]
        r["outcomes"][(e["step"], e["problem_id"], e["sample_index"])] = bool(e["correct"])
        r["acc"][e["step"]].append(float(e["correct"]))
    for s in steps:
        out[s["run_id"]]["steps"].append(s)
    for r in out.values():
        r["half_step"] = (max(r["acc"]) if r["acc"] else 0) / 2
        half = second_half({k: statistics.fmean(v) for k, v in r["acc"].items()})  # the pilot rule's measure
        r["second_half"] = float("nan") if half is None else half
        shadow = [s for s in r["steps"] if s["shadow"] and s["lower_clip_share_neg_fp8"] is not None]
        mean = lambda k: statistics.fmean(s[k] for s in shadow) if shadow else float("nan")  # noqa: E731
        r["clip_fp8"], r["clip_bf16"], r["over"] = (
            mean(k) for k in ("lower_clip_share_neg_fp8", "lower_clip_share_neg_bf16", "overclipped_share")
        )
        ent = [s["entropy_mean"] for s in r["steps"]]
        r["surges"] = [int(r["steps"][i]["step"]) for i in surge_onsets(ent)] if len(ent) > 10 else []
    return out


def compare(a: dict[int, str], b: dict[int, str], runs: dict[str, dict]) -> dict:
    """Paired statistics of setting A - setting B over their common seeds."""
    from fp8rl_core.signals.paired_stats import bootstrap_mean_ci, mcnemar_exact_p, sign_flip_p

    seeds = sorted(set(a) & set(b))
    diffs = [runs[a[s]]["second_half"] - runs[b[s]]["second_half"] for s in seeds]
    only_a = only_b = both = 0
    for s in seeds:
        ra, rb = runs[a[s]], runs[b[s]]
        for key, ok_a in ra["outcomes"].items():
            ok_b = rb["outcomes"].get(key)
            if ok_b is None or key[0] < ra["half_step"]:
                continue
            both += 1
            only_a += ok_a and not ok_b
            only_b += ok_b and not ok_a
    lo, hi = bootstrap_mean_ci(diffs) if len(diffs) > 1 else (float("nan"), float("nan"))
    return {
        "seeds": len(seeds),
        "mean": statistics.fmean(diffs) if diffs else float("nan"),
        "lo": lo,
        "hi": hi,
        "p": sign_flip_p(diffs) if diffs else float("nan"),
        "pairs": both,
        "only_a": only_a,
        "only_b": only_b,
        "p_problem": mcnemar_exact_p(only_a, only_b),
        "diffs": diffs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep_dir", type=Path, nargs="?", help="a sweep directory (optional with --archive)")
    ap.add_argument("--baseline", default="bf16.standard")
    ap.add_argument(
        "--archive", type=Path, action="append", default=[],
        help="cells archived by benchmarks/cell_archive.py (repeatable); the sweep directory's own cells win",
    )  # fmt: skip
    args = ap.parse_args()
    cells = finished_cells(args.sweep_dir) if args.sweep_dir and (args.sweep_dir / "_cells").is_dir() else {}
    archived = archived_cells(args.archive, cells)
    for cell in archived:
        m = CELL.match(cell)
        cells.setdefault(m["setting"], {})[int(m["seed"])] = ARCHIVE_PREFIX + cell
    if not cells:
        ap.error(f"{args.sweep_dir}: no finished cells (no _cells/<cell>.json markers, nothing archived)")
    live = sorted({r for by_seed in cells.values() for r in by_seed.values() if not r.startswith(ARCHIVE_PREFIX)})
    # a setting whose every seed reads another setting's runs (twins: the same configs) is that setting
    first = {x: next(y for y in sorted(cells) if cells[y] == cells[x]) for x in cells}
    same = {x: y for x, y in first.items() if y != x}
    evals, steps = load(args.sweep_dir, live) if live else ([], [])
    for line in archived.values():
        e, s = as_rows(line)
        evals += e
        steps += s
    runs = per_run(evals, steps)
    print("| setting | seeds | 2nd-half eval % (mean, min-max) | A<0 lower-clip FP8 ÷ BF16 | over-clipped % | surges |")
    print("|---|---:|---:|---:|---:|---|")
    for setting, by_seed in sorted(cells.items()):
        rs = [runs[r] for r in by_seed.values()]
        acc = [r["second_half"] for r in rs]
        quot = [r["clip_fp8"] / r["clip_bf16"] for r in rs if r["clip_bf16"]]
        surges = ", ".join(f"s{s}@{x}" for s, r in sorted(by_seed.items()) for x in runs[r]["surges"]) or "none"
        label = f"{setting} (the runs of {same[setting]})" if setting in same else setting
        print(
            f"| {label} | {len(rs)} | {statistics.fmean(acc):.1f} ({min(acc):.1f}-{max(acc):.1f}) | "
            f"{statistics.fmean(quot) if quot else float('nan'):.2f} | "
            f"{100 * statistics.fmean(r['over'] for r in rs):.3f} | {surges} |"
        )
    print()
    print(
        "| A - B | seeds | mean diff (pts) | 95% bootstrap CI | sign-flip p | problem pairs | A only / B only "
        "| McNemar p |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    names = sorted(x for x in cells if x not in same)
    pairs = [(x, args.baseline) for x in names if x != args.baseline and args.baseline in cells]
    pairs += [(x, y) for i, x in enumerate(names) for y in names[i + 1 :] if args.baseline not in (x, y)]
    results = {}
    for x, y in pairs:
        c = results[(x, y)] = compare(cells[x], cells[y], runs)
        print(
            f"| {x} - {y} | {c['seeds']} | {c['mean']:+.2f} | [{c['lo']:+.2f}, {c['hi']:+.2f}] | {c['p']:.3f} | "
            f"{c['pairs']} | {c['only_a']} / {c['only_b']} | {c['p_problem']:.3g} |"
        )
    key = next(((x, y) for x, y in results if x.endswith("calibrated") and y == args.baseline), None)
    if key:
        c = results[key]
        print(f"{key[0]} - {key[1]}: {c['mean']:+.2f} points over {c['seeds']} seeds, sign-flip p {c['p']:.3f}")


if __name__ == "__main__":
    main()
