"""The FP4 training emulation of this checkout against another's, interleaved in one process.

One stress-world micro-batch (the ``stress-cpu`` model: 2 layers, 128 wide, MLP 384; 32
sequences x 60 tokens) forward + backward in emulated NVFP4 or MXFP4 training, the way the
train stage runs it (``policy_logprobs`` under ``precision.cpu_bf16_gemm: fp32``, BF16
autocast, one torch thread). The other checkout's ``fp8rl_core/precision/fp4.py`` and ``fp4_linear.py``
are loaded beside this one's, the model's FP4 linears switched between the two, and the
passes alternate (other, this, other, ...) so that load changes hit both alike. Before timing,
both compute one pass from the same generator state and the log-probs and every gradient are
compared bit for bit. Figures, not a test:

    python benchmarks/fp4_emulation.py --against /path/to/older/checkout [--fmt nvfp4] [--rounds 9]
        [--keep-freed-memory]

``--keep-freed-memory``: the allocator setting of ``fp8rl`` (``fp8rl_core.host.cpu_malloc``), for both.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path


def _load(name: str, path: Path, replace: tuple[str, str] | None = None):
    src = path.read_text()
    if replace:
        src = src.replace(*replace)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = mod
    exec(compile(src, str(path), "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", type=Path, required=True, help="root of the checkout to compare with")
    ap.add_argument("--fmt", choices=("nvfp4", "mxfp4"), default="nvfp4")
    ap.add_argument("--rounds", type=int, default=9, help="timed passes per side")
    ap.add_argument("--keep-freed-memory", action="store_true", help="fp8rl's allocator setting, both sides")
    args = ap.parse_args()
    other = args.against / "fp8rl_core"
    if not (other / "fp4.py").is_file() or not (other / "fp4_linear.py").is_file():
        print(f"error: {args.against} has no fp8rl_core/precision/fp4.py and fp4_linear.py", file=sys.stderr)
        sys.exit(2)
    from fp8rl_core.host.cpu_env import pin_cpu_numerics

    pin_cpu_numerics()
    if args.keep_freed_memory:
        from fp8rl_core.host.cpu_malloc import keep_freed_memory

        keep_freed_memory()
    _load("fp4_other", other / "fp4.py")
    old = _load(
        "fp4_linear_other", other / "fp4_linear.py", ("from fp8rl_core.precision.fp4 import", "from fp4_other import")
    )
    compare(old.Fp4TrainingLinear, args.fmt, args.rounds)


def compare(other_cls, fmt: str, rounds: int) -> None:
    import torch

    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.cpu_numerics.cpu_gemm import cpu_bf16_gemm
    from fp8rl_core.precision.conversion import convert_for_training, fp4_linear
    from fp8rl_core.tasks.tiny_model import build_tiny_model
    from stages.trainer.forward import ForwardSpec, policy_logprobs

    torch.set_num_threads(1)
    model = build_tiny_model(ModelConfig(num_layers=2, intermediate_size=384))
    convert_for_training(model, fmt, emulate=True)
    model.train()
    ids = torch.randint(3, 40, (32, 60), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    linears = [m for m in model.modules() if isinstance(m, fp4_linear.Fp4TrainingLinear)]
    state = linears[0].fp4_state
    start = state.generator.get_state()

    def step(cls) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for m in linears:
            m.__class__ = cls
        state.generator.set_state(start)
        lp, _ = policy_logprobs(model, ids, mask, ForwardSpec(fmt, with_entropy=True))
        lp.sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return lp.detach(), grads

    this_cls = fp4_linear.Fp4TrainingLinear
    with cpu_bf16_gemm("fp32"):
        (lo, go), (ln, gn) = step(other_cls), step(this_cls)
        same = torch.equal(lo, ln) and all(torch.equal(a, b) for a, b in zip(go, gn))
        times: dict[str, list[float]] = {"other": [], "this": []}
        for _ in range(rounds):
            for side, cls in (("other", other_cls), ("this", this_cls)):
                c0 = time.process_time()
                step(cls)
                times[side].append(time.process_time() - c0)
    o, n = statistics.median(times["other"]), statistics.median(times["this"])
    print(f"bit-identical (log-probs and every gradient): {same}")
    print(f"{fmt} micro-batch 32 x 60 forward + backward, CPU s, medians of {rounds}:")
    print(f"  other {o:.3f}   this {n:.3f}   other / this {o / n:.2f}")


if __name__ == "__main__":
    main()
