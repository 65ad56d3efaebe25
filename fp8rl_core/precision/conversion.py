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

Rollout modes (``convert_for_rollout``, registry ``ROLLOUT_PRECISIONS``): a BF16
inference copy of the policy for CPU generation, whose decoder linears are
``bf16``, or W8A8 ``fp8_per_tensor`` / ``fp8_per_block`` like vLLM's online FP8.
``sync_rollout_weights`` refreshes the copy from the trainer every RL step
(FP8 weights are re-quantized there, once per sync, not per forward).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import fnmatch
import logging
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fp8rl_core.host.quiet_imports import silence_torchao_import_noise  # noqa: F401  (re-exported)
from fp8rl_core.precision.bf16_pass import (  # noqa: F401  (re-exported: the BF16 pass of a converted policy)
    CONVERTED,
    bf16_parameters,
    bf16_recompute_checkpointing,
    bf16_shadow,
    enable_activation_checkpointing,
)
from fp8rl_core.precision.fp4 import MXFP4, NVFP4, FP4Format
from fp8rl_core.precision.fp4_linear import Fp4Recipe, Fp4RolloutLinear, Fp4State, Fp4TrainingLinear
from fp8rl_core.precision.fp8_linear import Fp8Recipe, Fp8RolloutLinear, Fp8TrainingLinear, SharedInputCache
from fp8rl_core.registry import Registry

log = logging.getLogger(__name__)

_CONVERTED = CONVERTED  # marker attribute on every linear we converted for training


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
ROLLOUT_PRECISIONS: Registry[Callable[[nn.Linear], nn.Module]] = Registry("rollout precision mode")
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
            if isinstance(child, nn.Linear) and not getattr(child, _CONVERTED, False) and name not in keep:
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
        setattr(new, _CONVERTED, True)
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
    already = [n for n, m in model.named_modules() if getattr(m, _CONVERTED, False)]
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


