"""fp8rl's RL step against TRL's ``GRPOTrainer`` on TRL's own shape, measured side by side.

The shape: a randomly initialised 4-layer Qwen3 (hidden 128, the tiny model's tokenizer),
16 prompts x 8 samples of the synthetic arithmetic task, at most 16 new tokens, one
optimizer update per step on all 128 samples, 2 torch threads. A *step* is what each
framework does per update: generate, score, compute log-probs, loss, backward, AdamW.

* TRL: ``GRPOTrainer`` in its defaults for this shape (``bf16=True``: CPU BF16 autocast,
  PyTorch's native BF16 kernels; ``beta=0``: no reference model; ``num_iterations=1``:
  TRL reuses the detached current log-probs as the old ones), timed by a callback from
  ``on_step_begin`` to ``on_step_end``.
* fp8rl: the rollout, score and train stages of a campaign (their Parquet writes
  included, Prefect's task wrapping not: ~3-5 % of a step) with the default
  ``precision.cpu_bf16_gemm: auto`` and the CPU-numerics pinning of ``fp8rl run``
  (``fp8rl_core.host.cpu_env``), once in BF16 (``precision.train/rollout: bf16``) and once
  FP8-emulated (``fp8_tensorwise`` training, ``fp8_per_tensor`` rollout). Step 1 (the
  calibration step's shadow passes) is a warm-up and is not timed.

Each side runs in its own process (fresh interpreter, same threads), the processes
alternate (TRL, fp8rl BF16, fp8rl FP8, TRL, ...) so that load changes hit all alike,
and the medians of the timed steps are compared. TRL is an optional extra:

    pip install 'fp8rl[bench]'      # or: pip install --no-deps trl accelerate (+ psutil)
    nice python benchmarks/peer_trl.py [--rounds 2] [--steps 6] [--warmup 2] [--threads 2]

``--cpu-isa avx2`` runs both sides as on an x86 CPU without BF16 or AVX-512 instructions
(the AMD EPYC Zen 2/3 class): oneDNN, MKL and ATen are held to AVX2
(``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``, ``ATEN_CPU_CAPABILITY``), so TRL's
BF16 GEMMs take oneDNN's conversion path (~1 GFLOP/s for a 1024 square, as measured on
such a CPU) and every FP32 GEMM MKL's AVX2 kernels. An emulation on this CPU's cores and
caches, not a measurement on such a machine.

Wall time is the figure; the CPU time beside it (``time.process_time``) is steadier on a
shared machine with one thread (with two, OpenMP barriers spin under load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, NEW_TOKENS, LAYERS, LR = 16, 8, 16, 4, 1e-4
THREADS = int(os.environ.get("PEER_THREADS", "2"))  # --threads, passed to the children
# --cpu-isa: the instruction-set limits of both sides' children ("native": this CPU's own)
CPU_ISA_ENV = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}
FP8RL_PRECISION = {"bf16": ("bf16", "bf16"), "fp8": ("fp8_tensorwise", "fp8_per_tensor")}


def _fp8rl_overrides(precision: str, steps: int) -> list[str]:
    train, rollout = FP8RL_PRECISION[precision]
    return [
        f"steps={steps}",
        f"threads={THREADS}",
        f"model.num_layers={LAYERS}",
        "bootstrap.steps=0",
        "bootstrap.noisy_steps=0",  # random init, as TRL's side
        f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.samples_per_prompt={SAMPLES}",
        f"rollout.max_new_tokens={NEW_TOKENS}",
        f"algorithm.lr={LR}",
        f"algorithm.ppo_mini_batch_size={PROMPTS * SAMPLES}",
        f"algorithm.micro_batch_size={PROMPTS * SAMPLES}",
        f"precision.train={train}",
        f"precision.rollout={rollout}",
        f"calibration.interval={steps + 1}",
        f"evaluation.interval={steps + 1}",
        f"checkpoint.interval={steps + 1}",
    ]


def fp8rl_steps(precision: str, steps: int, warmup: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of fp8rl steps ``warmup + 1 .. warmup + steps`` (rollout + score + train)."""
    from flows.campaign.configuration import dump_config, load_config
    from flows.campaign.cpu_numerics import gemm_choice
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run

    extra = [o for o in os.environ.get("PEER_FP8RL_SET", "").split(";") if o]  # --fp8rl-set, passed to the children
    cfg = load_config("tiny-cpu", _fp8rl_overrides(precision, warmup + steps) + extra)
    times = []
    with tempfile.TemporaryDirectory(prefix="peer-fp8rl-") as tmp:
        create_run(tmp, "peer", config=dump_config(cfg))
        env, state = open_run(cfg, Path(tmp) / "peer")
        try:
            with cpu_bf16_gemm(gemm_choice(cfg, env.device).kind, env.device):
                for step in range(1, warmup + steps + 1):
                    t0, c0 = time.perf_counter(), time.process_time()
                    for stage in (run_rollout, run_score, run_train):
                        _, state = stage(env, state, step)
                    times.append((time.perf_counter() - t0, time.process_time() - c0))
        finally:
            env.close()
    return times[warmup:]


