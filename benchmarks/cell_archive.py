"""A sweep's finished cells as a small text archive, so a comparison can gather cells run on different days.

A sweep's run folders are large (token tables, checkpoints) and live where the sweep ran; a seed
comparison needs only a few things of each cell: its per-step metrics and its evaluation outcomes.
``export`` writes one JSON line per finished cell to an archive (``benchmarks/results/<sweep>.jsonl``
by convention): the cell, its config hash, the commits it ran on and its numerics fingerprint
(from the cell's marker), its steps' metrics and every evaluation outcome. ``seed_comparison.py
--archive FILE`` reads such lines beside (or instead of) a live sweep directory.

Cells are bit-identical wherever they run (the same config, commit-independent numerics: the
fingerprint), so a cell exported again after a re-run must give the very same line content.
``export`` checks that: a cell already in the archive is compared field by field (all but where and
when it ran) and reported ``identical`` or ``DIFFERS``; a differing cell keeps its archived line
unless ``--replace``. This is the re-run check for reusing archived cells.

    python benchmarks/cell_archive.py export runs/sweeps/regime-seeds benchmarks/results/regime-seeds.jsonl
    python benchmarks/cell_archive.py list benchmarks/results/regime-seeds.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEP_COLUMNS = (
    "entropy_mean", "shadow", "lower_clip_share_neg_fp8", "lower_clip_share_neg_bf16", "overclipped_share",
    "clipfrac_lower", "clipfrac_upper", "lower_bound", "upper_bound", "reward_mean",
)  # fmt: skip
WHERE_AND_WHEN = ("commits", "uncommitted_changes", "seconds", "finished_at")  # not compared on re-export
ARCHIVE_PREFIX = "archive:"  # the run id an archived cell takes in a comparison


def numerics_of(marker: dict) -> str | None:
    """The cell's numerics fingerprint, computed from the parts its marker recorded by today's definition
    (``flows.sweep.runner.fingerprint_of``), so a marker written before that definition changed compares
    like a new one; the recorded hash where the marker holds no parts."""
    from flows.sweep.runner import fingerprint_of

    numerics = marker.get("numerics") or {}
    parts = {k: numerics[k] for k in ("cpu_numerics", "layer_precision", "versions") if k in numerics}
    return fingerprint_of(parts) if len(parts) == 3 else numerics.get("fingerprint")


def cell_line(sweep_dir: Path, cell: str, run: str, marker: dict) -> dict:
    """The archive line of ``cell`` (its run ``run``; ``marker``: its ``_cells`` marker)."""
    from storage.queries.catalog import connect, query

    con = connect(sweep_dir, runs=[run])
    cols = ", ".join(STEP_COLUMNS)
    steps = query(con, f"SELECT step, {cols} FROM steps WHERE variant = 'main' ORDER BY step").to_pydict()
    evals = query(
        con, "SELECT step, problem_id, sample_index, correct FROM evals WHERE variant = 'main' ORDER BY ALL"
    ).to_pylist()
    keys = sorted({f"{e['problem_id']}|{e['sample_index']}" for e in evals})
    index = {k: i for i, k in enumerate(keys)}
    outcomes: dict[str, list[str]] = {}
    for e in evals:
        row = outcomes.setdefault(str(e["step"]), ["-"] * len(keys))
        row[index[f"{e['problem_id']}|{e['sample_index']}"]] = "1" if e["correct"] else "0"
    return {
        "cell": cell,
        "labels": marker.get("labels"),
        "seed": marker.get("seed"),
        "config_hash": marker.get("config_hash"),
        "numerics": numerics_of(marker),
        "commits": marker.get("commits"),
        "uncommitted_changes": marker.get("uncommitted_changes"),
        "seconds": marker.get("seconds"),
        "finished_at": marker.get("finished_at"),
        "steps": steps,
        "eval_keys": keys,
        "eval_outcomes": {s: "".join(v) for s, v in outcomes.items()},
    }


def read_archive(path: Path) -> dict[str, dict]:
    """cell id -> archived line."""
    if not path.is_file():
        return {}
    lines = [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    return {ln["cell"]: ln for ln in lines}


def same_content(a: dict, b: dict) -> list[str]:
    """The fields in which two lines of one cell differ, where and when it ran aside."""
    return sorted(k for k in set(a) | set(b) if k not in WHERE_AND_WHEN and a.get(k) != b.get(k))


def export(sweep_dir: Path, archive: Path, replace: bool = False) -> int:
    """Add every finished cell of ``sweep_dir`` to ``archive``; returns the number that differ."""
    from benchmarks.seed_comparison import finished_cells

    have = read_archive(archive)
    differ = 0
    for setting, by_seed in sorted(finished_cells(sweep_dir).items()):
        for seed, run in sorted(by_seed.items()):
            cell = f"{setting}.s{seed}"
            marker = json.loads((sweep_dir / "_cells" / f"{cell}.json").read_text(encoding="utf-8"))
            line = cell_line(sweep_dir, cell, run, marker)
            old = have.get(cell)
            if old is None:
                print(f"{cell}: added")
            elif not (diff := same_content(old, line)):
                print(f"{cell}: identical to the archived line (commits {old.get('commits')} and {line['commits']})")
                continue
            else:
                differ += 1
                print(f"{cell}: DIFFERS from the archived line in {', '.join(diff)}"
                      + ("; replaced" if replace else "; the archived line is kept (--replace to take the new one)"))
                if not replace:
                    continue
            have[cell] = line
    archive.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(have[c], sort_keys=True) + "\n" for c in sorted(have))
    tmp = archive.with_name(archive.name + ".part")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(archive)
    return differ


def as_rows(line: dict) -> tuple[list[dict], list[dict]]:
    """An archived cell as the ``evals`` and ``steps`` rows ``seed_comparison.per_run`` reads."""
    run = ARCHIVE_PREFIX + line["cell"]
    evals = []
    for step, flags in line["eval_outcomes"].items():
        for key, flag in zip(line["eval_keys"], flags):
            if flag != "-":
                problem, sample = key.rsplit("|", 1)
                evals.append({"run_id": run, "step": int(step), "problem_id": problem,
                              "sample_index": int(sample), "correct": flag == "1"})
    cols = line["steps"]
    steps = [{"run_id": run, **{k: cols[k][i] for k in cols}} for i in range(len(cols["step"]))]
    return evals, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    ex = sub.add_parser("export", help="add a sweep's finished cells to an archive, checking re-runs")
    ex.add_argument("sweep_dir", type=Path)
    ex.add_argument("archive", type=Path)
    ex.add_argument("--replace", action="store_true", help="a cell that differs takes the new line")
    ls = sub.add_parser("list", help="the archived cells")
    ls.add_argument("archive", type=Path)
    args = ap.parse_args()
    if args.what == "export":
        if not (args.sweep_dir / "_cells").is_dir():
            ap.error(f"{args.sweep_dir}: not a sweep directory (no _cells/)")
        return 1 if export(args.sweep_dir, args.archive, args.replace) else 0
    for cell, line in sorted(read_archive(args.archive).items()):
        print(f"{cell}: config {line['config_hash'][:12]}, numerics {line['numerics']}, commits {line['commits']}, "
              f"{len(line['steps']['step'])} steps, evaluations at {', '.join(sorted(line['eval_outcomes'], key=int))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
