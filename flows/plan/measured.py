"""``fp8rl plan``'s measured plan: the preset's train step on fake tensors, per GPU, per phase.

The train step is measured by :func:`stages.trainer.memory_measure.measure_step` at two
small depths (3 and 4 layers) and extrapolated linearly to the model's depth (every
kind of memory separately, see that module); a third depth (5 layers) checks the fit,
and the plan prints the gap. A model of at most 5 layers is measured whole. Around it,
per GPU:

* **rollout**: vLLM, colocated, claims ``rollout.gpu_memory_utilization`` of the
  GPU (weights + KV cache; with ``rollout.kv_cache_gib`` set, its weights and that
  cache instead: :func:`engine_reservation`) while the trainer's resident state
  stays: the sharded fp32 parameters and the AdamW state (:func:`resident_bytes`; every optimizer step
  frees the gradients, ``stages.trainer.optimizer.optimizer_step``, so none outlive the
  train stage);
* **train step**: the measured peak of forward, backward and the AdamW step, the forward
  and backward with the AdamW state resident (:func:`steady_state`: the measured step is a
  run's first, before AdamW has any state), plus
  the sleeping engine (level 1 offloads its weights to host memory and frees its
  KV cache: nothing stays on the GPU; level 0 keeps its whole reservation);
* **weight sync**: the resident state, the largest parameter the sync streams to the
  engine in bf16 (``stages.engines.weight_transfer.stream_trainer_weights``, measured
  on the fake model) and the awake engine's weights (P x 1 B in FP8, 2 B in BF16).

A phase fits when it stays under the GPU's memory less the headroom. The
analytic plan (:mod:`flows.plan.memory`) is printed beside it, with the ratio of each
comparable row; docs/trainer-at-scale.md explains the differences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flows.plan.memory import Arch, GiB, arch_of, engine_reservation, engine_weight_bytes, memory_plan, total_params

# Decoder layers measured and extrapolated linearly to the depth: each holds a block that is neither the
# first nor the last (see stages.trainer.memory_measure); CHECK_DEPTH tests the fit.
DEPTHS = (3, 4)
CHECK_DEPTH = 5


TRAIN_PHASES = ("forward", "backward", "optimizer")


def steady_state(step: Any) -> dict[str, dict[str, int]]:
    """Bytes by kind of each train phase from the second step on: the measured step is a run's first,
    whose forward and backward run before AdamW has any state; from then on the state (the
    ``"after step"`` OptState) stays resident through every forward and backward."""
    state = step.phases["after step"].get("OptState", 0)
    out = {ph: dict(step.phases[ph]) for ph in TRAIN_PHASES}
    for ph in ("forward", "backward"):
        out[ph]["OptState"] = out[ph].get("OptState", 0) + state
    return out


def resident_bytes(step: Any) -> int:
    """Bytes the trainer keeps on each GPU between its train stages (through rollout and the weight sync):
    the sharded fp32 parameters and the AdamW state after the step. Not the gradients: the trainer's
    optimizer step sets them to None (``stages.trainer.optimizer.optimizer_step``), the last update of a
    stage included; the measured step holds them until its own ``zero_grad``."""
    after = step.phases["after step"]
    return after.get("Sharded Param", 0) + after.get("OptState", 0)


@dataclass(frozen=True)
class MeasuredPlan:
    phases: dict[str, float]  # phase -> GiB per GPU at its peak
    train: dict[str, dict[str, float]]  # train phase (forward/backward/optimizer) -> kind -> GiB
    resident_gib: float  # sharded fp32 parameters + AdamW state
    sync_gib: float
    engine_weights_gib: float
    budget_gib: float
    fits: bool
    params: int
    depths: tuple[int, ...]  # measured depths (one: the whole model)
    linearity: float | None = None  # relative gap of the fit at CHECK_DEPTH; None when measured whole


def hf_config(a: Arch) -> Any:
    """A transformers config of ``a`` (Qwen2 when the attention has q/k/v biases, else Qwen3)."""
    from transformers import Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        tie_word_embeddings=a.tied,
        max_position_embeddings=40960,
    )
    if a.qkv_bias:
        return Qwen2Config(**common)
    return Qwen3Config(head_dim=a.head_dim, **common)


def plan_precision_line(cfg: Any) -> str:
    """Which linears of the preset's model train in FP8 and which stay BF16, and why, and whether its decoder
    blocks run compiled on the GPU (the run's console line)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fp8rl_core.precision.conversion import convert_for_training
    from fp8rl_core.precision.layers import layer_precision, precision_line
    from stages.trainer.block_compile import compile_choice, gpu_backend

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(arch_of(cfg)), dtype=torch.float32)
    report = convert_for_training(model, cfg.precision.train, backend="emulated")
    summary = layer_precision(model, report)
    summary["compile"] = compile_choice(cfg.precision.compile, "cuda", gpu_backend(cfg.precision.train)).as_dict()
    return precision_line(summary)


