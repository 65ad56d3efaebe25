"""Sandboxed executions per second of a trivial program, against a bare subprocess.

Both sides run the same program (``print(sum(map(int, input().split())))`` on
``"1 2"``) with the same interpreter, stdin from a file and stdout/stderr
captured, ``--parallel`` at a time, interleaved in rounds so machine load hits
both alike. Bare = ``subprocess.run([python, -I, -S, prog.py])``; sandboxed =
``stages.sandbox.Sandbox.run`` (namespaces, throw-away uid, rlimits, tmpfs,
cleanup). Prints both rates and their ratio (goal: >= 0.5).

    python benchmarks/sandbox_throughput.py [--n 200] [--parallel 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.sandbox import Sandbox, SandboxLimits, sandbox_python  # noqa: E402

PROGRAM = "print(sum(map(int, input().split())))\n"


def bare(py: str, prog: Path, stdin: Path) -> bool:
    with open(stdin, "rb") as f:
        r = subprocess.run([py, "-I", "-S", str(prog)], stdin=f, capture_output=True, timeout=10)
    return r.stdout.strip() == b"3"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="executions per side per round")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sb = Sandbox(SandboxLimits(wall_s=10))
    py = sandbox_python()
    d = Path(tempfile.mkdtemp(prefix="fp8rl-bench-"))
    prog, stdin = d / "prog.py", d / "in"
    prog.write_text(PROGRAM)
    stdin.write_text("1 2\n")
    print(f"isolation: {sb.isolation} ({sb.isolation_reason}); interpreter {py}; cpus {os.cpu_count()}; "
          f"{args.n} runs x {args.rounds} rounds per side, {args.parallel} at a time")
    totals = {"bare": 0.0, "sandbox": 0.0}
    with ThreadPoolExecutor(args.parallel) as pool:
        for rnd in range(args.rounds):
            for side in ("bare", "sandbox"):
                t0 = time.perf_counter()
                if side == "bare":
                    ok = list(pool.map(lambda _: bare(py, prog, stdin), range(args.n)))
                else:
                    ok = list(pool.map(lambda _: sb.run(PROGRAM, "1 2\n").stdout.strip() == "3", range(args.n)))
                dt = time.perf_counter() - t0
                assert all(ok), f"{side}: {ok.count(False)} wrong outputs"
                totals[side] += dt
                print(f"round {rnd} {side:8s} {args.n / dt:7.1f} exec/s")
    rb = args.n * args.rounds / totals["bare"]
    rs = args.n * args.rounds / totals["sandbox"]
    print(f"bare subprocess: {rb:.1f} exec/s; sandboxed: {rs:.1f} exec/s; ratio sandboxed/bare = {rs / rb:.2f} (goal >= 0.5)")
    for p in (prog, stdin):
        p.unlink()
    d.rmdir()


if __name__ == "__main__":
    main()
