"""Precision modes: how the policy trains (BF16 / FP8) and how its rollout copy infers.

Training modes (``convert_for_training``, registry ``TRAIN_PRECISIONS``):

- ``bf16``: master weights float32, matmuls in BF16 under autocast.
- ``fp8_tensorwise`` / ``fp8_rowwise`` / ``fp8_blockwise``: the decoder's
  ``nn.Linear`` layers run their three matmuls in FP8 (``fp8rl_core.precision.fp8``);
  ``lm_head`` and the embeddings stay in high precision, master weights stay
  float32 and keep their parameter names, so ``state_dict()`` loads into a
  plain transformers model. Backends: torchao ``convert_to_float8_training`` on
  CUDA SM89+ (tensorwise, rowwise) and torchao's blockwise prototype on SM90;
  everywhere else (CPU, older GPUs, ``emulate=True``) our emulated
  ``Fp8TrainingLinear``, which reproduces torchao's emulated numbers (rowwise bit
  for bit, tensorwise up to one BF16 rounding per matmul) at 1.1-1.3x BF16 cost
  on a CPU, where torchao's own emulation costs 1.9-2.7x.
  Layers whose shape the real kernel cannot take are skipped, and the report
  says which and why; emulation skips the same layers, so a CPU run converts
  exactly what the GPU run would.

The BF16 shadow pass: ``with bf16_shadow(model):`` makes every converted linear
compute as a plain BF16 linear on the BF16 cast of the same master weights, so
under ``autocast_context`` the FP8 model computes the BF16-mode forward bit for
bit, on one process or under FSDP2 (float8 all-gather included). Calibrated
Clipping compares FP8 and BF16 log-probs through it (``fp8rl_core.precision.bf16_pass``).

Rollout modes are in ``fp8rl_core.precision.rollout``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fp8rl_core.host.quiet_imports import silence_torchao_import_noise
from fp8rl_core.precision.bf16_pass import CONVERTED
from fp8rl_core.precision.fp4 import MXFP4, NVFP4, FP4Format
from fp8rl_core.precision.fp4_linear import Fp4Recipe, Fp4State, Fp4TrainingLinear
from fp8rl_core.precision.fp8_linear import Fp8Recipe, Fp8TrainingLinear, SharedInputCache
from fp8rl_core.registry import Registry

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ConversionReport:
    """What ``convert_for_training`` did, layer by layer."""

    mode: str
    backend: str  # "none", "fp8rl-emulated", "torchao", "torchao-blockwise"
    emulate: bool
    converted: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]  # (layer name, reason)
    kept_high_precision: tuple[str, ...]  # lm_head and other output embeddings

    def summary(self) -> str:
        return (
            f"precision {self.mode}: backend={self.backend} emulate={self.emulate} "
            f"converted={len(self.converted)} skipped={len(self.skipped)} "
            f"high-precision={list(self.kept_high_precision)}"
        )


@dataclass(frozen=True)
class _TrainRequest:
    model: nn.Module
    mode: str
    device: torch.device
    emulate: bool | None
    round_scales_to_power_of_2: bool
    backend: str
    keep_high_precision: tuple[str, ...] = ()  # FP4: layer-name patterns kept in BF16 on purpose
    seed: int = 0  # FP4: seed of the stochastic-rounding generator and Hadamard signs


TRAIN_PRECISIONS: Registry[Callable[[_TrainRequest], ConversionReport]] = Registry("training precision mode")
_BACKENDS = ("auto", "emulated", "torchao")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def quiet_import_torchao_float8():
    """``import torchao.float8`` (lazily, only where FP8 via torchao is used) without its noise."""
    silence_torchao_import_noise()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao.float8 as float8
    return float8


silence_torchao_import_noise()


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _output_embedding_names(model: nn.Module) -> set[str]:
    """Names of modules that must stay high precision: the output embedding (lm_head),
    plus any linear whose weight is shared with an embedding (tied heads)."""
    keep: set[str] = set()
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, mod in model.named_modules():
        if mod is out_emb or (isinstance(mod, nn.Linear) and id(mod.weight) in emb_weights):
            keep.add(name)
    return keep


def _decoder_linears(model: nn.Module) -> tuple[list[tuple[str, nn.Module, str, nn.Linear]], list[str]]:
    """(name, parent, attribute, linear) of each plain nn.Linear to convert; and the kept names."""
    keep = _output_embedding_names(model)
    found = []
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, nn.Linear) and not getattr(child, CONVERTED, False) and name not in keep:
                found.append((name, parent, attr, child))
    return found, sorted(keep)


def _check_dims(lin: nn.Linear, multiple: int, *, allow_bias: bool, kernel: str) -> str | None:
    """Reason the kernel cannot take this layer, or None."""
    if lin.in_features % multiple or lin.out_features % multiple:
        return f"{kernel} needs in/out features divisible by {multiple}, layer is {lin.in_features}->{lin.out_features}"
    if not allow_bias and lin.bias is not None:
        return f"{kernel} does not support a bias"
    return None


def _ensure_fp32_master(model: nn.Module) -> None:
    """Master weights in float32 (a bf16-loaded checkpoint is upcast in place)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)


