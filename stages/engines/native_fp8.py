"""FP8 weights sent as FP8 (``rollout.weight_format: native_fp8``): the trainer quantizes, the engine loads.

With ``weight_format: bf16`` (the default) the engine receives BF16 weights and quantizes
them itself, so the FP8 values it samples with come from the trainer's fp32 masters
rounded twice: to BF16, then to the engine's FP8 grid. Here the trainer quantizes its
fp32 masters on the engine's grid once (the fused q/k/v and gate/up layers vLLM builds,
vLLM's scale arithmetic: :func:`fp8rl_core.precision.fp8.amax_to_qscale` ``rule="vllm"``) and sends
the FP8 values with their scales, in vLLM's layout for FP8-serialized checkpoints
(``quant_method: fp8``, dynamic activation scales):

* ``fp8_per_tensor``: ``<linear>.weight`` float8_e4m3fn ``[N, K]`` and
  ``<linear>.weight_scale`` float32 ``[]`` (the dequantization scale). The members of a
  fused layer get the fused layer's one scale; vLLM loads the members' scales and
  re-quantizes every shard to their maximum (``requantize_with_max_scale``), which for
  equal scales gives back the values sent.
* ``fp8_per_block``: ``<linear>.weight`` float8_e4m3fn ``[N, K]`` and
  ``<linear>.weight_scale_inv`` float32 ``[ceil(N/128), ceil(K/128)]`` (the dequantization
  scale of each 128 x 128 block, DeepSeek-V3's name, ``weight_block_size: [128, 128]``).
  vLLM requires every member's rows to be whole blocks; then the fused layer's blocks are
  the members' blocks, and quantizing one is quantizing the other.

Every other tensor (embeddings, norms, biases, the output head) travels as BF16.

:func:`stream_native_fp8_weights` builds the payload one fused layer at a time (an FSDP2
shard is gathered in fp32 for it, a collective: every rank iterates together);
:func:`load_native_fp8` is the engine side of the CPU emulation (the transformers
engine's inference copy takes the values and scales as they are, no re-quantization);
:func:`vllm_native_fp8_options` are the ``vllm.LLM`` settings for such a checkpoint, and
:func:`write_native_fp8_checkpoint` writes the one the engine starts from.
The vLLM side is written against vLLM 0.33's FP8 loader and has not run on a GPU (vLLM's
CPU build has no FP8 kernels).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from fp8rl_core.config.precision_kinds import PRECISION_MODES
from fp8rl_core.precision.conversion import _output_embedding_names
from fp8rl_core.precision.fp8 import E4M3
from fp8rl_core.precision.fp8_linear import Fp8RolloutLinear
from fp8rl_core.precision.fp8_operands import RoundSpec, _grouped, _round_whole, quantize_operand
from fp8rl_core.precision.rollout import FP8_ROLLOUT_MODES, FUSED_PROJECTIONS
from stages.engines.weight_transfer import full_parameter, is_tied

BLOCK = 128


def _granularity(mode: str) -> str | None:
    """The scale's reach of an FP8 rollout mode (tensor, block); None for any other mode."""
    m = PRECISION_MODES.get(mode) if mode in PRECISION_MODES else None
    return m.granularity if m is not None and m.family == "fp8" and m.rolls_out else None


SCALE_NAME = {"tensor": "weight_scale", "block": "weight_scale_inv"}  # by the FP8 rollout mode's granularity
"""The dequantization scale's parameter name in vLLM's FP8 checkpoint layout, per rollout mode."""


def quantized_groups(model: nn.Module) -> list[list[str]]:
    """Module names of the linears the engine quantizes, grouped as vLLM fuses them (q/k/v, gate/up).

    Every ``nn.Linear`` but the output embedding, as ``convert_for_rollout`` converts them.
    """
    keep = _output_embedding_names(model)
    groups: list[list[str]] = []
    for parent_name, parent in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        children = {
            attr: mod
            for attr, mod in parent.named_children()
            if isinstance(mod, nn.Linear) and prefix + attr not in keep
        }
        for members in FUSED_PROJECTIONS:
            if all(m in children for m in members):
                groups.append([prefix + m for m in members])
                for m in members:
                    children.pop(m)
        groups += [[prefix + attr] for attr in children]
    return groups


