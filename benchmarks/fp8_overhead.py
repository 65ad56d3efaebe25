"""FP8 emulation overhead on CPU: train-step and rollout time of each FP8 mode / BF16.

Question answered: what does running the FP8 (and FP4) precision modes cost on
a CPU, where they are emulated? Goal: <= 1.5x BF16 for a training step and
<= 1.5x for rollout on the 2-core CPU (torchao's emulate path alone measured
~2.7x and ~4x here; pass ``--torchao`` to time it side by side).

Model: the tiny Qwen3 of the tests (vocab 32, hidden 128, 2 layers, 4 heads of
32, MLP 384, tied embeddings). Train step: forward + backward + AdamW on
``--batch`` sequences of ``--seq-len`` tokens under the mode's autocast, after
``convert_for_training``. Rollout: ``model.generate`` of ``--gen-batch``
sequences (``--prompt-len`` prompt tokens + ``--new-tokens`` sampled with the
KV cache, ``do_sample=True, top_k=0``) on the ``convert_for_rollout`` copy.

The CPUs are shared with other jobs, so runs are interleaved (the order rotates
each round) and repeated, and medians are reported, per wall second and per CPU
second of this process (far less sensitive to other jobs; with more than one
thread it also counts OpenMP spinning). ``--profile MODE`` prints the top
operators of one train step of that mode (where the time goes).

    python benchmarks/fp8_overhead.py                 # 2 threads, 5 repeats
    python benchmarks/fp8_overhead.py --threads 1 --torchao
    python benchmarks/fp8_overhead.py --quick         # seconds: a smoke run
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
from transformers import Qwen3ForCausalLM  # noqa: E402  (after fp8rl_core: quiet torchao)

from fp8rl_core.precision.autocast import autocast_context
from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.precision.rollout import convert_for_rollout
from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

TRAIN_MODES = ("bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise")
ROLLOUT_MODES = ("bf16", "fp8_per_tensor", "fp8_per_block")
# FP4: emulated NVFP4 / MXFP4 training (NVIDIA's recipe) and W4A4 rollout, timed beside FP8
# in the same interleaved rounds; the 1.5x goal is FP8's, FP4's ratios are reported, not judged.
FP4_TRAIN_MODES = ("nvfp4", "mxfp4")
FP4_ROLLOUT_MODES = ("nvfp4_w4a4", "mxfp4_w4a4")
GOAL = 1.5


def tiny_model(seed: int = 0) -> Qwen3ForCausalLM:
    cfg = tiny_qwen3_config(vocab_size=32, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


def train_step_fn(base: Qwen3ForCausalLM, mode: str, ids: torch.Tensor, backend: str = "auto") -> Callable[[], None]:
    model = copy.deepcopy(base).train()
    convert_for_training(model, mode, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with autocast_context(mode):
            loss = model(input_ids=ids, labels=ids).loss  # [B, T] -> scalar
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def rollout_fn(base: Qwen3ForCausalLM, mode: str, prompts: torch.Tensor, new_tokens: int) -> Callable[[], None]:
    rollout = convert_for_rollout(base, mode)  # BF16 weights, the FP8 modes quantize them once here
    mask = torch.ones_like(prompts)

    def generate() -> None:
        with torch.inference_mode():
            out = rollout.generate(
                input_ids=prompts,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=True,
                top_k=0,
                pad_token_id=0,
            )  # [B, P + new_tokens]
        assert out.shape[1] == prompts.shape[1] + new_tokens

    return generate


def measure(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, tuple[list[float], list[float]]]:
    """Interleaved timing: per name, (wall seconds, process CPU seconds) of each repeat."""
    for fn in fns.values():  # warm-up: allocator, oneDNN primitive caches, lazy imports
        fn()
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in fns}
    names = list(fns)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            w0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            out[name][0].append(time.perf_counter() - w0)
            out[name][1].append(time.process_time() - c0)
    return out


def report(title: str, times: dict[str, tuple[list[float], list[float]]], baseline: str) -> dict[str, float]:
    """Print one table; return the median wall ratio per name."""
    bw, bc = (statistics.median(v) for v in times[baseline])
    print(f"\n{title}")
    print(f"{'mode':<34}{'wall ms':>10}{'x bf16':>9}{'cpu ms':>10}{'x bf16':>9}")
    ratios = {}
    for name, (wall, cpu) in times.items():
        w, c = statistics.median(wall), statistics.median(cpu)
        ratios[name] = w / bw
        print(f"{name:<34}{w * 1e3:>10.0f}{w / bw:>9.2f}{c * 1e3:>10.0f}{c / bc:>9.2f}")
    return ratios


def profile_step(fn: Callable[[], None], rows: int = 20) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (medians reported)")
    ap.add_argument("--batch", type=int, default=512, help="train sequences per step")
    ap.add_argument("--seq-len", type=int, default=40, help="train tokens per sequence")
    ap.add_argument("--gen-batch", type=int, default=512, help="rollout sequences")
    ap.add_argument("--prompt-len", type=int, default=16, help="rollout prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=24, help="rollout sampled tokens")
    ap.add_argument("--torchao", action="store_true", help="also time torchao's emulate=True path (slow)")
    ap.add_argument("--profile", choices=TRAIN_MODES, help="print the top ops of one train step of this mode")
    ap.add_argument("--no-fp4", action="store_true", help="skip the FP4 modes (nvfp4, mxfp4, *_w4a4)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.seq_len, args.gen_batch, args.new_tokens, args.repeats = 16, 12, 16, 4, 1
    torch.set_num_threads(args.threads)
    base = tiny_model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (args.batch, args.seq_len), generator=g)  # [B, T]
    prompts = torch.randint(1, 32, (args.gen_batch, args.prompt_len), generator=g)  # [G, P]
    print(
        f"fp8 overhead on CPU: threads={args.threads} repeats={args.repeats} "
        f"train {args.batch}x{args.seq_len} tokens, rollout {args.gen_batch}x({args.prompt_len}+{args.new_tokens})"
    )
    if args.profile:
        profile_step(train_step_fn(base, args.profile, ids))
    train = {m: train_step_fn(base, m, ids) for m in TRAIN_MODES + (() if args.no_fp4 else FP4_TRAIN_MODES)}
    if args.torchao:
        for m in ("fp8_tensorwise", "fp8_rowwise"):
            train[f"{m} (torchao emulate)"] = train_step_fn(base, m, ids, backend="torchao")
    train_ratio = report("train step: forward + backward + AdamW", measure(train, args.repeats), "bf16")
    rollout = {
        m: rollout_fn(base, m, prompts, args.new_tokens)
        for m in ROLLOUT_MODES + (() if args.no_fp4 else FP4_ROLLOUT_MODES)
    }
    roll_ratio = report("rollout: model.generate with KV cache", measure(rollout, args.repeats), "bf16")
    worst_train = max(v for k, v in train_ratio.items() if k in TRAIN_MODES)
    worst_roll = max(v for k, v in roll_ratio.items() if k in ROLLOUT_MODES)
    print(
        f"\nworst wall ratio: train {worst_train:.2f}x, rollout {worst_roll:.2f}x "
        f"(goal <= {GOAL}x: {'met' if max(worst_train, worst_roll) <= GOAL else 'NOT met'})"
    )
    if not args.no_fp4:
        fp4_train = {m: train_ratio[m] for m in FP4_TRAIN_MODES}
        fp4_roll = {m: roll_ratio[m] for m in FP4_ROLLOUT_MODES}
        print(
            "FP4 emulation wall ratio vs bf16: train "
            + ", ".join(f"{k} {v:.2f}x" for k, v in fp4_train.items())
            + "; rollout "
            + ", ".join(f"{k} {v:.2f}x" for k, v in fp4_roll.items())
            + f" (FP8 worst: train {worst_train:.2f}x, rollout {worst_roll:.2f}x)"
        )


if __name__ == "__main__":
    main()