def measured_plan(
    cfg: Any,
    *,
    gpus: int,
    gpu_memory_gib: float,
    prompt_tokens: int = 1024,
    headroom: float = 0.10,
    depths: tuple[int, int] = DEPTHS,
    check_depth: int = CHECK_DEPTH,
) -> MeasuredPlan:
    """Measure the train step at ``depths`` layers on ``gpus`` fake ranks (and ``check_depth`` to test the
    linear fit) and build the per-phase plan; a model no deeper than those is measured whole."""
    from stages.trainer.memory_measure import extrapolate, linearity_error, measure_step

    a = arch_of(cfg)
    kw = dict(
        world_size=gpus,
        mode=cfg.precision.train,
        micro_batch_size=cfg.algorithm.micro_batch_size,
        seq_len=prompt_tokens + cfg.rollout.max_new_tokens,
        activation_checkpointing=cfg.algorithm.activation_checkpointing,
        lr=cfg.algorithm.lr,
    )
    linearity = None
    if a.layers <= max(*depths, check_depth):
        step = measure_step(hf_config(a), layers=a.layers, **kw)
        depths = (a.layers,)
    else:
        r1, r2, r3 = (measure_step(hf_config(a), layers=d, **kw) for d in (*depths, check_depth))
        step = extrapolate(r1, r2, a.layers)
        linearity = linearity_error(r1, r2, r3)
    p = total_params(a)
    resident = resident_bytes(step)
    engine_weights = engine_weight_bytes(cfg, p)
    r = cfg.rollout
    reservation = engine_reservation(cfg, gpu_memory_gib, engine_weights)
    sleeping = 0.0 if r.sleep_between_steps and r.sleep_level >= 1 else reservation
    steady = steady_state(step)
    train_peak = max(sum(steady[ph].values()) for ph in TRAIN_PHASES)
    phases = {
        "rollout (engine reservation + resident state)": reservation + resident,
        "train step (measured peak + sleeping engine)": train_peak + sleeping,
        "weight sync (resident + largest streamed parameter + engine weights)": resident
        + step.sync_bytes
        + engine_weights,
    }
    budget = gpu_memory_gib * (1 - headroom)
    gib = {k: v / GiB for k, v in phases.items()}
    train = {ph: {k: v / GiB for k, v in steady[ph].items() if v} for ph in TRAIN_PHASES}
    return MeasuredPlan(
        gib,
        train,
        resident / GiB,
        step.sync_bytes / GiB,
        engine_weights / GiB,
        budget,
        all(v <= budget for v in gib.values()),
        p,
        tuple(depths),
        linearity,
    )


def format_measured(
    cfg: Any, plan: MeasuredPlan, *, gpus: int, gpu_memory_gib: float, prompt_tokens: int = 1024
) -> str:
    """The measured plan, the analytic plan's comparable rows beside it, and the fit verdict."""
    a = arch_of(cfg)
    if len(plan.depths) == 1:
        how = f"the whole model ({a.layers} layers)"
    else:
        how = (
            f"{plan.depths[0]} and {plan.depths[1]} layers, extrapolated to {a.layers} "
            f"(fit checked at {CHECK_DEPTH}: {100 * (plan.linearity or 0.0):.2f}% off)"
        )
    lines = [
        f"{cfg.name}: {plan.params / 1e9:.2f} B parameters, FSDP2 over {gpus} GPU(s) of {gpu_memory_gib:g} GiB; "
        f"measured: one train step on fake tensors at {how}"
    ]
    for ph, kinds in plan.train.items():
        label = f"{ph} peak" + (" (AdamW step)" if ph == "optimizer" else " (AdamW state resident)")
        lines.append(
            f"  {label:<54} {sum(kinds.values()):8.2f} GiB  "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:5])
        )
    for ph, v in plan.phases.items():
        lines.append(f"  {ph:<54} {v:8.2f} GiB")
    ana = memory_plan(cfg, gpus=gpus, gpu_memory_gib=gpu_memory_gib, prompt_tokens=prompt_tokens)
    rows = dict(ana.rows)
    opt = plan.train["optimizer"]
    pairs = [
        ("parameters (fp32 master shard)", opt.get("Sharded Param", 0.0)),
        ("gradients (fp32 shard)", opt.get("Sharded Grad", 0.0)),
        ("optimizer (AdamW, fp32 shard)", plan.resident_gib - opt.get("Sharded Param", 0.0)),
    ]
    lines.append(
        f"  analytic plan (flows/plan/memory.py): total {ana.total_gib:.2f} GiB; measured / analytic: "
        + ", ".join(f"{k.split(' (')[0]} {m / rows[k]:.3f}" for k, m in pairs if rows.get(k))
    )
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"{verdict}: worst phase {max(plan.phases.values()):.2f} GiB, budget {plan.budget_gib:.1f} GiB after headroom"
    )
    return "\n".join(lines)


__all__ = [
    "CHECK_DEPTH",
    "DEPTHS",
    "MeasuredPlan",
    "engine_reservation",
    "TRAIN_PHASES",
    "format_measured",
    "hf_config",
    "measured_plan",
    "plan_precision_line",
    "resident_bytes",
    "steady_state",
]