def quantize_fused(
    weights: list[torch.Tensor], mode: str, block: int = BLOCK
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(float8 values, dequantization scale)`` per member of one fused layer, from fp32 master weights."""
    fused = torch.cat([w.detach().float() for w in weights], dim=0)  # [sum N_i, K]
    granularity = _granularity(mode)
    if granularity == "tensor":
        values, post = quantize_operand(fused, E4M3, "tensor", pow2=False, compute_dtype=torch.float32, rule="vllm")
        fp8, scales = values.to(torch.float8_e4m3fn), [post.clone() for _ in weights]
    elif granularity == "block":
        for w in weights:
            if w.shape[0] % block:
                raise ValueError(
                    f"native_fp8 per-block transfer needs each fused member's rows to be whole {block}-row blocks "
                    f"(vLLM requires it); got {w.shape[0]} rows"
                )
        raw, qscale = _round_whole(
            _grouped(fused, "block", block),
            RoundSpec("block", E4M3, pow2=False, dequantize=False, out_dtype=torch.float32, rule="vllm"),
        )  # raw [R/b, b, C/b, b], qscale [R/b, 1, C/b, 1]
        r, c = fused.shape
        fp8 = raw.reshape(raw.shape[0] * block, raw.shape[2] * block)[:r, :c].to(torch.float8_e4m3fn)
        inv = torch.reciprocal(qscale).reshape(qscale.shape[0], qscale.shape[2])  # [R/b, C/b]
    else:
        raise ValueError(f"native_fp8 needs an FP8 rollout mode {FP8_ROLLOUT_MODES}, got {mode!r}")
    rows = torch.tensor([0] + [w.shape[0] for w in weights]).cumsum(0).tolist()
    spans = list(zip(rows, rows[1:]))
    if granularity == "block":
        scales = [inv[lo // block : hi // block].clone() for lo, hi in spans]
    return [(fp8[lo:hi].contiguous(), s) for (lo, hi), s in zip(spans, scales)]


def stream_native_fp8_weights(
    train_model: nn.Module, mode: str, device: str | torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` of the payload, in state-dict order: FP8 values and scales for the quantized
    linears (a fused layer when its first member comes up), BF16 for the rest."""
    state = train_model.state_dict()
    groups = quantized_groups(train_model)
    group_of = {f"{name}.weight": g for g in groups for name in g}
    tied, sent = is_tied(train_model), set()
    scale = SCALE_NAME.get(_granularity(mode))
    for key, tensor in state.items():
        name = key.replace("_orig_mod.", "")
        if (tied and name == "lm_head.weight") or name in sent:
            continue
        group = group_of.get(name)
        if group is None:
            full = full_parameter(tensor, torch.bfloat16)
            yield name, (full if device is None else full.to(device)).contiguous()
            continue
        masters = [full_parameter(state[f"{m}.weight"], torch.float32) for m in group]
        for member, (fp8, s) in zip(group, quantize_fused(masters, mode)):
            sent.add(f"{member}.weight")
            yield f"{member}.weight", fp8 if device is None else fp8.to(device)
            yield f"{member}.{scale}", s if device is None else s.to(device)


def load_native_fp8(rollout_model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The engine side, emulated: an FP8 inference copy (``convert_for_rollout``) takes the payload's
    values and scales without re-quantizing; every other tensor is copied in."""
    mods = {name: m for name, m in rollout_model.named_modules() if isinstance(m, Fp8RolloutLinear)}
    params = dict(rollout_model.named_parameters())
    got: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        owner, _, leaf = name.rpartition(".")
        if owner in mods:
            got.setdefault(owner, {})[leaf] = t
        elif name in params:
            with torch.no_grad():
                params[name].copy_(t)
        else:
            raise KeyError(f"load_native_fp8: the payload's {name} has no place in the inference copy")
    missing = sorted(set(mods) - set(got))
    if missing:
        raise KeyError(f"load_native_fp8: no FP8 weights for {missing[:5]} (of {len(missing)})")
    for owner, parts in got.items():
        _load_linear(mods[owner], parts, owner)


def _load_linear(mod: Fp8RolloutLinear, parts: dict[str, torch.Tensor], name: str) -> None:
    dtype = mod.weight_values.dtype if mod.weight_values.numel() else torch.bfloat16
    fp8 = parts["weight"]
    if fp8.dtype != torch.float8_e4m3fn or tuple(fp8.shape) != (mod.out_features, mod.in_features):
        raise ValueError(f"load_native_fp8: {name}.weight must be float8_e4m3fn {(mod.out_features, mod.in_features)}")
    if mod.scheme == "per_tensor":
        mod.weight_values = fp8.to(dtype)
        mod.weight_post = parts["weight_scale"].float()
    else:  # per block: values dequantized once, as the per-block emulation keeps them
        b, (r, c) = mod.block, fp8.shape
        g = _grouped(fp8.float(), "block", b)  # [R/b, b, C/b, b]
        inv = parts["weight_scale_inv"].float()[:, None, :, None]
        mod.weight_values = (g * inv).reshape(g.shape[0] * b, g.shape[2] * b)[:r, :c].to(dtype)
        mod.weight_post = torch.empty(0, device=fp8.device)
    bias = parts.get("bias")
    mod.bias = None if bias is None else bias.to(dtype)
    mod._by_dtype = {dtype: mod.weight_values}
    if mod.input_cache is not None:
        mod.input_cache.clear()


def vllm_native_fp8_options(mode: str, block: int = BLOCK) -> dict[str, Any]:
    """``vllm.LLM`` settings for an FP8-serialized checkpoint of ``mode`` (not run on a GPU)."""
    if _granularity(mode) not in SCALE_NAME:
        raise ValueError(f"native_fp8 needs an FP8 rollout mode {FP8_ROLLOUT_MODES}, got {mode!r}")
    qcfg: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if _granularity(mode) == "block":
        qcfg["weight_block_size"] = [block, block]
    return {"quantization": "fp8", "hf_overrides": {"quantization_config": qcfg}}


def write_native_fp8_checkpoint(model: nn.Module, mode: str, folder: str | Path) -> Path:
    """An FP8-serialized checkpoint of ``model`` in ``folder`` that vLLM loads with
    :func:`vllm_native_fp8_options`: ``config.json`` with the ``quantization_config``, one
    ``model.safetensors`` of the payload (written to a temporary name, then renamed)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    config_path = folder / "config.json"
    body = json.loads(config_path.read_text())
    body["quantization_config"] = vllm_native_fp8_options(mode)["hf_overrides"]["quantization_config"]
    config_path.write_text(json.dumps(body, indent=2) + "\n")
    tmp = folder / "model.safetensors.tmp"
    tensors = {name: t.contiguous() for name, t in stream_native_fp8_weights(model, mode, device="cpu")}
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    final = folder / "model.safetensors"
    os.replace(tmp, final)
    return final
