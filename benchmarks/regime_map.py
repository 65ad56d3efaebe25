"""Where FP8 noise over-clips: the noise of short runs of the tiny default, lever by lever.

Each setting runs steps 1..S of a preset (the tiny default unless named) with
standard clipping and the BF16 shadow passes on every step, in one process (the rollout,
score and train stages, no Prefect), and reports, over the S steps' tokens:

* probability NMAE and ratio NMAE (``fp8rl_core.signals.diagnostics.noise_amplification``)
  and their quotient (the paper: 1.7-2.9x);
* the A<0 lower-clip share of FP8 (r8 < L) over BF16's (r16 < L) on the same tokens: the
  over-clipping the method exists to remove (a failure regime: >= 1.3x);
* the over-clipped share of valid tokens (clipped by FP8, not by BF16; a regime: >= 0.1 %).

The levers are in :data:`SETTINGS` (how π_old is batched, sampling, the FP8 recipe). Noise,
not accuracy: a few steps are enough. Figures, not a test:

    python benchmarks/regime_map.py [--steps 3] [--only NAME ...] [--set KEY=VALUE ...] [--json PATH]

The CPU numerics are pinned as ``fp8rl run`` pins them (before torch is imported), so the
figures are what a campaign of the same settings computes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TENSORWISE = ["precision.train=fp8_tensorwise", "precision.rollout=fp8_per_tensor"]
APART = "algorithm.old_logp_micro_batch_size=256"
# name -> (preset, overrides); the tiny default unless named
SETTINGS: dict[str, tuple[str, list[str]]] = {
    "tensorwise, pi_old on the training micro-batches (default)": ("tiny-cpu", TENSORWISE),
    "tensorwise, pi_old apart, 256 rows": ("tiny-cpu", [*TENSORWISE, APART]),
    "tensorwise, pi_old apart, 128 rows": ("tiny-cpu", [*TENSORWISE, "algorithm.old_logp_micro_batch_size=128"]),
    "tensorwise, pi_old apart, 64 rows": ("tiny-cpu", [*TENSORWISE, "algorithm.old_logp_micro_batch_size=64"]),
    "tensorwise, default batching, top-p 0.8": ("tiny-cpu", [*TENSORWISE, "rollout.top_p=0.8"]),
    "tensorwise, pi_old apart 256, top-p 0.8": ("tiny-cpu", [*TENSORWISE, APART, "rollout.top_p=0.8"]),
    "tensorwise, default batching, eps_low 0.02": ("tiny-cpu", [*TENSORWISE, "algorithm.eps_low=0.02"]),
    "tensorwise, pi_old apart 256, eps_low 0.02": ("tiny-cpu", [*TENSORWISE, APART, "algorithm.eps_low=0.02"]),
    "tensorwise, pi_old apart 256, lr 1e-3": ("tiny-cpu", [*TENSORWISE, APART, "algorithm.lr=1.0e-3"]),
    "rowwise, pi_old apart, 256 rows": ("tiny-cpu", ["precision.train=fp8_rowwise", "precision.rollout=fp8_per_tensor",
                                                      APART]),
    "blockwise, pi_old apart, 256 rows": ("tiny-cpu", ["precision.train=fp8_blockwise",
                                                        "precision.rollout=fp8_per_block", APART]),
    "the regime preset (configs/regime-tiny-cpu.yaml)": ("regime-tiny-cpu", []),
    "the regime preset, default batching": ("regime-tiny-cpu", ["algorithm.old_logp_micro_batch_size=null"]),
    "tensorwise, default batching, 4 outlier channels x 2^14": ("tiny-cpu", [*TENSORWISE, "model.outliers.channels=4"]),
    "tensorwise, default batching, 4 outlier channels x 2^16": (
        "tiny-cpu",
        [*TENSORWISE, "model.outliers.channels=4", "model.outliers.log2_scale=16"],
    ),
    "the regime preset, 4 outlier channels x 2^14": ("regime-tiny-cpu", ["model.outliers.channels=4"]),
    "the regime preset, 4 outlier channels x 2^16": (
        "regime-tiny-cpu",
        ["model.outliers.channels=4", "model.outliers.log2_scale=16"],
    ),
    "the regime preset, responses up to 24 tokens": ("regime-tiny-cpu", ["rollout.max_new_tokens=24"]),
    "the regime preset, 4 layers (deeper)": ("regime-tiny-cpu", ["model.num_layers=4"]),
    "the regime preset, hidden 256 (wider)": (
        "regime-tiny-cpu",
        ["model.hidden_size=256", "model.intermediate_size=768"],
    ),
}
COMMON = ["calibration.mode=standard", "calibration.interval=1"]


def measure(preset: str, overrides: list[str], steps: int, root: Path, name: str) -> dict[str, float]:
    """Run steps 1..``steps`` of ``preset`` with ``overrides`` (standard clipping, shadow passes every
    step); the noise over their tokens."""
    import torch

    from flows.campaign.configuration import dump_config, load_config
    from fp8rl_core.objective.losses import importance_ratio
    from fp8rl_core.signals.diagnostics import noise_amplification, over_clipped_mask
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.runtime.io import read_step
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run

    cfg = load_config(preset, [*COMMON, f"steps={steps}", *overrides])
    create_run(root, name, config=dump_config(cfg))
    env, state = open_run(cfg, root / name)
    try:
        for step in range(1, steps + 1):
            for stage in (run_rollout, run_score, run_train):
                _, state = stage(env, state, step)
        cols = {c: [] for c in ("logp_fp8", "old_logp_fp8", "logp_bf16", "old_logp_bf16", "advantage")}
        for step in range(1, steps + 1):
            t = read_step(env, "token_stats", step)
            for c in cols:
                cols[c].append(t.column(c).to_numpy(zero_copy_only=False).astype(np.float32))
    finally:
        env.close()
    x = {c: torch.from_numpy(np.concatenate(v)) for c, v in cols.items()}
    mask = torch.isfinite(x["logp_bf16"]) & torch.isfinite(x["old_logp_bf16"])
    amp = noise_amplification(x["logp_fp8"], x["logp_bf16"], x["old_logp_fp8"], x["old_logp_bf16"], mask)
    r8, r16 = importance_ratio(x["logp_fp8"], x["old_logp_fp8"]), importance_ratio(x["logp_bf16"], x["old_logp_bf16"])
    lower = 1.0 - cfg.algorithm.eps_low
    neg = mask & (x["advantage"] < 0)
    fp8_low, bf16_low = float((neg & (r8 < lower)).sum()), float((neg & (r16 < lower)).sum())
    over = over_clipped_mask(r8, r16, x["advantage"], mask, eps_low=cfg.algorithm.eps_low, lower=lower)
    return {
        "prob_nmae": float(amp["prob_nmae"]),
        "ratio_nmae": float(amp["ratio_nmae"]),
        "amplification": float(amp["amplification"]),
        "lower_clip_vs_bf16": fp8_low / bf16_low if bf16_low else float("nan"),
        "overclipped_share": float(over.sum()) / max(int(mask.sum()), 1),
        "tokens": float(mask.sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", action="append", default=[], help="a setting's name (repeatable); default all")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra override for every setting")
    ap.add_argument("--json", type=Path, help="also write {setting: figures} to this file")
    args = ap.parse_args()
    from fp8rl_core.host.cpu_env import pin_cpu_numerics

    pin_cpu_numerics()  # before torch, as `fp8rl run` does
    from flows.orchestration.env import quiet_third_party

    quiet_third_party()
    root, out = Path(tempfile.mkdtemp(prefix="fp8rl-regime-")), {}
    print(f"steps 1-{args.steps}, standard clipping, shadow passes every step")
    print("| setting | prob NMAE | ratio NMAE | ratio / prob | A<0 lower-clip vs BF16 | over-clipped | tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for i, (name, (preset, overrides)) in enumerate(SETTINGS.items()):
        if args.only and name not in args.only:
            continue
        m = out[name] = measure(preset, [*overrides, *args.overrides], args.steps, root, f"s{i}")
        print(f"| {name} | {m['prob_nmae']:.4f} | {m['ratio_nmae']:.4f} | {m['amplification']:.2f}x | "
              f"{m['lower_clip_vs_bf16']:.2f}x | {100 * m['overclipped_share']:.2f} % | {int(m['tokens'])} |",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
