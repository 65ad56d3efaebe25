"""``python gpu_check/main.py --cpu``: every section of the GPU check run on the CPU, as a rehearsal.

Each section runs the same code as on the GPU, in a process of its own under its
own deadline (``gpu_check/section_process.py``), with three substitutions:

- **FP8 kernels emulated.** Where the GPU runs torchao's real float8 kernels,
  the rehearsal runs torchao's own float8 training modules with
  ``emulate=True`` (tensorwise, rowwise: the same ``Float8Linear`` and scaling
  code, the matmul done in high precision); torchao's blockwise prototype has
  no emulation (its kernels are Triton), so blockwise runs the project's
  emulation (``backend="emulated"``). Section 2's "real" side is therefore
  torchao's emulation against the project's.
- **Tiny shapes.** A Qwen3 of 2 layers at width 128 (4 heads of 32, MLP 256,
  vocabulary 256): every linear a multiple of 128, so blockwise converts
  every projection as on the GPU.
- **vLLM's CPU build** for section 5 where ``import vllm`` succeeds (2 layers
  at width 128, no sleep mode on CPU); elsewhere the section says it skipped
  and why, as it does on a GPU machine without vLLM.

The GPU's rules stay on where they matter: the kernels' shape contracts
(conversion refuses what torchao's kernels refuse, and every section runs the
emulation's strict shape checks, ``FP8RL_STRICT_FP8_SHAPES=1``: a token count a
kernel would refuse is an error here too), BF16 autocast around every FP8 forward, the fp32 master
weights, and one process per section with its deadline enforced inside it.
``precision.compile: auto`` keeps the CPU eager, so section 4's compiled
blocks are not rehearsed here.

What it proves is that the code paths run; its figures are CPU figures of
emulated kernels, not GPU measurements, and its report says so.
"""

from __future__ import annotations

import os
from typing import Callable

# Wall-time ceilings on a shared 2-core machine, where starting a section (torch, transformers, torchao)
# can take a minute of waiting; the whole rehearsal takes about 35 s of CPU time.
CPU_TOTAL_BUDGET_S = 600.0
CPU_SECTION_BUDGETS_S = {
    "[1] train-step throughput": 150.0,
    "[2] kernel vs emulation SQNR": 120.0,
    "[3] rollout numerics": 120.0,
    "[4] trainer step": 150.0,
    "[5] vLLM cycle": 240.0,
}
# torchao's float8 training modules have an emulated mode; its blockwise prototype has none
CPU_BACKENDS = {"fp8_tensorwise": "torchao", "fp8_rowwise": "torchao", "fp8_blockwise": "emulated"}
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=32,
    num_hidden_layers=2,
    vocab_size=256,
)
TINY_VLLM = dict(TINY, vocab_size=1024, tie_word_embeddings=True)  # the tokenizer's ids need the room
LABEL = "tiny (width 128)"
HEADER = (
    "gpu-check --cpu: the GPU check's code on the CPU with emulated FP8 kernels (torchao emulate=True; the "
    "project's emulation for blockwise) and vLLM's CPU build where it imports, at tiny shapes. It shows the "
    "code paths run; no figure below is a GPU measurement."
)


def emit(line: str) -> None:
    print(line, flush=True)


def strict_shapes() -> None:
    """The emulation's strict kernel shape checks on in this process (the shapes torchao's kernels refuse)."""
    from fp8rl_core.precision.fp8_linear import set_strict_shapes

    os.environ["FP8RL_STRICT_FP8_SHAPES"] = "1"
    set_strict_shapes(True)


def tiny_config(**overrides):
    """A config of :data:`TINY` shapes, untied, with transformers' context length and no special tokens."""
    from fp8rl_core.tasks.tiny_config import tiny_qwen3_config

    hf_defaults = dict(max_position_embeddings=32768, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return tiny_qwen3_config(**{**TINY, **hf_defaults, "tie_word_embeddings": False, **overrides})


def tiny_policy(device):
    """The train-step section's policy at :data:`TINY` shapes, fp32 masters (as the trainer holds them)."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_config(tie_word_embeddings=True)).to(device=device, dtype=torch.float32)


def emulated_convert(model, mode: str):
    """``mode``'s conversion with torchao's modules in emulation (blockwise: the project's emulation)."""
    from fp8rl_core.precision.conversion import convert_for_training

    report = convert_for_training(model, mode, emulate=True, backend=CPU_BACKENDS[mode])
    if not report.converted:
        raise RuntimeError(f"{mode}: no linear converted at the rehearsal's shapes ({report.skipped[:2]})")
    return report


def cpu_sections(throughput, sqnr, rollout) -> dict[str, Callable[[float], None]]:
    """The rehearsal's ``name -> fn(deadline)``: sections 1-3 are the GPU check's own functions (passed in by
    ``gpu_check.main``, which imports this module) called at tiny shapes with emulated kernels."""

    def cpu_throughput(deadline: float) -> None:
        throughput(
            deadline,
            layers=2,
            iters=1,
            warmup=0,
            models={"tiny": tiny_config()},
            tokens_list=(128,),  # blockwise's weight gradient contracts over the tokens: a multiple of 128
            device="cpu",
            convert=emulated_convert,
        )

    def cpu_sqnr(deadline: float) -> None:
        sqnr(
            deadline,
            tokens=32,
            config=tiny_config(num_hidden_layers=1),
            real_device="cpu",
            convert_real=emulated_convert,
            label=LABEL,
        )
        emit("    on CPU 'real' is torchao's float8 modules in emulation (blockwise: the project's emulation on both)")

    def cpu_rollout(deadline: float) -> None:
        rollout(seqs=2, length=16, config=tiny_config(), device="cpu", label=LABEL)

    return dict(zip(CPU_SECTION_BUDGETS_S, (cpu_throughput, cpu_sqnr, cpu_rollout, cpu_train_step, cpu_vllm)))


def cpu_train_step(deadline: float) -> None:
    import torch

    from gpu_check.train_step import _batch, run_modes

    emit("[4] sharded trainer step (gpu_check/train_step.py), on CPU with emulated kernels")
    device = torch.device("cpu")
    batch = _batch(device, n=8, p=8, r=16, vocab=TINY["vocab_size"])
    run_modes(emit, device, batch, deadline=deadline, build=tiny_policy, convert=emulated_convert)


def cpu_vllm(deadline: float) -> None:
    from gpu_check.vllm_cycle import run

    run(emit, device="cpu", shapes=TINY_VLLM)


def rehearsal_status(status: dict[str, int | None], budgets: dict[str, float]) -> int:
    """0 when every section's process ran to its end (exit status 0), 1 otherwise (stopped, killed, crashed
    or skipped)."""
    return 0 if len(status) == len(budgets) and all(rc == 0 for rc in status.values()) else 1
