"""The golden micro campaign: a short default campaign whose key table values must be the
same, bit for bit, on every x86-64 CPU (with AVX2) that runs this torch build.

Run as a script, in a fresh process, because the CPU-numerics variables
(``fp8rl_core.host.cpu_env``) must be in force before torch is imported:

    PYTHONPATH=$PWD .venv/bin/python tests/golden/micro_campaign.py          # print the values
    PYTHONPATH=$PWD .venv/bin/python tests/golden/micro_campaign.py --write  # regenerate the committed JSON

Regenerate (and commit the JSON) only after a deliberate change of the default numerics;
``tests/flows/campaign/test_golden_tables.py`` says what it guards.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "micro_campaign.json"
# The default preset, shrunk: a barely bootstrapped model, 8 prompts x 4 samples, 2 steps,
# calibration (shadow passes) on step 1, evaluation at steps 0 and 2; the preset's threads.
OVERRIDES = [
    "steps=2",
    "task.difficulty=0",
    "bootstrap.steps=150",
    "bootstrap.batch_size=32",
    "bootstrap.noisy_steps=0",
    "bootstrap.warmup_steps=10",
    "bootstrap.lr=3e-3",
    "rollout.prompts_per_step=8",
    "rollout.samples_per_prompt=4",
    "rollout.max_new_tokens=12",
    "algorithm.ppo_mini_batch_size=16",
    "algorithm.micro_batch_size=8",
    "algorithm.token_stats_sample=0.5",
    "calibration.interval=2",
    "evaluation.interval=2",
    "evaluation.benchmarks=[{name: synthetic, k: 2, limit: 24, max_new_tokens: 12}]",
    "checkpoint.interval=10",
]
STEP_COLUMNS = (
    "reward_mean",
    "entropy_mean",
    "clipfrac",
    "clipfrac_lower",
    "clipfrac_upper",
    "lower_bound",
    "upper_bound",
    "ppo_kl",
)


def _digest(values) -> str:
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16]


def run_micro(root: Path) -> dict:
    """Run the micro campaign's stages in order under ``root``; return its key table values."""
    from flows.campaign.configuration import dump_config, load_config
    from flows.campaign.cpu_numerics import describe, gemm_choice
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from stages.calibrate import run_calibrate
    from stages.context import is_eval_step, open_run
    from stages.evaluate import run_evaluate
    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train
    from storage.queries.catalog import connect, query
    from storage.run.layout import create_run

    cfg = load_config("tiny-cpu", OVERRIDES)
    create_run(root, "golden", config=dump_config(cfg))
    env, state = open_run(cfg, root / "golden")
    gemm = gemm_choice(cfg, env.device)
    try:
        with cpu_bf16_gemm(gemm.kind, env.device):
            for step in range(cfg.steps + 1):
                if step > 0:
                    for stage in (run_rollout, run_score):
                        _, state = stage(env, state, step)
                    summary, state = run_train(env, state, step)
                    if summary["metrics"].get("shadow"):
                        _, state = run_calibrate(env, state, step)
                if is_eval_step(cfg, step):
                    _, state = run_evaluate(env, state, step)
    finally:
        env.close()
    con = connect(root / "golden")
    steps = query(con, f"SELECT step, {', '.join(STEP_COLUMNS)} FROM steps ORDER BY step").to_pylist()
    rollouts = query(
        con, "SELECT step, sample_id, response_token_ids, rollout_logp FROM rollouts ORDER BY step, sample_id"
    ).to_pylist()
    stats = query(
        con,
        "SELECT step, sample_id, position, logp_fp8, old_logp_fp8, logp_bf16, ratio_fp8 "
        "FROM token_stats ORDER BY step, sample_id, position",
    ).to_pylist()
    evals = query(con, "SELECT step, benchmark, metric, k, value FROM eval_scores ORDER BY ALL").to_pylist()
    return {
        "steps": steps,
        "eval_scores": evals,
        "rollouts_sha": _digest([list(r.values()) for r in rollouts]),
        "token_stats_sha": _digest([list(r.values()) for r in stats]),
        "token_stats_rows": len(stats),
        "numerics": {k: v for k, v in describe(gemm).items() if k in ("aten_cpu_capability", "env")}
        | {"bf16_gemm": gemm.kind},
    }


def dispatched_ops() -> dict:
    """The (op, dtype) pairs the micro campaign dispatches on float CPU tensors, and those the
    primitive hashes cover (``cpu_primitives.py``)."""
    sys.path.insert(0, str(HERE))
    import cpu_primitives

    recorder = cpu_primitives.float_ops_recorder()
    with tempfile.TemporaryDirectory(prefix="fp8rl-golden-") as tmp, contextlib.redirect_stdout(sys.stderr):
        with recorder:
            run_micro(Path(tmp))
        hashed = cpu_primitives.hashed_ops()
    return {"campaign": sorted(recorder.seen), "hashed": sorted(hashed)}


def main() -> None:
    ap = argparse.ArgumentParser(description="The golden micro campaign's key table values.")
    ap.add_argument("--write", action="store_true", help=f"write {GOLDEN.name} (regenerate the golden values)")
    ap.add_argument(
        "--ops", action="store_true", help="print the float ATen ops the campaign dispatches and those the hashes cover"
    )
    args = ap.parse_args()
    from fp8rl_core.host.cpu_env import pin_cpu_numerics
    from fp8rl_core.host.cpu_malloc import keep_freed_memory

    pin_cpu_numerics()  # before torch (imported by run_micro), as `fp8rl run` does
    os.environ.pop("FP8RL_MAX_THREADS", None)  # the preset's threads, as `make run` runs them
    keep_freed_memory()  # the allocator setting of `fp8rl run` (speed only: the values must not change)
    os.environ.setdefault("FP8RL_BOOTSTRAP_CACHE", str(Path(tempfile.gettempdir()) / "fp8rl-golden-bootstrap"))
    if args.ops:
        sys.stdout.write(json.dumps(dispatched_ops()) + "\n")
        return
    with tempfile.TemporaryDirectory(prefix="fp8rl-golden-") as tmp, contextlib.redirect_stdout(sys.stderr):
        values = run_micro(Path(tmp))  # the run's console lines go to stderr: stdout carries the JSON alone
    text = json.dumps(values, indent=1, sort_keys=True) + "\n"
    if args.write:
        GOLDEN.write_text(text)
        print(f"wrote {GOLDEN}", file=sys.stderr)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