def _swap(found, make: Callable[[nn.Linear], nn.Module], reason: Callable[[nn.Linear], str | None]):
    """Replace each found linear by ``make(linear)`` unless ``reason`` names why the kernel cannot take it."""
    converted, skipped = [], []
    for name, parent, attr, lin in found:
        why = reason(lin)
        if why is not None:
            skipped.append((name, why))
            log.info("fp8: keeping %s in high precision: %s", name, why)
            continue
        new = make(lin)
        setattr(new, CONVERTED, True)
        setattr(parent, attr, new)
        converted.append(name)
    return tuple(converted), tuple(skipped)


# ---------------------------------------------------------------------------
# Training modes
# ---------------------------------------------------------------------------


def convert_for_training(
    model: nn.Module,
    mode: str,
    *,
    emulate: bool | None = None,
    round_scales_to_power_of_2: bool = False,
    backend: str = "auto",
    keep_high_precision: tuple[str, ...] = (),
    seed: int = 0,
    device: torch.device | None = None,
) -> ConversionReport:
    """Convert a transformers causal LM in place to train in ``mode``; returns the report.

    ``device``: where the model will train (default: where its parameters are now);
    a policy converted on the host before it is sharded onto the GPUs passes it.

    mode: one of ``TRAIN_PRECISIONS.names()``. emulate: None = emulate unless the
    model sits on a CUDA device with real FP8 (SM89+; SM90 for blockwise);
    False = require real FP8 kernels (error otherwise). backend: "auto" (above),
    "emulated" (always ours) or "torchao" (torchao even when emulating; slow on
    CPU, kept as a reference). keep_high_precision, seed: FP4 modes only
    (``fp8rl_core.precision.fp4_modes``). Create the optimizer before or after: parameters
    are the same objects.
    """
    convert = TRAIN_PRECISIONS.get(mode)
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(_BACKENDS)}")
    already = [n for n, m in model.named_modules() if getattr(m, CONVERTED, False)]
    if already:
        raise ValueError(f"model is already converted for FP8 training ({already[0]}, ...); convert a fresh model")
    _ensure_fp32_master(model)
    req = _TrainRequest(
        model,
        mode,
        device or _model_device(model),
        emulate,
        round_scales_to_power_of_2,
        backend,
        tuple(keep_high_precision),
        seed,
    )
    report = convert(req)
    log.info(report.summary())
    if report.skipped:  # grouped by reason: 192 names of a 32B model would bury the line
        from fp8rl_core.precision.layers import layer_precision, precision_line

        log.warning("%s", precision_line(layer_precision(model, report)))
    return report


@TRAIN_PRECISIONS.register("bf16")
def _train_bf16(req: _TrainRequest) -> ConversionReport:
    _, keep = _decoder_linears(req.model)
    return ConversionReport(req.mode, "none", False, (), (), tuple(keep))


def _emulated(lin: nn.Linear, recipe: Fp8Recipe, cache: SharedInputCache) -> Fp8TrainingLinear:
    new = Fp8TrainingLinear.from_linear(lin, recipe)
    new.input_cache = cache  # one per model: sibling projections quantize their shared input once
    return new


def _resolve_emulate(req: _TrainRequest, min_capability: tuple[int, int]) -> bool:
    cap = _cuda_capability(req.device)
    has_hw = cap is not None and cap >= min_capability
    if req.emulate is False and not has_hw:
        found = f"CUDA capability {cap}" if cap else f"device {req.device}"
        raise ValueError(
            f"precision {req.mode!r} with emulate=False needs a CUDA GPU with "
            f"SM{min_capability[0]}{min_capability[1]}+, "
            f"found {found}; pass emulate=None (auto) or True"
        )
    return not has_hw if req.emulate is None else req.emulate


def _train_scaled(req: _TrainRequest, granularity: str) -> ConversionReport:
    """tensorwise / rowwise: torchao on real FP8 hardware, our emulated linear elsewhere."""
    emulate = _resolve_emulate(req, (8, 9))
    found, keep = _decoder_linears(req.model)
    # torch._scaled_mm needs dims divisible by 16; emulation mirrors that, so CPU and GPU convert the same layers
    reason = lambda lin: _check_dims(lin, 16, allow_bias=True, kernel="torch._scaled_mm")  # noqa: E731
    use_torchao = req.backend == "torchao" or (req.backend == "auto" and not emulate)
    if not use_torchao:
        recipe = Fp8Recipe.named(granularity, round_scales_to_power_of_2=req.round_scales_to_power_of_2)
        cache = SharedInputCache()
        converted, skipped = _swap(found, lambda lin: _emulated(lin, recipe, cache), reason)
        return ConversionReport(req.mode, "fp8rl-emulated", emulate, converted, skipped, tuple(keep))
    float8 = quiet_import_torchao_float8()
    config = float8.Float8LinearConfig.from_recipe_name(granularity)
    pow2 = config.round_scales_to_power_of_2 or req.round_scales_to_power_of_2
    config = dataclasses.replace(config, emulate=emulate, round_scales_to_power_of_2=pow2)
    from torchao.float8.float8_linear import Float8Linear

    converted, skipped = _swap(found, lambda lin: Float8Linear.from_float(lin, config=config), reason)
    return ConversionReport(req.mode, "torchao", emulate, converted, skipped, tuple(keep))


