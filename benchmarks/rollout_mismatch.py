"""The rollout-trainer mismatch taken apart: weight transfer, quantization grid, kernels.

Question answered: of the distance between the rollout engine's token probabilities and the
trainer's π_old (what the TIS weight corrects), how much comes from the BF16 rounding of
the weights on their way to the engine, how much from the two quantization grids (the
trainer's recipe vs the engine's fused W8A8), and how much from the kernels (a KV-cached
decode against a full-sequence forward)? Per FP8 mode, the preset runs ``--steps`` RL steps
twice from the same bootstrapped policy, once per ``rollout.weight_format``, and on every
step, before the update, the step's rollout batch is scored by:

* ``trainer``: π_old as the train stage computes it (the training recipe on the bf16 casts
  of the fp32 masters);
* ``rollout grid``: a full-sequence forward of the engine's own inference copy (the FP8
  values the engine samples with, its W8A8 activation rule), so only the kernels differ;
* ``bf16``: the BF16 shadow forward of the same masters (the reference the paper's
  calibration uses).

Arms of the table: BF16 transfer (today), native FP8 transfer, native FP8 transfer with π_old
on the rollout's grid (and, for completeness, BF16 transfer with π_old on the rollout's
grid), and a paired arm: on the BF16-transfer run's own tokens, the log-probs a native-FP8
engine would give them (a full-sequence forward of the native inference copy; on CPU the
engine's kernels add ~1e-6, the fourth arm shows it), against the same π_old: the same tokens
on both sides, so the noise of two trajectories drops out. Columns: probability NMAE of the
rollout against π_old (``rollout_fp8_prob_nmae``),
mean |log π_rollout - log π_old| over response tokens, and the TIS weight
``min(π_old / π_rollout, cap)``: its standard deviation and its mean, pooled over the steps.

    python benchmarks/rollout_mismatch.py [--preset stress-cpu] [--steps 8] [--modes tensorwise,blockwise]

Its last line is the ratio of the TIS weight's spread, native FP8 ÷ BF16 transfer, per mode.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

MODES = {"tensorwise": ("fp8_tensorwise", "fp8_per_tensor"), "blockwise": ("fp8_blockwise", "fp8_per_block")}
FORMATS = ("bf16", "native_fp8")


def measure_step(env, state, step: int, cfg) -> dict[str, torch.Tensor]:
    """π_old three ways for ``step``'s rollout batch, and the batch's rollout log-probs and mask."""
    from fp8rl_core.objective.logprobs import sequence_logprobs
    from fp8rl_core.precision.rollout import convert_for_rollout
    from stages.runtime.io import read_step
    from stages.train import build_batch
    from stages.trainer.forward import ForwardSpec, policy_logprobs

    batch = build_batch(read_step(env, "rollouts", step), read_step(env, "scores", step), env.tokenizer.pad_token_id)
    ids, am = batch.input_ids.to(env.device), batch.attention_mask.to(env.device)
    mb = cfg.algorithm.micro_batch_size
    with torch.no_grad():
        mode = cfg.precision.train
        trainer = policy_logprobs(state.policy, ids, am, ForwardSpec(mode, micro_batch_size=mb))[0]
        bf16 = policy_logprobs(state.policy, ids, am, ForwardSpec(mode, shadow=True, micro_batch_size=mb))[0]
        grid = sequence_logprobs(
            env.engine.model, ids, am, mode=cfg.precision.rollout, micro_batch_size=mb, with_entropy=False
        )[0]
    native = convert_for_rollout(state.policy, cfg.precision.rollout, dtype=torch.float32, weight_format="native_fp8")
    with torch.no_grad():  # the native engine's log-probs of the same tokens (a paired arm on one trajectory)
        paired = sequence_logprobs(
            native, ids, am, mode=cfg.precision.rollout, micro_batch_size=mb, with_entropy=False
        )[0]
    return {
        "native grid": paired.cpu(),
        "trainer": trainer.cpu(),
        "rollout grid": grid.cpu(),
        "bf16": bf16.cpu(),
        "rollout": batch.rollout_logp,
        "mask": batch.response_mask > 0,
    }


def run_arm(mode: str, weight_format: str, args) -> list[dict[str, torch.Tensor]]:
    """``args.steps`` RL steps of the preset in ``mode`` with ``weight_format``; the per-step measurements."""
    from flows.campaign.configuration import dump_config, load_config
    from flows.campaign.cpu_numerics import gemm_choice
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from stages.calibrate import run_calibrate
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run

    train, rollout = MODES[mode]
    overrides = [
        f"steps={args.steps}",
        f"precision.train={train}",
        f"precision.rollout={rollout}",
        f"rollout.weight_format={weight_format}",
        f"threads={args.threads}",
        *args.set,
    ]
    cfg = load_config(args.preset, overrides)
    root = Path(tempfile.mkdtemp(prefix="fp8rl-mismatch-"))
    create_run(root, "run", config=dump_config(cfg))
    env, state = open_run(cfg, root / "run")
    out = []
    try:
        with cpu_bf16_gemm(gemm_choice(cfg, env.device).kind, env.device):
            for step in range(1, cfg.steps + 1):
                for stage in (run_rollout, run_score):
                    _, state = stage(env, state, step)
                out.append(measure_step(env, state, step, cfg))
                summary, state = run_train(env, state, step)
                if summary["metrics"].get("shadow"):
                    _, state = run_calibrate(env, state, step)
    finally:
        env.close()
    return out


def mismatch(steps: list[dict[str, torch.Tensor]], old: str, cap: float, roll: str = "rollout") -> dict[str, float]:
    """NMAE of rollout (``roll``) vs π_old (``old``) probabilities, mean |Δ log π|, TIS weight sd and mean,
    pooled over steps."""
    from fp8rl_core.objective.losses import tis_weights
    from fp8rl_core.signals.diagnostics import nmae

    nm, diffs, weights = [], [], []
    for s in steps:
        m = s["mask"]
        nm.append(nmae(torch.exp(s[roll].double()), torch.exp(s[old].double()), m))
        diffs.append((s[roll] - s[old]).abs()[m])
        weights.append(tis_weights(s[old], s[roll], cap=cap)[m])
    w, d = torch.cat(weights).double(), torch.cat(diffs).double()
    return {
        "prob_nmae": sum(nm) / len(nm),
        "abs_dlogp": float(d.mean()),
        "tis_sd": float(w.std()),
        "tis_mean": float(w.mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="stress-cpu")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--modes", default="tensorwise,blockwise")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tis-cap", type=float, default=2.0)
    ap.add_argument("--set", action="append", default=[], help="extra config override key=value (repeatable)")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; valid: {', '.join(MODES)}")
    ratios = []
    print(
        "| mode | arm | rollout vs π_old prob NMAE | mean abs Δlog π | TIS weight sd | TIS weight mean | "
        "rollout vs BF16 π_old NMAE |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for mode in modes:
        res = {}
        for fmt in FORMATS:
            t0 = time.perf_counter()
            res[fmt] = run_arm(mode, fmt, args)
            print(f"<!-- {mode} {fmt}: {args.steps} steps in {time.perf_counter() - t0:.0f} s -->", flush=True)
        arms = [
            ("BF16 transfer (today)", "bf16", "trainer", "rollout"),
            ("native FP8 transfer", "native_fp8", "trainer", "rollout"),
            ("native FP8 transfer, π_old on the rollout grid", "native_fp8", "rollout grid", "rollout"),
            ("BF16 transfer, π_old on the rollout grid", "bf16", "rollout grid", "rollout"),
            ("native FP8 transfer, paired: today's tokens", "bf16", "trainer", "native grid"),
        ]
        sds = {}
        for label, fmt, old, roll in arms:
            m = mismatch(res[fmt], old, args.tis_cap, roll)
            ref = mismatch(res[fmt], "bf16", args.tis_cap)["prob_nmae"]
            sds[(fmt, old, roll)] = m["tis_sd"]
            print(
                f"| {mode} | {label} | {m['prob_nmae']:.2e} | {m['abs_dlogp']:.2e} | {m['tis_sd']:.2e} | "
                f"{m['tis_mean']:.5f} | {ref:.2e} |",
                flush=True,
            )
        today = sds[("bf16", "trainer", "rollout")]
        ratios.append(
            f"{mode} {sds[('native_fp8', 'trainer', 'rollout')] / today:.3f} "
            f"(paired {sds[('bf16', 'trainer', 'native grid')] / today:.3f})"
        )
    print("TIS weight sd, native FP8 ÷ BF16 transfer: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
