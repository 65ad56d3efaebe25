"""The floor of the ``portable`` CPU path: how much of a real run is the exact GEMM's float64 products.

``precision.cpu_bf16_gemm: portable`` (the default of the tiny presets, docs/cpu.md) sums every GEMM's
integer products in float64 (``fp8rl_core.cpu_numerics.portable_math._int_matmul``): that is what makes
the numbers the same on every x86-64 CPU, and no faster exact arithmetic gives the same integers on this
path (docs/cpu.md, "Where the portable step's time goes"). This script runs the real thing and times
those products as they happen, so the share any other change can still win is measured, not assumed:

* ``--what run``: ``fp8rl run`` of a preset (default ``tiny-cpu``: ``make run``'s campaign, its bootstrap
  taken from the cache or made first), in this process, with Prefect's temporary server as the command
  has it; then the run's stage seconds from its ledger;
* ``--what bootstrap``: ``--steps`` steps of the tiny policy's supervised bootstrap at its two threads.

For each it prints the wall time, the time inside the float64 products, and the time inside the grid and
output passes around them (``_levels`` and ``_finish``: the compiled kernels where they run). Both are
wall-clock sums taken around each call (a ``perf_counter`` pair per call: microseconds against
milliseconds), so they are what the run spent there at its own thread count. Take figures on an
otherwise idle machine. Not a test::

    python benchmarks/cpu_floor.py                      # make run's campaign
    python benchmarks/cpu_floor.py --what bootstrap --steps 30
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Clock:
    """Wall seconds and calls spent inside wrapped functions, by label (outermost call only)."""

    def __init__(self) -> None:
        self.seconds: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self._depth = 0

    def wrap(self, label: str, fn):
        @functools.wraps(fn)
        def timed(*a, **k):
            if self._depth:  # (a grid made inside a timed call is that call's time)
                return fn(*a, **k)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[label] += time.perf_counter() - t0
                self.calls[label] += 1
                self._depth -= 1

        return timed


def _instrument() -> Clock:
    """Time the portable path's products and grid passes in this process (the run's code is unchanged)."""
    from fp8rl_core.cpu_numerics import portable_math as pm

    clock = Clock()
    pm._int_matmul = clock.wrap("float64 products", pm._int_matmul)
    pm._levels = clock.wrap("grid and output passes", pm._levels)
    pm._finish = clock.wrap("grid and output passes", pm._finish)
    return clock


def _report(title: str, wall_s: float, clock: Clock) -> None:
    print(f"\n{title}: {wall_s:.1f} s wall")
    for label in ("float64 products", "grid and output passes"):
        s = clock.seconds[label]
        print(f"  {label:<24} {s:7.1f} s  {100 * s / wall_s:5.1f} %  ({clock.calls[label]:,} calls)")
    rest = wall_s - sum(clock.seconds.values())
    print(f"  {'everything else':<24} {rest:7.1f} s  {100 * rest / wall_s:5.1f} %")


def _run(preset: str, sets: list[str]) -> None:
    from flows import cli

    clock = _instrument()
    with tempfile.TemporaryDirectory(prefix="cpu-floor-") as tmp:
        run_dir = Path(tmp) / "run"
        args = ["run", preset, "--run-dir", str(run_dir)] + [x for s in sets for x in ("--set", s)]
        t0 = time.perf_counter()
        try:
            cli.main(args)
        except SystemExit as end:
            if end.code:
                raise
        wall = time.perf_counter() - t0
        stages = _stage_seconds(run_dir)
    _report(f"fp8rl run {preset} (this process, from the command's start to its end)", wall, clock)
    print("  the ledger's stage seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()))
    print(f"  outside every stage (start, server, reports, exit): {wall - sum(stages.values()):.1f} s")


def _stage_seconds(run_dir: Path) -> dict[str, float]:
    from storage.queries.catalog import connect, query

    sql = "SELECT stage, sum(seconds) AS s FROM ledger WHERE status = 'done' GROUP BY stage ORDER BY s DESC"
    return {r["stage"]: r["s"] for r in query(connect(run_dir), sql).to_pylist()}


def _bootstrap(steps: int) -> None:
    import random

    import torch

    from fp8rl_core.config.model import BootstrapConfig, ModelConfig, TaskConfig
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from fp8rl_core.tasks.tiny_model import build_tokenizer
    from stages.bootstrap.math import _batch, _sft_step, _threads, seeded_policy

    boot, task, model_cfg = BootstrapConfig(), TaskConfig(), ModelConfig()
    vocab = build_tokenizer().get_vocab()
    rng = random.Random(0)
    batches = [_batch(s, boot, task, 0.0, rng, vocab) for s in range(steps + 1)]
    with _threads(boot.threads), cpu_bf16_gemm("portable"), torch.autocast("cpu", dtype=torch.bfloat16):
        model, opt = seeded_policy(model_cfg, boot, len(vocab))
        _sft_step(model, opt, *batches[0], boot.lr)  # warm-up, untimed
        clock = _instrument()
        t0 = time.perf_counter()
        for ids, labels in batches[1:]:
            _sft_step(model, opt, ids, labels, boot.lr)
        wall = time.perf_counter() - t0
    _report(f"bootstrap SFT steps ({steps}, batch {boot.batch_size}, {torch.get_num_threads()} thread(s) "
            f"inside, {wall / steps:.3f} s a step)", wall, clock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("run", "bootstrap"), default="run")
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--steps", type=int, default=30, help="--what bootstrap")
    args = ap.parse_args()
    from fp8rl_core.host.cpu_env import pin_cpu_numerics
    from fp8rl_core.host.cpu_malloc import keep_freed_memory

    pin_cpu_numerics()  # as the fp8rl command does, before torch
    keep_freed_memory()
    if args.what == "bootstrap":
        return _bootstrap(args.steps)
    _run(args.preset, args.set)


if __name__ == "__main__":
    main()