def trl_steps(steps: int, warmup: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of TRL ``GRPOTrainer`` steps ``warmup + 1 .. warmup + steps``."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fp8rl_core.config.model import ModelConfig, TaskConfig
    from fp8rl_core.tasks.synthetic import exact_verify, make_problem
    from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer

    torch.set_num_threads(THREADS)
    task = TaskConfig()
    tokenizer = build_tokenizer()
    model = build_tiny_model(ModelConfig(num_layers=LAYERS), len(tokenizer.get_vocab()))
    problems = [make_problem(i, "train", task.difficulty, task.seed) for i in range(PROMPTS * (warmup + steps + 2))]
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def reward(completions, answer, **_):
        return [float(exact_verify(c, a)) for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[tuple[float, float]] = []

        def on_step_begin(self, *_, **__):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            self.times.append((time.perf_counter() - self.t0, time.process_time() - self.c0))

    clock = Clock()
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=PROMPTS * SAMPLES,
            num_generations=SAMPLES,
            max_completion_length=NEW_TOKENS,
            max_steps=warmup + steps,
            learning_rate=LR,
            beta=0.0,
            temperature=1.0,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=10**6,
            dataloader_num_workers=0,
            seed=0,
            disable_tqdm=True,
        )
        GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[clock],
        ).train()
    return clock.times[warmup:]


def _child(
    role: str, steps: int, warmup: int, threads: int, fp8rl_set: list[str], cpu_isa: str = "native"
) -> list[list[float]]:
    env = dict(
        os.environ,
        **CPU_ISA_ENV[cpu_isa],
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        PEER_THREADS=str(threads),
        PEER_FP8RL_SET=";".join(fp8rl_set),
    )
    cmd = [sys.executable, __file__, "--role", role, "--steps", str(steps), "--warmup", str(warmup)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{role} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the three processes")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per process")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per process")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both sides (TRL's shape: 2)")
    ap.add_argument(
        "--fp8rl-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra config override of fp8rl's side, e.g. precision.cpu_bf16_gemm=native (repeatable)",
    )
    ap.add_argument(
        "--cpu-isa",
        choices=tuple(CPU_ISA_ENV),
        default="native",
        help="avx2: both sides as on a CPU without BF16/AVX-512 instructions (emulated, see above)",
    )
    ap.add_argument("--role", choices=("trl", "bf16", "fp8"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "trl":
        print(json.dumps(trl_steps(args.steps, args.warmup)))
        return
    if args.role:
        from fp8rl_core.host.cpu_env import pin_cpu_numerics
        from fp8rl_core.host.cpu_malloc import keep_freed_memory

        pin_cpu_numerics()  # what `fp8rl run` does, before torch
        keep_freed_memory()  # and its allocator setting
        print(json.dumps(fp8rl_steps(args.role, args.steps, args.warmup)))
        return
    times: dict[str, list[list[float]]] = {"trl": [], "bf16": [], "fp8": []}
    for r in range(args.rounds):
        for role in times:
            times[role] += _child(role, args.steps, args.warmup, args.threads, args.fp8rl_set, args.cpu_isa)
            print(
                f"round {r + 1}: {role:<4} median {statistics.median(t[0] for t in times[role]):.3f} s/step", flush=True
            )
    wall = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
    cpu = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
    print(
        f"\n{PROMPTS} prompts x {SAMPLES} samples, <= {NEW_TOKENS} new tokens, {LAYERS} layers x 128, "
        f"{args.threads} thread(s), CPU ISA {args.cpu_isa}; medians of {len(times['trl'])} steps per side "
        "(wall s, CPU s)"
    )
    print(f"TRL GRPOTrainer (BF16)   {wall['trl']:.3f}  {cpu['trl']:.3f}")
    for k, name in (("bf16", "fp8rl BF16"), ("fp8", "fp8rl FP8 (emulated)")):
        print(
            f"{name:<24} {wall[k]:.3f}  {cpu[k]:.3f}   fp8rl / TRL: wall {wall[k] / wall['trl']:.2f}, "
            f"CPU {cpu[k] / cpu['trl']:.2f}"
        )


if __name__ == "__main__":
    main()
