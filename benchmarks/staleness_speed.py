"""Steps per hour with the rollout side beside training (``rollout.max_staleness: 1``) against lockstep.

Runs one preset twice per round, side by side (lockstep, then k = 1 with its rollout side in
a worker process: ``stages/rollout_side.py``), each ``fp8rl run`` in a fresh directory, and
times the step loop from the ledger: from the first stage of step 1 to the end of the last
step (Prefect's start-up, the bootstrap and the step-0 evaluation left out). Prints each
run's seconds per step, where a step's time went (the stage seconds the ledger records),
and the ratio of steps per hour.

    python benchmarks/staleness_speed.py tiny-cpu --steps 8 --rounds 2
    python benchmarks/staleness_speed.py rehearsal-cpu --steps 4 --set rollout.engine=transformers

Run it on an otherwise idle machine: the two sides share its cores by design.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def loop_seconds(run_dir: Path) -> tuple[float, dict[str, float]]:
    """(wall seconds from the first stage of step 1 to the last record's end, stage seconds summed by stage)."""
    from storage.queries.catalog import connect, query

    con = connect(run_dir)
    span = query(
        con,
        "SELECT epoch(max(finished_at)) - epoch(min(started_at)) AS s FROM ledger WHERE step >= 1 AND status = 'done'",
    ).to_pylist()[0]["s"]
    by_stage = query(
        con, "SELECT stage, sum(seconds) AS s FROM ledger WHERE step >= 1 AND status = 'done' GROUP BY stage"
    ).to_pylist()
    return float(span), {r["stage"]: float(r["s"]) for r in by_stage}


def run_once(preset: str, steps: int, sets: list[str], lag: int, root: Path, tag: str) -> tuple[float, dict]:
    run_dir = root / f"{tag}-k{lag}"
    cmd = [sys.executable, "-m", "flows.cli", "run", preset, "--run-dir", str(run_dir), "--set", f"steps={steps}"]
    cmd += ["--set", f"rollout.max_staleness={lag}"]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return loop_seconds(run_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("preset", nargs="?", default="tiny-cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="lockstep / k=1 pairs, run alternately")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra config overrides")
    args = ap.parse_args()
    results: dict[int, list[float]] = {0: [], 1: []}
    stages: dict[int, dict[str, float]] = {0: {}, 1: {}}
    with tempfile.TemporaryDirectory(prefix="fp8rl-staleness-") as tmp:
        for i in range(args.rounds):
            for lag in (0, 1):
                span, by_stage = run_once(args.preset, args.steps, args.sets, lag, Path(tmp), f"r{i}")
                results[lag].append(span / args.steps)
                for k, v in by_stage.items():
                    stages[lag][k] = stages[lag].get(k, 0.0) + v / args.steps / args.rounds
                print(f"round {i} k={lag}: {span / args.steps:.2f} s/step", flush=True)
    for lag in (0, 1):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(stages[lag].items(), key=lambda kv: -kv[1]))
        print(f"k={lag}: median {statistics.median(results[lag]):.2f} s/step; stage seconds per step: {parts}")
    ratio = statistics.median(results[0]) / statistics.median(results[1])
    print(f"{args.preset}, {args.steps} steps x {args.rounds} rounds: steps per hour k=1 / lockstep = {ratio:.2f}x")


if __name__ == "__main__":
    main()
