"""Probability NMAE, ratio NMAE and their quotient per low-precision format.

Question answered: how much noise does each training format put into π_θ and into
the importance ratios, relative to the BF16 shadow pass, on real RL steps — and
is the ratio-noise amplification (ratio NMAE / probability NMAE) in the paper's
1.7x-2.9x range for FP8, and where is FP4? Also the lower-clip share of
negative-advantage tokens against BF16's and the over-clipped share.

Every format starts from the same bootstrapped policy and runs ``--steps`` RL
steps of the preset with a shadow pass on every step (calibration interval 1,
standard clipping, so the bounds do not differ between formats); numbers are
means over those steps. Each step is one row of the ``steps`` table, the same
columns ``fp8rl report`` reads.

    python benchmarks/low_precision_noise.py [--preset stress-cpu] [--steps 3] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

FORMATS = {
    "fp8_tensorwise": ("fp8_tensorwise", "fp8_per_tensor"),
    "fp8_blockwise": ("fp8_blockwise", "fp8_per_block"),
    "nvfp4": ("nvfp4", "nvfp4_w4a4"),
    "mxfp4": ("mxfp4", "mxfp4_w4a4"),
    "nvfp4+fp8-rollout": ("nvfp4", "fp8_per_tensor"),
}
COLUMNS = ("prob_nmae", "ratio_nmae", "lower_clip_share_neg_fp8", "lower_clip_share_neg_bf16", "overclipped_share")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", action="append", default=[], help="format name (repeatable); default all")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()

    from flows.campaign.configuration import dump_config, load_config
    from flows.orchestration.env import quiet_third_party

    quiet_third_party()
    from stages.calibrate import run_calibrate
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run

    root = Path(tempfile.mkdtemp(prefix="fp8rl-lpnoise-"))
    print(f"preset {args.preset}, {args.steps} steps per format, shadow pass every step; means over steps")
    print(
        f"{'format':<20}{'prob NMAE':>11}{'ratio NMAE':>12}{'ratio/prob':>11}{'A<0 clip vs BF16':>18}"
        f"{'over-clip %':>12}{'acc':>7}{'s/step':>8}",
        flush=True,
    )
    for name, (train, rollout) in FORMATS.items():
        if args.only and name not in args.only:
            continue
        cfg = load_config(
            args.preset,
            [
                f"precision.train={train}",
                f"precision.rollout={rollout}",
                "calibration.interval=1",
                "calibration.mode=standard",
                f"steps={args.steps}",
                *args.overrides,
            ],
        )
        create_run(root, name.replace("+", "-"), config=dump_config(cfg))
        ctx = open_run(cfg, root / name.replace("+", "-"))
        rows = []
        t0 = time.perf_counter()
        try:
            for step in range(1, args.steps + 1):
                run_rollout(ctx, step)
                run_score(ctx, step)
                rows.append(run_train(ctx, step)["metrics"])
                run_calibrate(ctx, step)
        finally:
            ctx.close()
        per_step = (time.perf_counter() - t0) / args.steps
        mean = {c: statistics.fmean(r[c] for r in rows) for c in COLUMNS}
        amp = mean["ratio_nmae"] / mean["prob_nmae"] if mean["prob_nmae"] else float("nan")
        clip = (
            mean["lower_clip_share_neg_fp8"] / mean["lower_clip_share_neg_bf16"]
            if mean["lower_clip_share_neg_bf16"]
            else float("nan")
        )
        acc = statistics.fmean(r["accuracy"] for r in rows)
        print(
            f"{name:<20}{mean['prob_nmae']:>11.4f}{mean['ratio_nmae']:>12.4f}{amp:>10.2f}x{clip:>17.2f}x"
            f"{100 * mean['overclipped_share']:>12.2f}{acc:>7.3f}{per_step:>8.1f}",
            flush=True,
        )
    print("paper (Chen et al. 2026), FP8: ratio NMAE = 1.7x-2.9x probability NMAE")


if __name__ == "__main__":
    main()
