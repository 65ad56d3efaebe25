"""``torch.compile`` of the decoder blocks, where torchao's float8 recipes expect it.

torchao's ``Float8Linear`` (tensorwise and rowwise) computes its dynamic scales and
casts with ordinary PyTorch ops (amax, divide, clamp, cast: several passes over
each operand) and leaves their fusion into one or two kernels to inductor; its
README measures the recipes under ``torch.compile``, and torchtitan compiles them
so. ``precision.compile`` chooses (:func:`compile_choice`):

* ``auto`` (default): compile on CUDA when the linears are torchao's
  ``Float8Linear``; eager everywhere else: on the CPU (the tests, the emulation:
  the emulated linears are hand-chunked loops that compile would only slow and
  graph-break), for torchao's blockwise prototype (its quantization kernels are
  Triton kernels already) and for bf16;
* ``on``: compile whatever the device and backend;
* ``off``: eager.

:func:`compile_decoder_blocks` compiles each decoder block in place
(``nn.Module.compile``), as torchtitan compiles each transformer block: the blocks
share one compiled frame (parameters are graph inputs), and the embeddings, the
lm_head and the chunked log-softmax stay eager. In place, so the module tree and
every parameter's name stay as they are (checkpoints, the weight sync, the
calibration's hooks). Called after activation checkpointing is switched on and
before ``fully_shard``, torchtitan's order. torchtitan wraps each block, so
FSDP2's hooks land on the wrapper, outside the compiled frame; compiled in place,
the block's hooks run inside its compiled call, where FSDP2's (marked
``_dynamo_disable`` in torch's FSDP2) run eagerly between graphs. Nothing here
has run on a GPU (as of 2026-12-02).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from stages.trainer.distributed import decoder_blocks

SETTINGS = ("auto", "on", "off")
# ConversionReport.backend of the linears whose recipes torchao runs under torch.compile
COMPILED_BACKENDS = ("torchao",)
_EAGER_WHY = {
    "none": "bf16: no FP8 casts to fuse",
    "fp8rl-emulated": "the emulated linears are hand-chunked loops, written for eager",
    "fp8rl-emulated-fp4": "the emulated linears are hand-chunked loops, written for eager",
    "torchao-blockwise": "torchao's blockwise prototype quantizes in Triton kernels of its own, not custom ops "
    "torch.compile can trace",
}


@dataclass(frozen=True)
class CompileChoice:
    """Whether the decoder blocks run compiled, and why (``run.json``'s ``layer_precision.compile``)."""

    setting: str
    enabled: bool
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        how = "torch.compile per decoder block" if self.enabled else "eager"
        return f"{how} (precision.compile {self.setting}: {self.reason})"


def compile_choice(setting: str, device: torch.device | str, backend: str) -> CompileChoice:
    """Resolve ``precision.compile`` for a policy training on ``device`` with linears of ``backend``
    (``ConversionReport.backend``: "none", "fp8rl-emulated", "torchao", "torchao-blockwise")."""
    if setting not in SETTINGS:
        raise ValueError(f"precision.compile must be one of {', '.join(SETTINGS)}; got {setting!r}")
    if setting == "on":
        return CompileChoice(setting, True, "asked for")
    if setting == "off":
        return CompileChoice(setting, False, "asked for")
    dev = torch.device(device)
    if dev.type != "cuda":
        return CompileChoice(setting, False, f"{dev.type}: eager is the default off CUDA")
    if backend not in COMPILED_BACKENDS:
        return CompileChoice(setting, False, _EAGER_WHY.get(backend, f"backend {backend}"))
    return CompileChoice(setting, True, f"backend {backend} on CUDA: torchao's Float8Linear casts fuse under inductor")


def gpu_backend(mode: str) -> str:
    """The ``ConversionReport.backend`` a policy training in ``mode`` gets on a GPU with real kernels
    (``precision.emulate: false``): what ``fp8rl plan`` resolves ``precision.compile`` against."""
    from fp8rl_core.config.precision_kinds import PRECISION_MODES

    return PRECISION_MODES.get(mode).gpu_backend  # FP4: emulated everywhere


def compile_decoder_blocks(model: nn.Module, *, backend: str = "inductor") -> int:
    """Compile every decoder block of ``model`` in place (``nn.Module.compile``); returns how many.

    A checkpointed block compiles its checkpoint as a higher-order op over the block's graph,
    whose inputs include the parameters as the forward read them (in one process, the bf16
    casts of ``bf16_parameters``), and the recomputation reads those: the eager recompute
    context of ``fp8rl_core.precision.bf16_pass.recompute_like_forward`` is not needed there, and
    being bound to each block, it would make every block recompile; the blocks go back to the
    one plain checkpoint function transformers gave them all.
    """
    blocks = decoder_blocks(model)
    if any(getattr(b, "gradient_checkpointing", False) for b in blocks):
        _trace_checkpoints_whole()
    for block in blocks:
        plain = getattr(block, "_plain_checkpointing_func", None)
        if plain is not None:  # see the docstring: the checkpoint is recomputed inside the compiled graph
            block._gradient_checkpointing_func = plain
        block.compile(backend=backend)
    return len(blocks)


def _trace_checkpoints_whole() -> None:
    """Let dynamo capture a checkpointed block whose forward sets and resets Python state.

    transformers' attention (with the ``kernels`` package its releases from 5.25 install)
    records its kernel functions in a global for the length of each call, set on entry and
    reset on exit. Dynamo refuses a side effect inside the checkpoint's higher-order op
    unless told not to replay it in the recomputation; refused, it runs the checkpoint
    eagerly, where an unsharded model's recomputation reads the fp32 masters instead of the
    bf16 casts its forward read (``torch.utils.checkpoint`` then stops the backward). A
    balanced set-and-reset leaves nothing to replay, so the capture is exact; the setting
    is process-wide and touches only checkpoints under ``torch.compile``.
    """
    import torch._dynamo.config as dynamo_config

    if hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def is_compiled(block: nn.Module) -> bool:
    """Whether ``block`` runs through a compiled call (``nn.Module.compile``)."""
    return getattr(block, "_compiled_call_impl", None) is not None


__all__ = [
    "COMPILED_BACKENDS",
    "SETTINGS",
    "CompileChoice",
    "compile_choice",
    "compile_decoder_blocks",
    "gpu_backend",
    "is_compiled",
]
