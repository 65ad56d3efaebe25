"""Where a CPU step's time goes: CPU-time clock per stage, and the torch profiler's split by kind of work.

Three steps, each in this process with one thread:

* ``--what step``: a step of a campaign (``rollout``, ``score`` and ``train``), the tiny default
  (``tiny-cpu``) unless ``--config``/``--set`` say otherwise; steps 1..``--warmup`` run first
  (step 1 is a calibration step; its shadow passes are not what a step usually costs);
* ``--what peer``: the same on TRL's shape (``benchmarks/peer_trl.py``: 4 layers x 128, 16 prompts x 8
  samples, 16 new tokens, one update of 128 samples), BF16 (``--precision bf16``) or FP8;
* ``--what bootstrap``: the tiny policy's supervised bootstrap step (``stages/bootstrap/math.py``).

For each it prints the CPU seconds (``time.process_time``) of the timed step(s) without the profiler,
then one profiled step split by kind: under ``precision.cpu_bf16_gemm: portable``

* **exact GEMM, products**: the float64 GEMMs on the grid integers (``aten::mm``/``bmm`` inside
  ``portable_math.exact_matmul_values``);
* **exact GEMM, grid and conversions**: everything else inside it (``abs``, ``amax``, ``frexp``,
  ``round``, the float64 and float32 conversions, the scaling);
* **attention by definition** (``portable_mode._sdpa`` outside its GEMMs): masks, softmax, casts;
* **transcendentals** (``portable_math.portable_*``): the float64 ``exp``/``log``/``sin``/...;
* **other ATen ops**: the model's own elementwise work, the optimizer, sampling, the loss;
* **Python and dispatch**: the profiled step's time not inside any ATen op (the torch-function
  mode, module calls, the stages' Python).

The profiler's times are wall-clock times of the one thread: take the split on an otherwise idle
machine.

The labels are added here, by wrapping the functions for the profiled step only; the code the
campaign runs is unchanged. Profiler overhead inflates the Python share; the per-stage CPU seconds
above the split are taken without it. Figures, not a test::

    python benchmarks/cpu_profile.py --what step
    python benchmarks/cpu_profile.py --what peer --precision bf16
    python benchmarks/cpu_profile.py --what bootstrap
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

KINDS = (
    "exact GEMM, products",
    "exact GEMM, grid and conversions",
    "attention by definition",
    "transcendentals",
    "other ATen ops",
    "Python and dispatch",
)


def _label_portable_work():
    """Wrap the portable path's functions in profiler labels (this process only)."""
    import torch
    import torch.nn.functional as F

    from fp8rl_core.cpu_numerics import portable_math as pm
    from fp8rl_core.cpu_numerics import portable_mode as pmode

    def label(name, fn):
        @functools.wraps(fn)
        def wrapped(*a, **k):
            with torch.profiler.record_function(name):
                return fn(*a, **k)

        return wrapped

    pm.exact_matmul_values = label("portable.gemm", pm.exact_matmul_values)
    pmode._GEMM_IMPL[F.scaled_dot_product_attention] = label("portable.attention", pmode._sdpa)
    for name in list(pmode._FORWARD):
        pmode._FORWARD[name] = label("portable.math", pmode._FORWARD[name])
    for name in ("portable_exp", "portable_cos", "portable_sin", "portable_logsumexp"):
        setattr(pm, name, label("portable.math", getattr(pm, name)))


def _split(prof, wall_s: float) -> dict[str, float]:
    """Seconds of one profiled region of ``wall_s`` by kind (module docstring). The profiler times ops
    by the clock on the wall: on an otherwise idle machine with one thread that is their CPU time."""
    out = collections.Counter()
    for ev in prof.profiler.function_events:
        if ev.name.startswith("portable."):
            continue  # a label's own time is Python inside it: counted with Python below
        anc, kind = ev.cpu_parent, None
        while anc is not None and kind is None:
            kind = anc.name if anc.name.startswith("portable.") else None
            anc = anc.cpu_parent
        self_s = ev.self_cpu_time_total / 1e6
        if kind == "portable.gemm":
            out[KINDS[0] if ev.name in ("aten::mm", "aten::bmm") else KINDS[1]] += self_s
        elif kind == "portable.attention":
            out[KINDS[2]] += self_s
        elif kind == "portable.math":
            out[KINDS[3]] += self_s
        elif ev.name.startswith("aten::"):
            out[KINDS[4]] += self_s
    out[KINDS[5]] = max(0.0, wall_s - sum(out.values()))
    return out