@TRAIN_PRECISIONS.register("fp8_tensorwise")
def _train_tensorwise(req: _TrainRequest) -> ConversionReport:
    return _train_scaled(req, "tensorwise")


@TRAIN_PRECISIONS.register("fp8_rowwise")
def _train_rowwise(req: _TrainRequest) -> ConversionReport:
    return _train_scaled(req, "rowwise")


@TRAIN_PRECISIONS.register("fp8_blockwise")
def _train_blockwise(req: _TrainRequest) -> ConversionReport:
    """DeepSeek-V3 blockwise: torchao's prototype on SM90, our emulation elsewhere."""
    emulate = _resolve_emulate(req, (9, 0))
    found, keep = _decoder_linears(req.model)
    # torchao's blockwise kernels take 128-multiples and no bias; emulation mirrors that
    reason = lambda lin: _check_dims(lin, 128, allow_bias=False, kernel="torchao blockwise FP8")  # noqa: E731
    if req.backend == "torchao" and emulate:
        raise ValueError("torchao's blockwise FP8 prototype has no emulation; use backend='auto' or 'emulated'")
    if emulate or req.backend == "emulated":
        recipe = Fp8Recipe.named("blockwise", round_scales_to_power_of_2=req.round_scales_to_power_of_2)
        cache = SharedInputCache()
        converted, skipped = _swap(found, lambda lin: _emulated(lin, recipe, cache), reason)
        return ConversionReport(req.mode, "fp8rl-emulated", True, converted, skipped, tuple(keep))
    quiet_import_torchao_float8()
    try:
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear
    except ImportError as e:  # its kernels are Triton kernels
        raise RuntimeError(
            f"torchao's blockwise FP8 training needs Triton ({e}); pass emulate=True to emulate it"
        ) from e

    converted, skipped = _swap(found, Float8BlockwiseLinear.from_float, reason)
    return ConversionReport(req.mode, "torchao-blockwise", False, converted, skipped, tuple(keep))


# --------------------------------------------------------------------------- FP4 modes (emulated)


FP4_TRAIN_MODES = {"nvfp4": NVFP4, "mxfp4": MXFP4}


def fp4_shape_problem(lin: nn.Linear, fmt: FP4Format) -> str | None:
    """Why ``fmt``'s training recipe cannot take this linear, or None."""
    b = fmt.block
    if lin.in_features % b or lin.out_features % b:
        return (
            f"{fmt.name} training needs in and out features divisible by {b} ({b}x{b} weight tiles, "
            f"1x{b} activation blocks), layer is {lin.in_features}->{lin.out_features}"
        )
    return None


def _train_fp4(req: _TrainRequest, fmt: FP4Format) -> ConversionReport:
    if req.emulate is False:
        raise ValueError(
            f"precision {req.mode!r}: no real FP4 kernels are wired (emulation only); pass emulate=None or True"
        )
    found, keep = _decoder_linears(req.model)
    patterns = tuple(getattr(req, "keep_high_precision", ()) or ())
    listed = [f for f in found if any(fnmatch.fnmatchcase(f[0], p) for p in patterns)]
    todo = [f for f in found if f not in listed]
    bad = [(name, why) for name, _, _, lin in todo if (why := fp4_shape_problem(lin, fmt)) is not None]
    if bad:
        name, why = bad[0]
        raise ValueError(
            f"precision {req.mode!r}: layer {name}: {why}; list it in precision.keep_high_precision "
            f"to keep it in BF16 ({len(bad)} layer(s) affected)"
        )
    state = Fp4State(getattr(req, "seed", 0))
    recipe = Fp4Recipe(fmt)
    converted, _ = _swap(todo, lambda lin: Fp4TrainingLinear.from_linear(lin, recipe, state), lambda lin: None)
    skipped = tuple((name, "listed in precision.keep_high_precision") for name, *_ in listed)
    return ConversionReport(req.mode, "fp8rl-emulated-fp4", True, converted, skipped, tuple(keep))


for _mode, _fmt in FP4_TRAIN_MODES.items():
    TRAIN_PRECISIONS.register(_mode)(lambda req, _fmt=_fmt: _train_fp4(req, _fmt))
