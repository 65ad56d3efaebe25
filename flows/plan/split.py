"""``fp8rl plan CONFIG --gpus N --rollout-gpus R``: a split placement's memory per GPU and expected step time.

A split placement trains on ``N`` GPUs (FSDP2) while the rollout engine runs on
``R`` others: a ``vllm serve`` (``rollout.engine: vllm_http``) or vLLM in its own
processes (``vllm_process: separate``), its weights pushed over NCCL from the
trainer's rank 0 (``rollout.weight_sync: nccl``). It is what asynchronous rollout
(``rollout.max_staleness`` k ≥ 1) needs on a GPU: generation for step t + k runs
on the rollout GPUs while step t trains.

**Memory per GPU.**

* A training GPU holds what :func:`flows.plan.memory.memory_plan` counts without the
  engine (no engine copy, no reservation), with the NCCL sync's peak
  (:func:`stages.engines.weight_transfer.sync_peak_bytes`: vLLM's packed broadcast
  buffers on the sender).
* A rollout GPU holds its engine's reservation: ``rollout.gpu_memory_utilization``
  of the GPU, of which the weights are ``bytes_per_weight x P / TP`` and the rest
  is KV cache (or the weights and ``rollout.kv_cache_gib``, vLLM's per-GPU KV
  cache); it never sleeps.

**Expected step time**, from peak rates and stated efficiencies (:class:`GpuRates`),
not a measurement: an estimate to choose ``R`` against ``N`` with, not a promise.

* rollout: ``S = prompts x samples`` sequences of at most ``prompt + max_new_tokens``
  tokens, ``S / E`` per engine (``E = R / TP``), as many at once as its KV cache
  holds; each decode step reads the weights and the live KV cache from memory or
  computes ``2 P`` FLOPs per sequence, whichever takes longer; the prefill computes
  ``2 P`` FLOPs per prompt token. vLLM's paged KV cache holds what sequences have
  written, so an engine decodes as many at once as fit at their mean length. Every
  response is counted at its full budget (an upper bound), or at ``--response-fill``
  of it.
* training: ``(6 + 2 + 2c) P`` FLOPs per token and epoch (forward and backward; the
  π_old forward; ``c`` = 1 with activation checkpointing) over ``N`` GPUs at the
  training precision's matmul rate times ``train_mfu``.
* sync: ``2 P`` bytes (bf16) broadcast from rank 0 over ``link_gbps``.
* a lockstep step is rollout + sync + training; an overlapped one (k ≥ 1)
  is the longer of rollout and training, plus the sync (the engine pauses for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flows.plan.memory import GiB, arch_of, memory_plan, total_params
from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.engine_kinds import ENGINE_KINDS
from fp8rl_core.config.precision_kinds import PRECISION_MODES


@dataclass(frozen=True)
class GpuRates:
    """Peak dense rates of one GPU and the share of them a step is assumed to reach."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    memory_tbps: float
    train_mfu: float = 0.35  # of the matmul peak, over a whole training step (MFU of large FSDP runs)
    decode_efficiency: float = 0.6  # of the memory bandwidth, while decoding
    prefill_mfu: float = 0.5
    link_gbps: float = 50.0  # trainer -> engine broadcast: one 400 Gb/s NIC per GPU across nodes


GPU_RATES = {
    "h100": GpuRates("H100 SXM", bf16_tflops=989.0, fp8_tflops=1979.0, memory_tbps=3.35),
    "h200": GpuRates("H200 SXM", bf16_tflops=989.0, fp8_tflops=1979.0, memory_tbps=4.8),
}


@dataclass(frozen=True)
class SplitPlan:
    """Memory per GPU (GiB) and expected seconds of one step of a split placement."""

    train_rows: list[tuple[str, float]]
    train_gib: float
    rollout_rows: list[tuple[str, float]]
    rollout_gib: float
    budget_gib: float
    rollout_s: float
    train_s: float
    sync_s: float
    engines: int
    concurrent: int  # sequences one engine decodes at once

    @property
    def fits(self) -> bool:
        return self.train_gib <= self.budget_gib and self.rollout_gib <= self.budget_gib

    @property
    def lockstep_s(self) -> float:
        return self.rollout_s + self.sync_s + self.train_s

    @property
    def overlapped_s(self) -> float:
        return max(self.rollout_s, self.train_s) + self.sync_s


def check_split(cfg: CampaignConfig, rollout_gpus: int) -> None:
    """Refuse, in one line, a config whose engine cannot run on other GPUs than the trainer's."""
    r = cfg.rollout
    kind = ENGINE_KINDS.get(r.engine)
    process = r.vllm_process if kind.weight_syncs else kind.processes[0]  # where the engine computes
    if process in ("separate", "server"):
        if r.weight_sync != "nccl":
            raise ValueError(f"--rollout-gpus {rollout_gpus}: an engine on other GPUs takes its weights over NCCL; "
                             f"set rollout.weight_sync: nccl (not {r.weight_sync})")
        if rollout_gpus % r.tensor_parallel_size:
            raise ValueError(f"--rollout-gpus {rollout_gpus} is not a multiple of rollout.tensor_parallel_size "
                             f"{r.tensor_parallel_size}")
        return
    raise ValueError(f"--rollout-gpus {rollout_gpus}: a split placement needs the engine in processes of its own "
                     f"on other GPUs: rollout.engine: vllm_http, or vllm with vllm_process: separate "
                     f"(this config: {r.engine}, in the {process} process)")


