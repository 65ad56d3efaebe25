"""CPU seconds per stage of stress-world RL steps (an FP4 cell's steps by default), stages driven directly.

The ``stress-cpu`` preset with one torch thread (as the sweep runs its cells), NVFP4 training
and W4A4 rollout, calibrated clipping, a *random-init* policy (``bootstrap.steps=0``: no
2,400-step stress bootstrap; every response runs to the 47-token cap, about the length of a
bootstrapped policy's 41-42-token chains), evaluation and checkpoints off. Step 1 has the
calibration step's shadow passes. Prints one line per step: rollout, score, train (and
calibrate) in CPU seconds (``time.process_time``). Run it from another checkout's root with
that checkout first on the path to time its code alike. Figures, not a test:

    python benchmarks/stress_step.py [--steps 4] [--keep-freed-memory] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

DEFAULTS = [
    "threads=1",
    "precision.train=nvfp4",
    "precision.rollout=nvfp4_w4a4",
    "calibration.mode=calibrated",
    "bootstrap.steps=0",
    "bootstrap.noisy_steps=0",
    "evaluation.interval=1000",
    "checkpoint.interval=1000",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--keep-freed-memory", action="store_true", help="fp8rl's allocator setting (fp8rl_core.host.cpu_malloc)"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    args = ap.parse_args()
    from fp8rl_core.host.cpu_env import pin_cpu_numerics

    pin_cpu_numerics()
    if args.keep_freed_memory:
        from fp8rl_core.host.cpu_malloc import keep_freed_memory

        keep_freed_memory()
    run_steps(args.steps, DEFAULTS + args.set)


def run_steps(steps: int, overrides: list[str]) -> None:
    from flows.campaign.configuration import dump_config, load_config
    from flows.campaign.cpu_numerics import gemm_choice
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from stages.calibrate import run_calibrate
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run

    cfg = load_config("stress-cpu", overrides)
    with tempfile.TemporaryDirectory(prefix="stress-step-") as tmp:
        create_run(tmp, "s", config=dump_config(cfg))
        env, state = open_run(cfg, Path(tmp) / "s")
        try:
            with cpu_bf16_gemm(gemm_choice(cfg, env.device).kind, env.device):
                for step in range(1, steps + 1):
                    row = {}
                    for name, stage in (("rollout", run_rollout), ("score", run_score), ("train", run_train)):
                        c0 = time.process_time()
                        result, state = stage(env, state, step)
                        row[name] = round(time.process_time() - c0, 3)
                    if result["metrics"].get("shadow"):
                        c0 = time.process_time()
                        _, state = run_calibrate(env, state, step)
                        row["calibrate"] = round(time.process_time() - c0, 3)
                    print(f"step {step}: {json.dumps(row)}", flush=True)
        finally:
            env.close()


if __name__ == "__main__":
    main()
