"""Why CPU campaigns are slow: BF16 GEMMs vs FP32 on this CPU, measured side by side.

Every CPU campaign computes under ``torch.autocast("cpu", torch.bfloat16)``
(``fp8rl_core.precision.autocast.autocast_context``): the BF16 numerics the GPU runs.
On a CPU without AVX512-BF16 / AMX, PyTorch's BF16 GEMM has no fast kernel,
so the linear layers of the tiny and stress worlds run many times slower than
FP32 GEMMs of the same shapes would. This script prints, for the stress
world's layer shapes (tokens x 128 -> 128 / 384 and back), the time of

* an FP32 ``F.linear``,
* a BF16 ``F.linear`` (bf16 tensors),
* the same under CPU autocast (what the campaigns run),
* FP32 GEMM on BF16-rounded operands, output rounded to BF16 (the same
  products, FP32 accumulation: a possible fast emulation of BF16 numerics,
  not bit-identical to the BF16 kernel's accumulation order),

interleaved, and the ratios to FP32. Then, for a stress-world policy (the
``stress-cpu`` model: 2 layers, 128 wide) in BF16, emulated FP8 tensorwise and
emulated NVFP4, one micro-batch forward + backward under autocast with
``precision.cpu_bf16_gemm: native`` vs ``fp32`` (``fp8rl_core.cpu_numerics.cpu_gemm``), interleaved,
and the speed-up. Figures, not a test:

    python benchmarks/cpu_bf16_gemm.py [--threads 1] [--reps 20] [--model-reps 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--model-reps", type=int, default=3, help="forward+backward repetitions per setting (0: skip)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s)"
    )
    print(f"{'tokens x in -> out':<22} {'fp32 ms':>9} {'bf16':>8} {'autocast':>9} {'fp32-on-bf16':>13}")
    for m, k, n in ((128, 128, 384), (2880, 128, 128), (2880, 128, 384), (2880, 384, 128)):
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
        xb, wb = x.bfloat16(), w.bfloat16()
        xe, we = xb.float(), wb.float()
        times = {"fp32": 0.0, "bf16": 0.0, "autocast": 0.0, "emul": 0.0}
        for _ in range(3):  # interleaved rounds: load changes hit every variant alike
            times["fp32"] += _time(lambda: F.linear(x, w), args.reps)
            times["bf16"] += _time(lambda: F.linear(xb, wb), args.reps)

            def autocast() -> torch.Tensor:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return F.linear(x, w)

            times["autocast"] += _time(autocast, args.reps)
            times["emul"] += _time(lambda: F.linear(xe, we).bfloat16(), args.reps)
        base = times["fp32"]
        print(
            f"{f'{m} x {k} -> {n}':<22} {1e3 * base / 3:>9.2f} {times['bf16'] / base:>7.1f}x "
            f"{times['autocast'] / base:>8.1f}x {times['emul'] / base:>12.1f}x"
        )
    print("ratios: time / fp32 time of the same shape")
    if args.model_reps:
        model_steps(args.model_reps)


def model_steps(reps: int, batch: int = 32, tokens: int = 60) -> None:
    """A stress-world micro-batch (32 sequences x 60 tokens) forward + backward, native vs fp32 GEMMs."""
    from transformers import Qwen3ForCausalLM

    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from fp8rl_core.precision.autocast import autocast_context
    from fp8rl_core.precision.conversion import convert_for_training
    from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

    cfg = tiny_qwen3_config(
        vocab_size=64, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None
    )
    ids = torch.randint(0, 64, (batch, tokens), generator=torch.Generator().manual_seed(0))
    print(f"\nstress-world policy, {batch} x {tokens} tokens, forward + backward (s)")
    print(f"{'training precision':<20} {'native':>8} {'fp32':>8} {'speed-up':>9}")
    for mode in ("bf16", "fp8_tensorwise", "nvfp4"):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
        convert_for_training(model, mode, emulate=True)

        def step() -> None:
            with autocast_context(mode):
                logits = model(ids).logits
            logits.float().logsumexp(-1).mean().backward()
            model.zero_grad(set_to_none=True)

        times = {"native": 0.0, "fp32": 0.0}
        for _ in range(2):  # interleaved rounds
            for kind in times:
                with cpu_bf16_gemm(kind):
                    times[kind] += _time(step, reps)
        print(
            f"{mode:<20} {times['native'] / 2:>8.3f} {times['fp32'] / 2:>8.3f} {times['native'] / times['fp32']:>8.1f}x"
        )


if __name__ == "__main__":
    main()