def split_plan(
    cfg: CampaignConfig,
    *,
    gpus: int,
    rollout_gpus: int,
    gpu_memory_gib: float,
    prompt_tokens: int = 1024,
    rates: GpuRates = GPU_RATES["h100"],
    headroom: float = 0.10,
    response_fill: float = 1.0,
) -> SplitPlan:
    """The split's plan; ``response_fill``: the mean response as a share of ``max_new_tokens`` (1: every
    response at its budget, an upper bound; a run's own share is ``avg(response_length) / max_new_tokens``)."""
    if not 0 < response_fill <= 1:
        raise ValueError(f"--response-fill must be in (0, 1], got {response_fill}")
    check_split(cfg, rollout_gpus)
    a = arch_of(cfg)
    p = total_params(a)
    r, alg = cfg.rollout, cfg.algorithm
    train = memory_plan(cfg, gpus=gpus, gpu_memory_gib=gpu_memory_gib, prompt_tokens=prompt_tokens,
                        headroom=headroom)
    train_rows = [(k, v) for k, v in train.rows if "engine" not in k]  # the sync's peak stays

    tp = r.tensor_parallel_size
    weights = p * PRECISION_MODES.get(cfg.precision.rollout).bytes_per_weight
    if r.kv_cache_gib is not None:  # vLLM's kv_cache_memory_bytes is per GPU
        kv = r.kv_cache_gib * GiB
    else:  # gpu_memory_utilization of each GPU holds its share of the weights and the KV cache
        kv = max(r.gpu_memory_utilization * gpu_memory_gib * GiB - weights / tp, 0.0)
    rollout_rows = [(f"engine weights ({cfg.precision.rollout}, TP {tp})", weights / tp / GiB),
                    ("KV cache (the rest of the reservation)", kv / GiB)]

    engines = rollout_gpus // tp
    sequences = r.prompts_per_step * r.samples_per_prompt
    per_engine = math.ceil(sequences / engines)
    generated = r.max_new_tokens * response_fill
    kv_per_token = 2 * a.layers * a.kv_heads * a.head_dim * 2 / tp  # K and V, bf16, this GPU's heads
    concurrent = max(1, min(per_engine, int(kv // (kv_per_token * (prompt_tokens + generated))))) if kv else 1
    waves = math.ceil(per_engine / concurrent)
    bandwidth = rates.memory_tbps * 1e12 * rates.decode_efficiency
    flops = (rates.fp8_tflops if PRECISION_MODES.get(cfg.precision.rollout).quantized else rates.bf16_tflops) * 1e12
    decode_step = max(weights / tp / bandwidth + concurrent * (prompt_tokens + generated / 2) * kv_per_token
                      / bandwidth, 2 * p / tp * concurrent / (flops * rates.prefill_mfu))
    prefill = 2 * p / tp * prompt_tokens * per_engine / (flops * rates.prefill_mfu)
    rollout_s = waves * generated * decode_step + prefill

    fp8_train = PRECISION_MODES.get(cfg.precision.train).quantized
    train_flops = (rates.fp8_tflops if fp8_train else rates.bf16_tflops) * 1e12 * rates.train_mfu
    per_token = (6 + 2 + (2 if alg.activation_checkpointing else 0)) * p * alg.ppo_epochs
    train_s = per_token * sequences * (prompt_tokens + generated) / (gpus * train_flops)
    sync_s = 2 * p / (rates.link_gbps * 1e9)
    budget = gpu_memory_gib * (1 - headroom)
    return SplitPlan(train_rows, sum(v for _, v in train_rows), rollout_rows, sum(v for _, v in rollout_rows),
                     budget, rollout_s, train_s, sync_s, engines, concurrent)


def format_split(cfg: CampaignConfig, plan: SplitPlan, *, gpus: int, rollout_gpus: int, gpu_memory_gib: float,
                 rates: GpuRates, response_fill: float = 1.0) -> str:
    k = cfg.rollout.max_staleness
    lines = [f"split placement: training on {gpus} GPU(s), rollout on {rollout_gpus} other GPU(s) "
             f"({plan.engines} engine(s)), {gpu_memory_gib:g} GiB each"]
    lines.append("  per training GPU:")
    lines += [f"    {name:<66} {v:8.2f} GiB" for name, v in plan.train_rows]
    lines.append(f"    {'total':<66} {plan.train_gib:8.2f} GiB  (budget {plan.budget_gib:.1f} GiB)")
    lines.append("  per rollout GPU:")
    lines += [f"    {name:<66} {v:8.2f} GiB" for name, v in plan.rollout_rows]
    lines.append(f"    {'total':<66} {plan.rollout_gib:8.2f} GiB  (budget {plan.budget_gib:.1f} GiB)")
    fill = "at their full budget (an upper bound)" if response_fill == 1 else f"at {response_fill:g} of the budget"
    lines.append(f"  expected step time on {rates.name} (peak rates x train MFU {rates.train_mfu:g}, decode "
                 f"bandwidth x {rates.decode_efficiency:g}; responses {fill}; an estimate):")
    lines.append(f"    rollout {plan.rollout_s:7.1f} s ({plan.concurrent} sequences at once per engine)   "
                 f"training {plan.train_s:7.1f} s   weight sync {plan.sync_s:5.1f} s")
    lines.append(f"    lockstep (max_staleness 0): {plan.lockstep_s:7.1f} s/step   overlapped (max_staleness >= 1): "
                 f"{plan.overlapped_s:7.1f} s/step ({plan.lockstep_s / plan.overlapped_s:.2f}x)"
                 + ("" if k else "   [this config runs lockstep: set rollout.max_staleness]"))
    lines.append("fits" if plan.fits else "does NOT fit: " + (
        "more training GPUs or a smaller micro_batch_size" if plan.train_gib > plan.budget_gib
        else "a smaller rollout.gpu_memory_utilization or kv_cache_gib, or tensor parallelism"))
    return "\n".join(lines)