def _print_split(title: str, split: dict[str, float]) -> None:
    total = sum(split.values())
    print(f"\n{title}: {total:.3f} s under the profiler (its clock: the wall)")
    for kind in KINDS:
        print(f"  {kind:<36} {split.get(kind, 0.0):7.3f} s  {100 * split.get(kind, 0.0) / max(total, 1e-12):5.1f} %")


def _print_top(prof, top: int) -> None:
    if top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def _campaign(cfg, warmup: int, steps: int, top: int = 0) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flows.campaign.configuration import dump_config
    from flows.campaign.cpu_numerics import gemm_choice
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from stages.context import open_run
    from stages.rollout import run_rollout
    from stages.score import run_score
    from stages.train import run_train
    from storage.run.layout import create_run

    stages = (run_rollout, run_score, run_train)
    with tempfile.TemporaryDirectory(prefix="cpu-profile-") as tmp:
        create_run(tmp, "profile", config=dump_config(cfg))
        env, state = open_run(cfg, Path(tmp) / "profile")
        try:
            choice = gemm_choice(cfg, env.device)
            print(f"cpu_bf16_gemm: {choice.kind}; {torch.get_num_threads()} thread(s); "
                  f"train {cfg.precision.train}, rollout {cfg.precision.rollout}")
            with cpu_bf16_gemm(choice.kind, env.device):
                for step in range(1, warmup + 1):
                    for stage in stages:
                        _, state = stage(env, state, step)
                per = collections.Counter()
                for step in range(warmup + 1, warmup + steps + 1):
                    for stage in stages:
                        c0 = time.process_time()
                        _, state = stage(env, state, step)
                        per[stage.__name__.removeprefix("run_")] += time.process_time() - c0
                print(f"CPU s per step (mean of {steps}, no profiler): "
                      + ", ".join(f"{k} {v / steps:.3f}" for k, v in per.items())
                      + f"; step {sum(per.values()) / steps:.3f}")
                _label_portable_work()
                step = warmup + steps + 1
                for stage in stages:
                    c0 = time.perf_counter()
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        _, state = stage(env, state, step)
                    if stage is not run_score:
                        _print_split(f"{stage.__name__.removeprefix('run_')} stage, step {step}",
                                     _split(prof, time.perf_counter() - c0))
                        _print_top(prof, top)
        finally:
            env.close()


def _bootstrap(steps: int, top: int = 0) -> None:
    import random

    import torch
    from torch.profiler import ProfilerActivity, profile

    from fp8rl_core.config.model import BootstrapConfig, ModelConfig, TaskConfig
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from fp8rl_core.tasks.tiny_model import build_tiny_model, build_tokenizer
    from stages.bootstrap.math import _batch, _sft_step

    boot, task, model_cfg = BootstrapConfig(), TaskConfig(), ModelConfig()
    vocab = build_tokenizer().get_vocab()
    rng = random.Random(0)
    with cpu_bf16_gemm("portable"), torch.autocast("cpu", dtype=torch.bfloat16):
        model = build_tiny_model(model_cfg, len(vocab))
        opt = torch.optim.AdamW(model.parameters(), lr=boot.lr)
        batches = [_batch(s, boot, task, 0.0, rng, vocab) for s in range(steps + 2)]
        _sft_step(model, opt, *batches[0], boot.lr)
        c0 = time.process_time()
        for ids, labels in batches[1 : steps + 1]:
            _sft_step(model, opt, ids, labels, boot.lr)
        per_step = (time.process_time() - c0) / steps
        print(f"bootstrap SFT step (batch {boot.batch_size}, {model_cfg.num_layers} layers x "
              f"{model_cfg.hidden_size}): {per_step:.3f} CPU s (mean of {steps}, no profiler)")
        _label_portable_work()
        c0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _sft_step(model, opt, *batches[-1], boot.lr)
        _print_split("bootstrap SFT step", _split(prof, time.perf_counter() - c0))
        _print_top(prof, top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--what", choices=("step", "peer", "bootstrap"), default="step")
    ap.add_argument("--config", default="tiny-cpu")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16", help="--what peer")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=0, help="also print the N ops of most self time per profiled stage")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fp8rl_core.host.cpu_env import pin_cpu_numerics

    pin_cpu_numerics()
    import torch

    torch.set_num_threads(1)
    if args.what == "bootstrap":
        return _bootstrap(args.steps, args.top)
    from flows.campaign.configuration import load_config

    n = args.warmup + args.steps + 1
    if args.what == "peer":
        import peer_trl

        peer_trl.THREADS = 1
        cfg = load_config("tiny-cpu", peer_trl._fp8rl_overrides(args.precision, n) + args.set)
    else:
        cfg = load_config(args.config, [f"steps={n}", "threads=1", *args.set])
    _campaign(cfg, args.warmup, args.steps, args.top)


if __name__ == "__main__":
    main()
