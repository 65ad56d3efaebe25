"""Where a step's wall time goes: Prefect orchestration and storage writes vs compute.

Runs the tiny default campaign (shortened with ``--steps``) through the real
Prefect flow in this process, with timers around every Parquet write
(``TableWriter.write``), every ledger append and every checkpoint save, then
splits the wall time of the step loop into

* compute: time inside the stage functions, minus their storage writes;
* storage: Parquet writes + ledger appends + checkpoint saves;
* orchestration: the rest of the loop's wall time (Prefect task runs, states,
  artifacts, our own bookkeeping between stages).

Goal (issue 7): orchestration + storage <= 10% of the step time.

    python benchmarks/step_breakdown.py [--steps 8] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from flows.prefect_env import configure_prefect_env

configure_prefect_env()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()

    import storage.checkpoints as ckpt_mod
    import storage.ledger as ledger_mod
    import storage.writer as writer_mod
    from flows.configuration import dump_config, load_config
    from storage.catalog import connect, query
    from storage.layout import create_run

    spent: dict[str, float] = defaultdict(float)

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
        return wrapper

    writer_mod.TableWriter.write = timed("parquet", writer_mod.TableWriter.write)
    ledger_mod.Ledger._append = timed("ledger", ledger_mod.Ledger._append)
    ckpt_mod.save_checkpoint = timed("checkpoint", ckpt_mod.save_checkpoint)
    import stages.checkpoint as stage_ckpt

    stage_ckpt.save_checkpoint = ckpt_mod.save_checkpoint

    cfg = load_config("tiny-cpu", [f"steps={args.steps}", *args.overrides])
    root = Path(tempfile.mkdtemp(prefix="fp8rl-breakdown-"))
    create_run(root, "bench", config=dump_config(cfg))
    run_dir = root / "bench"

    from flows.campaign import campaign_flow
    from stages.context import base_model_dir

    base_model_dir(cfg, root)  # bootstrap (cached) outside the measured loop
    t0 = time.perf_counter()
    campaign_flow(str(run_dir))
    flow_wall = time.perf_counter() - t0

    led = query(connect(run_dir), "SELECT step, stage, seconds, started_at, finished_at FROM ledger ORDER BY started_at").to_pylist()
    loop_start = min(r["started_at"] for r in led)
    loop_end = max(r["finished_at"] for r in led)
    loop_wall = (loop_end - loop_start).total_seconds()
    stage_sum = sum(r["seconds"] for r in led)
    storage = spent["parquet"] + spent["ledger"] + spent["checkpoint"]
    compute = stage_sum - spent["parquet"] - spent["checkpoint"]
    orchestration = loop_wall - stage_sum - spent["ledger"]  # ledger appends happen between stage timestamps
    by_stage = defaultdict(float)
    for r in led:
        by_stage[r["stage"]] += r["seconds"]

    print(f"tiny default, {cfg.steps} steps; flow wall {flow_wall:.1f} s (incl. engine/model set-up), step loop {loop_wall:.1f} s")
    print(f"{'part':<28}{'seconds':>10}{'share':>9}")
    for name, sec in [("compute (stage functions)", compute), ("storage: parquet writes", spent["parquet"]),
                      ("storage: ledger appends", spent["ledger"]), ("storage: checkpoints", spent["checkpoint"]),
                      ("orchestration (Prefect+glue)", orchestration)]:
        print(f"{name:<28}{sec:>10.2f}{100 * sec / loop_wall:>8.1f}%")
    overhead = storage + orchestration
    print(f"{'orchestration + storage':<28}{overhead:>10.2f}{100 * overhead / loop_wall:>8.1f}%   (goal <= 10%)")
    print("stage seconds (incl. their writes): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_stage.items())))


if __name__ == "__main__":
    main()