def autocast_context(mode: str, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
    """The autocast every mode computes under: BF16 on ``device``'s type (cpu or cuda).

    FP8 modes need it too: the non-converted ops (attention, lm_head) run in BF16,
    and the FP8 linears take their output dtype from it.
    """
    if mode not in TRAIN_PRECISIONS and mode not in ROLLOUT_PRECISIONS:
        valid = sorted(set(TRAIN_PRECISIONS.names()) | set(ROLLOUT_PRECISIONS.names()))
        raise KeyError(f"unknown precision mode {mode!r}; valid: {', '.join(valid)}")
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------
# Rollout modes
# ---------------------------------------------------------------------------


@ROLLOUT_PRECISIONS.register("bf16")
def _rollout_bf16(lin: nn.Linear) -> nn.Module:
    new = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
    new.weight, new.bias = lin.weight, lin.bias  # values are refreshed by sync_rollout_weights
    return new


@ROLLOUT_PRECISIONS.register("fp8_per_tensor")
def _rollout_fp8_per_tensor(lin: nn.Linear) -> nn.Module:
    return Fp8RolloutLinear(lin.in_features, lin.out_features, scheme="per_tensor")


@ROLLOUT_PRECISIONS.register("fp8_per_block")
def _rollout_fp8_per_block(lin: nn.Linear) -> nn.Module:
    return Fp8RolloutLinear(lin.in_features, lin.out_features, scheme="per_block")


def convert_for_rollout(
    model: nn.Module, mode: str, *, dtype: torch.dtype = torch.bfloat16, weight_format: str = "bf16"
) -> nn.Module:
    """An inference copy of ``model`` for generation in ``mode`` (``ROLLOUT_PRECISIONS``).

    The copy holds ``dtype`` weights, is in eval mode without grads, and its
    decoder linears (not lm_head) are plain linears (``bf16``) or W8A8 FP8 linears
    (``Fp8RolloutLinear``). Like ``nn.Linear``, those compute in the autocast dtype
    under ``autocast_context`` and in ``dtype`` otherwise: a float32 copy under
    autocast has the trainer's BF16-mode numerics, a BF16 copy keeps the whole
    residual stream in BF16 like vLLM. Works on BF16 or FP8-converted training
    models, which it leaves untouched (gradients are not copied). The copy is made
    once; refresh it each step with ``sync_rollout_weights``.

    ``weight_format`` is how the weights travel to the engine (``rollout.weight_format``,
    :data:`WEIGHT_FORMATS`): ``bf16`` (the default; what a GPU engine receives today)
    rounds each quantized linear's weight to BF16 before the engine's own quantization;
    ``native_fp8`` quantizes the trainer's fp32 master weights on the engine's grid
    directly, as the trainer does when it sends FP8 values and their scales.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    if weight_format == "native_fp8" and mode not in FP8_ROLLOUT_MODES:
        raise ValueError(f"weight_format 'native_fp8' needs an FP8 rollout mode {FP8_ROLLOUT_MODES}, got {mode!r}")
    make = ROLLOUT_PRECISIONS.get(mode)
    grads = {id(p): p.grad for p in model.parameters()}
    for p in model.parameters():  # do not deep-copy gradients
        p.grad = None
    try:
        rollout = copy.deepcopy(model)
    finally:
        for p in model.parameters():
            p.grad = grads[id(p)]
    for mod in rollout.modules():  # a copy made inside bf16_shadow must not keep the patched forwards
        if getattr(mod, _CONVERTED, False):
            mod.__dict__.pop("forward", None)
    keep = _output_embedding_names(rollout)
    for parent_name, parent in list(rollout.named_modules()):
        for attr, child in list(parent.named_children()):
            name = f"{parent_name}.{attr}" if parent_name else attr
            if isinstance(child, nn.Linear) and name not in keep:
                setattr(parent, attr, make(child))
    cache = SharedInputCache()  # sibling projections quantize their shared input once
    for mod in rollout.modules():
        if isinstance(mod, Fp8RolloutLinear):
            mod.input_cache = cache
    rollout.to(dtype)
    rollout.eval().requires_grad_(False)
    rollout._fp8rl_rollout_mode = mode
    rollout._fp8rl_weight_format = weight_format
    sync_rollout_weights(rollout, model)
    return rollout


@torch.no_grad()
def sync_rollout_weights(rollout_model: nn.Module, train_model: nn.Module) -> None:
    """Copy the trainer's current weights into the rollout copy (in place, no re-allocation
    of the model); FP8 rollout linears re-quantize their weight here, once per sync.

    The quantized linears see the weights as the copy's ``weight_format`` says they
    travel (``convert_for_rollout``): rounded to BF16 first (``bf16``), or the fp32
    masters themselves (``native_fp8``)."""
    source = train_model.state_dict()
    as_sent = _as_sent(getattr(rollout_model, "_fp8rl_weight_format", "bf16"))
    missing = []
    dtype = rollout_model_dtype(rollout_model)
    for group in fused_rollout_groups(rollout_model):
        names = [name for name, _ in group]
        weights = [source.get(f"{name}.weight") for name in names]
        if any(w is None for w in weights):
            missing += [f"{n}.weight" for n, w in zip(names, weights) if w is None]
            continue
        Fp8RolloutLinear.refresh_fused(
            [mod for _, mod in group],
            [as_sent(w) for w in weights],
            [source.get(f"{name}.bias") for name in names],
            dtype=dtype,
        )
    for name, mod in rollout_model.named_modules():  # FP4 W4A4 layers: one block-scaled weight each
        if isinstance(mod, Fp4RolloutLinear):
            w = source.get(f"{name}.weight")
            if w is None:
                missing.append(f"{name}.weight")
                continue
            mod.refresh_weight(as_sent(w), source.get(f"{name}.bias"), dtype=dtype)
    for name, p in rollout_model.named_parameters():
        src = source.get(name)
        if src is None:
            missing.append(name)
            continue
        if src.shape != p.shape:
            raise ValueError(
                f"sync_rollout_weights: {name} has shape {tuple(src.shape)} in the trainer, "
                f"{tuple(p.shape)} in the rollout copy"
            )
        p.copy_(src)
    if missing:
        raise KeyError(
            f"sync_rollout_weights: the training model lacks {missing[:5]} (of {len(missing)}); "
            "was the rollout copy made from another architecture?"
        )


WEIGHT_FORMATS: tuple[str, ...] = ("bf16", "native_fp8")
"""How trained weights reach the rollout engine (``rollout.weight_format``)."""
FP8_ROLLOUT_MODES: tuple[str, ...] = ("fp8_per_tensor", "fp8_per_block")
"""Rollout modes whose engine can load FP8 values with their scales (``native_fp8``)."""


def _as_sent(weight_format: str):
    """The weight a quantized rollout linear quantizes, given how weights travel to the engine.

    ``bf16``: the engine gets BF16 weights and quantizes those (vLLM's online FP8 on a GPU
    today), so the trainer's fp32 masters are rounded to BF16 first; ``native_fp8``: the
    trainer quantizes its fp32 masters on the engine's grid and sends the FP8 values.
    """
    if weight_format == "native_fp8":
        return lambda w: w
    return lambda w: w.detach().to(torch.bfloat16).to(w.dtype)


FUSED_PROJECTIONS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections vLLM fuses into one layer (``qkv_proj``, ``gate_up_proj``), in its order."""


def fused_rollout_groups(model: nn.Module) -> list[list[tuple[str, Fp8RolloutLinear]]]:
    """The FP8 rollout linears of ``model`` grouped as vLLM fuses them; other linears alone.

    A group is ``[(name, module), ...]`` in fused order (q, k, v / gate, up).
    """
    groups: list[list[tuple[str, Fp8RolloutLinear]]] = []
    for parent_name, parent in model.named_modules():
        children = {attr: mod for attr, mod in parent.named_children() if isinstance(mod, Fp8RolloutLinear)}
        prefix = f"{parent_name}." if parent_name else ""
        for members in FUSED_PROJECTIONS:
            if all(m in children for m in members):
                groups.append([(prefix + m, children.pop(m)) for m in members])
        groups += [[(prefix + attr, mod)] for attr, mod in children.items()]
    return groups


def rollout_model_dtype(model: nn.Module) -> torch.dtype:
    """Floating dtype of a rollout copy's weights (BF16 unless made otherwise)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.bfloat16


# FP4 modes (nvfp4 / mxfp4 training, *_w4a4 rollout) register themselves in the registries above.


# --------------------------------------------------------------------------- FP4 modes (emulated)


FP4_TRAIN_MODES = {"nvfp4": NVFP4, "mxfp4": MXFP4}
FP4_ROLLOUT_MODES = {"nvfp4_w4a4": NVFP4, "mxfp4_w4a4": MXFP4}


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

for _mode, _fmt in FP4_ROLLOUT_MODES.items():
    ROLLOUT_PRECISIONS.register(_mode)(
        lambda lin, _fmt=_fmt: Fp4RolloutLinear(lin.in_features, lin.out_features, fmt=_fmt)
    )
