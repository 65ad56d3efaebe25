"""The shipped LeetCode reference solutions against their own tests and a neighbour's, in the sandbox.

For each split (``leetcode`` = test, ``leetcode_train`` = train): how many reference
solutions pass every case of their own problem, and how many pass every case of a
neighbouring problem (the next one with another entry point; must be 0). Also checks
that every Codeforces test set parses. Needs the data folder (``FP8RL_DATA_DIR``).

    FP8RL_DATA_DIR=/path/to/data python benchmarks/code_references.py [--limit N] [--splits test,train]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.data.benchmarks import DATA_FOLDER, resolve_data_dir  # noqa: E402
from stages.data.code_benchmarks import load_code_benchmark  # noqa: E402
from stages.grade.code import CodeGradingConfig, grade_code_batch  # noqa: E402
from stages.grade.code_tests import parse_tests  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=None, help="first N problems of each split")
    ap.add_argument("--sandboxes", type=int, default=2)
    ap.add_argument("--splits", default="test,train")
    args = ap.parse_args()
    root = resolve_data_dir(None)
    if root is None:
        print(f"no data folder: set FP8RL_DATA_DIR to {DATA_FOLDER}", file=sys.stderr)
        sys.exit(2)
    cfg = CodeGradingConfig(max_sandboxes=args.sandboxes, batch_wall_s=1e9)  # a measurement, not a step: no deadline
    for split, name in (("test", "leetcode_test.json"), ("train", "leetcode_train.json")):
        if split not in args.splits.split(","):
            continue
        items = json.loads((root / "code_rl_rllm" / name).read_text())[: args.limit]
        tests = [parse_tests(x["tests"]) for x in items]
        entry = [t.candidate for t in tests]
        nb = [
            next((j % len(items) for j in range(i + 1, i + len(items)) if entry[j % len(items)] != entry[i]), i)
            for i in range(len(items))
        ]
        ids, sols = [str(i) for i in range(len(items))], [x["solutions"] for x in items]
        t0 = time.monotonic()
        own = grade_code_batch(ids, sols, tests, cfg)
        neigh = grade_code_batch(ids, sols, [tests[j] for j in nb], cfg)
        failed = [int(g.id) for g in own if not g.correct]
        print(
            f"{split}: own tests {sum(g.correct for g in own)}/{len(items)}; neighbour's tests "
            f"{sum(g.correct for g in neigh)}/{len(items)} ({time.monotonic() - t0:.0f} s); own failures: {failed}"
        )
    cf = load_code_benchmark("codeforces", root)
    print(
        f"codeforces: {len(cf)} problems parsed, {cf.report.n_skipped} skipped, "
        f"{sum(1 for p in cf if json.loads(p.answer).get('any_case'))} accept any letter case"
    )


if __name__ == "__main__":
    main()
