"""What the oracle clip mode costs per step: CPU seconds of the policy update, oracle against standard.

The oracle (``calibration.mode: oracle``) takes every token's clip decision on its BF16 ratio,
so every step runs a BF16 π_old pass and, before every update of every epoch, a BF16 forward
of the mini-batch, beside the FP8 training forwards. Per repetition, in one process on one
machine: one rollout and score of the preset (their CPU seconds, for the share of a step),
then the policy update of that batch twice from the same weights and optimizer state, standard
clipping and the oracle one right after the other (which goes first alternates by step; step 1
runs both once more before, uncounted, to warm up); CPU seconds by ``time.process_time`` (every
thread of the process). Neither is a calibration step (no shadow passes: on those, the oracle takes
the shadow passes' π_old and epoch-0 π_θ instead of computing them again).

    python benchmarks/oracle_cost.py [--preset tiny-cpu] [--reps 3] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override key=value (repeatable)")
    args = ap.parse_args()
    from fp8rl_core.host.cpu_env import pin_cpu_numerics

    pin_cpu_numerics()  # before torch, as `fp8rl run` does
    from flows.campaign.configuration import dump_config, load_config
    from flows.orchestration.env import quiet_third_party
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.runtime.io import read_step
    from stages.score import run_score
    from stages.train import build_batch
    from stages.trainer.update import UpdateSpec, policy_update
    from storage.run.layout import create_run

    quiet_third_party()
    cfg = load_config(args.preset, ["calibration.mode=standard", *args.sets])
    modes = {m: cfg.model_copy(update={"calibration": cfg.calibration.model_copy(update={"mode": m})})
             for m in ("standard", "oracle")}  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="oracle-cost-"))
    create_run(tmp, "r", config=dump_config(cfg))
    env, state = open_run(cfg, tmp / "r")
    gen, train = [], {m: [] for m in modes}
    bounds = (1.0 - cfg.algorithm.eps_low, 1.0 + cfg.algorithm.eps_high)
    try:
        for rep in range(args.reps):
            step = rep + 1
            t0 = time.process_time()
            _, state = run_rollout(env, state, step)
            _, state = run_score(env, state, step)
            gen.append(time.process_time() - t0)
            batch = build_batch(read_step(env, "rollouts", step), read_step(env, "scores", step),
                                env.tokenizer.pad_token_id, step)  # fmt: skip
            start = [copy.deepcopy(x.state_dict()) for x in (state.policy, state.optimizer, state.scheduler)]
            after = None
            order = list(modes) if step % 2 else list(reversed(modes))
            for mode in (order * 2 if step == 1 else order):  # step 1: a warm-up round first
                mcfg = modes[mode]
                for x, sd in zip((state.policy, state.optimizer, state.scheduler), start):
                    x.load_state_dict(copy.deepcopy(sd))
                t0 = time.process_time()
                spec = UpdateSpec(bounds=bounds, shadow=False, seed=step)
                policy_update(state.policy, state.optimizer, state.scheduler, batch, mcfg, spec)
                train[mode].append(time.process_time() - t0)
                if mode == "standard":
                    after = [copy.deepcopy(x.state_dict()) for x in (state.policy, state.optimizer, state.scheduler)]
            if step == 1:  # drop the warm-up round
                train = {m: v[1:] for m, v in train.items()}
            for x, sd in zip((state.policy, state.optimizer, state.scheduler), after):  # go on from standard's
                x.load_state_dict(sd)
            print(f"step {step}: rollout+score {gen[-1]:.2f} s, update standard {train['standard'][-1]:.2f} s, "
                  f"oracle {train['oracle'][-1]:.2f} s (CPU)", flush=True)  # fmt: skip
    finally:
        env.close()
    g, s, o = (statistics.median(x) for x in (gen, train["standard"], train["oracle"]))
    ratio = statistics.median(b / a for a, b in zip(train["standard"], train["oracle"]))
    print(f"{args.preset}, {args.reps} steps, medians of CPU seconds: rollout+score {g:.2f}, update standard {s:.2f}, "
          f"oracle {o:.2f}; per step, oracle / standard update: median {ratio:.2f}x; the step (rollout, score, "
          f"update) +{100 * (o - s) / (g + s):.0f} %")  # fmt: skip


if __name__ == "__main__":
    main()
