"""Where a step's wall time goes: Prefect orchestration and storage writes vs compute.

Runs the tiny default campaign (shortened with ``--steps``) through the real
Prefect flow in this process, with timers around every Parquet write
(``TableWriter.write``), every ledger append and every checkpoint save, then
splits the wall time of the step loop into

* compute: time inside the stage functions, minus their storage writes;
* storage: Parquet writes + ledger appends + checkpoint saves;
* orchestration: the rest of the loop's wall time (Prefect task runs, states,
  artifacts, our own bookkeeping between stages).

Goal: orchestration + storage <= 10% of the step time.

With trackers configured (``--set 'trackers=[tensorboard, mlflow, wandb]'``)
it also reports the sinks' share: the tee on the campaign's
thread (turning rows into points and queueing them, inside the Parquet
writes' time, so subtracted from it), the wait for the sinks to flush at the
end, and the time each sink's own thread spent (concurrent with the steps;
on a small machine it competes for the same cores).

    python benchmarks/step_breakdown.py [--steps 8] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from flows.orchestration.env import configure_prefect_env

configure_prefect_env()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()

    import storage.checkpoints.store as ckpt_mod
    import storage.ledger.events as ledger_mod
    import storage.parts.writer as writer_mod
    from flows.campaign.configuration import dump_config, load_config
    from storage.queries.catalog import connect, query
    from storage.run.layout import create_run

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
    if cfg.trackers:
        import flows.report.trackers as trk

        trk.Trackers.on_write = timed("tracker_tee", trk.Trackers.on_write)
        trk.Trackers.close = timed("tracker_close", trk.Trackers.close)
        for sink in trk.SINKS.values():
            sink.open = timed(f"sink_{sink.name}_open", sink.open)
            sink.log = timed(f"sink_{sink.name}", sink.log)
    root = Path(tempfile.mkdtemp(prefix="fp8rl-breakdown-"))
    create_run(root, "bench", config=dump_config(cfg))
    run_dir = root / "bench"

    from flows.campaign.flow import campaign_flow
    from stages.context import base_model_dir

    base_model_dir(cfg, root)  # bootstrap (cached) outside the measured loop
    t0 = time.perf_counter()
    campaign_flow(str(run_dir))
    flow_wall = time.perf_counter() - t0

    led = query(
        connect(run_dir), "SELECT step, stage, seconds, started_at, finished_at FROM ledger ORDER BY started_at"
    ).to_pylist()
    loop_start = min(r["started_at"] for r in led)
    loop_end = max(r["finished_at"] for r in led)
    loop_wall = (loop_end - loop_start).total_seconds()
    stage_sum = sum(r["seconds"] for r in led)
    spent["parquet"] -= spent["tracker_tee"]  # the tee runs inside TableWriter.write
    storage = spent["parquet"] + spent["ledger"] + spent["checkpoint"]
    compute = stage_sum - spent["parquet"] - spent["checkpoint"] - spent["tracker_tee"]
    orchestration = loop_wall - stage_sum - spent["ledger"]  # ledger appends happen between stage timestamps
    by_stage = defaultdict(float)
    for r in led:
        by_stage[r["stage"]] += r["seconds"]

    print(
        f"tiny default, {cfg.steps} steps; flow wall {flow_wall:.1f} s (incl. engine/model set-up), step loop "
        f"{loop_wall:.1f} s"
    )
    print(f"{'part':<28}{'seconds':>10}{'share':>9}")
    for name, sec in [
        ("compute (stage functions)", compute),
        ("storage: parquet writes", spent["parquet"]),
        ("storage: ledger appends", spent["ledger"]),
        ("storage: checkpoints", spent["checkpoint"]),
        ("orchestration (Prefect+glue)", orchestration),
    ]:
        print(f"{name:<28}{sec:>10.2f}{100 * sec / loop_wall:>8.1f}%")
    overhead = storage + orchestration
    print(f"{'orchestration + storage':<28}{overhead:>10.2f}{100 * overhead / loop_wall:>8.1f}%   (goal <= 10%)")
    if cfg.trackers:
        tee, wait = spent["tracker_tee"], spent["tracker_close"]
        print(
            f"{'trackers: tee (in steps)':<28}{tee:>10.3f}{100 * tee / loop_wall:>8.2f}%   ({', '.join(cfg.trackers)})"
        )
        print(
            f"{'trackers: flush wait at end':<28}{wait:>10.3f}{100 * wait / loop_wall:>8.2f}%   (after the last step)"
        )
        for name in cfg.trackers:
            bg, op = spent[f"sink_{name}"], spent[f"sink_{name}_open"]
            print(
                f"  {name + ' thread':<26}{bg + op:>10.3f}{100 * (bg + op) / loop_wall:>8.2f}%   (background: "
                f"open {op:.2f} s + log {bg:.2f} s)"
            )
    print("stage seconds (incl. their writes): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_stage.items())))


if __name__ == "__main__":
    main()
