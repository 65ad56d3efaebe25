"""Shadow passes' share of campaign time: fixed K = 20, drift, subsampled.

Measured side by side in one process on one batch of the tiny campaign: per
repetition, interleaved, one rollout + score and three train steps -- without
shadow passes, with full BF16 shadow passes, and with shadow passes on the
subset of sequences ``fp8rl_core.calibration.subsample.choose_size`` picks for the target
error. A schedule's shadow share of campaign time is then

    share = n_shadow * shadow_s / (T * step_s + n_shadow * shadow_s)

with ``step_s`` the step without shadow (rollout + score + train) and
``n_shadow / T`` the schedule's shadow steps per step: 1/20 for fixed K = 20
and for subsampled (K = 20, subset shadow_s), and the drift schedule's count
from a replay of a diagnostic run (``--diag RUN_DIR``, see
``benchmarks/schedule_replay.py``; omitted without one).

    python benchmarks/shadow_cost.py [--reps 3] [--target 0.3] [--diag RUN_DIR] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--target", type=float, default=0.3, help="subsampled shadow: target level error E")
    ap.add_argument("--diag", type=Path, default=None, help="diagnostic run (shadow every step) to replay drift on")
    ap.add_argument("--threshold", type=float, default=0.1, help="drift threshold for the replay")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override key=value (repeatable)")
    args = ap.parse_args()

    import torch

    from flows.campaign.configuration import dump_config, load_config
    from fp8rl_core.calibration.subsample import choose_size, sample_sequences
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.runtime.io import read_step
    from stages.score import run_score
    from stages.train import build_batch
    from stages.trainer.update import UpdateSpec, policy_update
    from storage.run.layout import create_run

    cfg = load_config("tiny-cpu", args.sets)
    tmp = Path(tempfile.mkdtemp(prefix="shadow-cost-"))
    create_run(tmp, "r", config=dump_config(cfg))
    env, state = open_run(cfg, tmp / "r")
    base, full, sub, m_used = [], [], [], 0
    try:
        for rep in range(args.reps):
            step = rep + 1
            t0 = time.perf_counter()
            _, state = run_rollout(env, state, step)
            _, state = run_score(env, state, step)
            gen_s = time.perf_counter() - t0
            batch = build_batch(
                read_step(env, "rollouts", step), read_step(env, "scores", step), env.tokenizer.pad_token_id
            )
            neg = ((batch.advantages < 0)[:, None] & (batch.response_mask > 0)).sum(1)
            m_used = choose_size(
                neg, args.target, cfg.calibration.shadow_failure_prob, cfg.calibration.shadow_min_sequences
            )
            keep = sample_sequences(batch.size, m_used, torch.Generator().manual_seed(step))
            for kind in ("none", "full", "sub"):
                t0 = time.perf_counter()
                res = policy_update(
                    state.policy,
                    state.optimizer,
                    state.scheduler,
                    batch,
                    cfg,
                    UpdateSpec(
                        bounds=state.calibrator.bounds,
                        shadow=kind != "none",
                        seed=step,
                        shadow_rows=keep if kind == "sub" else None,
                    ),
                )
                train_s = time.perf_counter() - t0
                shadow_s = res.timings.get("shadow_s", 0.0)
                if kind == "none":
                    base.append(gen_s + train_s)
                else:
                    (full if kind == "full" else sub).append(shadow_s)
    finally:
        env.close()
    step_s, full_s, sub_s = statistics.median(base), statistics.median(full), statistics.median(sub)
    n = batch.size
    print(
        f"tiny-cpu batch: {n} sequences; subsampled shadow on m = {m_used} (target level error {args.target}); "
        f"{args.reps} interleaved repetitions, medians"
    )
    print(
        f"step without shadow {step_s:.2f} s | full shadow passes {full_s:.3f} s | subsampled {sub_s:.3f} s "
        f"(x{sub_s / full_s:.2f} of full)"
    )

    def share(per_step: float, cost: float) -> float:
        return per_step * cost / (step_s + per_step * cost)

    rows = [("fixed K=20 (paper)", 1 / 20, full_s), ("subsampled, K=20", 1 / 20, sub_s)]
    if args.diag is not None:
        from benchmarks.schedule_replay import load_records
        from fp8rl_core.calibration.drift import Schedule, replay

        recs, _, dcfg = load_records(args.diag)
        a = dcfg.algorithm
        r = replay(
            recs,
            Schedule("drift", threshold=args.threshold, min_interval=2, max_interval=20),
            eps_low=a.eps_low,
            eps_high=a.eps_high,
            config=dcfg.calibration,
            dual_clip=a.dual_clip,
        )
        rows.insert(
            1,
            (f"drift D>{args.threshold:g} ({r.shadow_passes}/{len(recs)} steps)", r.shadow_passes / len(recs), full_s),
        )
    rows.append(("every step (K=1)", 1.0, full_s))
    for name, per, cost in rows:
        print(f"  {name:<34} shadow share of campaign time {100 * share(per, cost):6.2f}%")


if __name__ == "__main__":
    main()
