"""How far the first mini-batch's ratios sit from 1 in each training precision.

Before the first update π_θ = π_old, so every ratio of the first mini-batch is 1
in exact arithmetic. In BF16 it is (the forward does not depend on batch
composition). In FP8 the dynamic scales do depend on it: where π_old and π_θ of
a token are computed over differently composed micro-batches, activation amax —
and the rounding — differs, and the deviation adds to the ratio noise the paper
measures. The trainer computes π_old on the very micro-batches π_θ trains on
(``stages.trainer.batch``), which removes most of it for tensorwise
scaling (docs/calibration.md); this script reports what is left, per mode, from
one real step of the tiny default (bootstrapped policy, its rollout, its scores).

    python benchmarks/first_minibatch_noise.py [--set key=value ...]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

MODES = {
    "bf16": ("bf16", "bf16"),
    "fp8_tensorwise": ("fp8_tensorwise", "fp8_per_tensor"),
    "fp8_rowwise": ("fp8_rowwise", "fp8_per_tensor"),
    "fp8_blockwise": ("fp8_blockwise", "fp8_per_block"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()

    from flows.campaign.configuration import dump_config, load_config
    from flows.orchestration.env import quiet_third_party

    quiet_third_party()
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.runtime.io import read_step
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run

    root = Path(tempfile.mkdtemp(prefix="fp8rl-noise-"))
    print(f"{'mode':<16}{'mean |r8-1|':>13}{'max |r8-1|':>12}{'mean |r16-1|':>14}{'share r8<L':>12}{'tokens':>8}")
    for name, (train, rollout) in MODES.items():
        cfg = load_config("tiny-cpu", [f"precision.train={train}", f"precision.rollout={rollout}", *args.overrides])
        create_run(root, name, config=dump_config(cfg))
        env, state = open_run(cfg, root / name)
        try:
            for stage in (run_rollout, run_score, run_train):
                _, state = stage(env, state, 1)
        finally:
            env.close()
        t = read_step(env, "token_stats", 1).to_pandas()
        first = t[t["minibatch"] == 0]
        r8 = np.exp(first["logp_fp8"].to_numpy(np.float64) - first["old_logp_fp8"].to_numpy(np.float64))
        r16 = np.exp(first["logp_bf16"].to_numpy(np.float64) - first["old_logp_bf16"].to_numpy(np.float64))
        lower = 1 - cfg.algorithm.eps_low
        print(
            f"{name:<16}{np.abs(r8 - 1).mean():>13.2e}{np.abs(r8 - 1).max():>12.2e}{np.abs(r16 - 1).mean():>14.2e}"
            f"{(r8 < lower).mean():>12.4f}{len(first):>8}",
            flush=True,
        )


if __name__ == "__main__":
    main()
