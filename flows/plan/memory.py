"""``fp8rl plan CONFIG --gpus N --gpu-memory 80``: a per-GPU memory plan of a campaign.

``fp8rl plan`` measures (:mod:`flows.plan.measured`, one train step on fake
tensors); this module is the arithmetic it is cross-checked against, and what
``--analytic`` prints alone.

Per GPU, for FSDP2 over N GPUs (parameters, gradients and AdamW state sharded
N ways, fp32 masters) plus what cannot be sharded:

* parameters: 4 B x P / N (fp32 master shard);
* gradients: 4 B x P / N (fp32, reduce-scattered);
* optimizer: 8 B x P / N (AdamW exp_avg + exp_avg_sq);
* unsharded blocks: 2 decoder blocks gathered at once (the one computing, the
  one prefetched), bf16 (FSDP2's all-gather dtype): 2 x 2 B x P_block;
* activations of one micro-batch: tokens x layers x 34 h x 2 B (Korthikanti et
  al. 2022, BF16; with SDPA/flash attention the 5 a s term is not stored); with
  ``algorithm.activation_checkpointing`` tokens x layers x h x 2 B (block inputs)
  plus one block's 34 h x 2 B per token; plus
  the BF16 logits and one float32 vocabulary chunk: tokens x V x 2 B + 64 MiB;
* rollout engine (vLLM, colocated, sleeping during training at level 1: its
  weights stay, KV cache freed): P x 1 B for FP8 weights (2 B for BF16).

A plan fits when that training total fits and so does the rollout phase: the
awake engine's reservation (``rollout.gpu_memory_utilization`` of the GPU, or
its weights plus ``rollout.kv_cache_gib``; :func:`engine_reservation`) beside
the resident fp32 shards and AdamW state (12 B x P / N), as the measured plan
(:mod:`flows.plan.measured`) counts it.

P is computed from the architecture (embeddings, attention with GQA, SwiGLU
MLP, norms; lm_head counted unless tied). Known Hugging Face ids are listed in
``ARCHITECTURES``; the tiny model comes from ``model.*``. Tokens per
micro-batch = micro_batch_size x (prompt cap + max_new_tokens). A plan is an
estimate: it leaves ``headroom`` (default 10%) for the allocator, NCCL buffers
and CUDA context.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.engine_kinds import ENGINE_KINDS
from fp8rl_core.config.precision_kinds import PRECISION_MODES

GiB = 1024**3


@dataclass(frozen=True)
class Arch:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False


ARCHITECTURES = {  # from the models' published config.json
    "Qwen/Qwen3-0.6B": Arch(1024, 28, 16, 8, 128, 3072, 151936, True),
    "Qwen/Qwen3-1.7B": Arch(2048, 28, 16, 8, 128, 6144, 151936, True),
    "Qwen/Qwen3-4B": Arch(2560, 36, 32, 8, 128, 9728, 151936, True),
    "Qwen/Qwen3-8B-Base": Arch(4096, 36, 32, 8, 128, 12288, 151936, False),
    "Qwen/Qwen3-8B": Arch(4096, 36, 32, 8, 128, 12288, 151936, False),
    "Qwen/Qwen3-14B-Base": Arch(5120, 40, 40, 8, 128, 17408, 151936, False),
    "Qwen/Qwen3-14B": Arch(5120, 40, 40, 8, 128, 17408, 151936, False),
    "Qwen/Qwen2.5-32B": Arch(5120, 64, 40, 8, 128, 27648, 152064, False, True),
}


def arch_of(cfg: CampaignConfig) -> Arch:
    m = cfg.model
    if m.path is None:
        return Arch(
            m.hidden_size,
            m.num_layers,
            m.num_heads,
            m.num_kv_heads,
            m.hidden_size // m.num_heads,
            m.intermediate_size,
            128,
            m.tie_word_embeddings,
        )
    if m.path in ARCHITECTURES:
        return ARCHITECTURES[m.path]
    raise ValueError(f"no architecture on file for model.path={m.path!r}; known: {', '.join(ARCHITECTURES)}")


def block_params(a: Arch) -> int:
    q = a.hidden * a.heads * a.head_dim
    kv = 2 * a.hidden * a.kv_heads * a.head_dim
    o = a.heads * a.head_dim * a.hidden
    bias = (a.heads + 2 * a.kv_heads) * a.head_dim if a.qkv_bias else 0
    mlp = 3 * a.hidden * a.intermediate
    return q + kv + o + bias + mlp + 2 * a.hidden + 2 * a.head_dim  # + input/post norms, q/k norms


def total_params(a: Arch) -> int:
    emb = a.vocab * a.hidden
    return emb * (1 if a.tied else 2) + a.layers * block_params(a) + a.hidden


@dataclass(frozen=True)
class Plan:
    rows: list[tuple[str, float]]  # (item, GiB per GPU)
    total_gib: float
    budget_gib: float
    fits: bool
    params: int
    rollout_gib: float = 0.0  # the rollout phase: the engine's reservation + the resident state


def _sync_peak(cfg: CampaignConfig, a: Arch, params: int, gpus: int) -> float:
    """Extra device bytes of one weight sync to a vLLM engine (0 for the transformers engine); an NCCL sync
    (``vllm_http`` included) holds vLLM's packed buffers on the trainer's GPU."""
    if not (ENGINE_KINDS.get(cfg.rollout.engine).weights_on_device or cfg.rollout.syncs_by_nccl):
        return 0.0
    from stages.engines.weight_transfer import sync_peak_bytes

    qkv = a.hidden * (a.heads + 2 * a.kv_heads) * a.head_dim
    layer = max(qkv, 2 * a.hidden * a.intermediate)
    return float(
        sync_peak_bytes(
            largest_param=a.vocab * a.hidden,
            largest_layer=layer,
            total=params,
            world_size=gpus,
            weight_sync=_sync_name(cfg),
            quantized=PRECISION_MODES.get(cfg.precision.rollout).quantized,
        )
    )


def _sync_name(cfg: CampaignConfig) -> str:
    """The weight transfer a run uses: rollout.weight_sync, or the engine's only one (vllm_http: nccl)."""
    return ENGINE_KINDS.get(cfg.rollout.engine).fixed_sync or cfg.rollout.weight_sync


def engine_weight_bytes(cfg: CampaignConfig, params: int) -> float:
    """Bytes of the rollout engine's own copy of the weights on the device (0 for an engine without one)."""
    if not ENGINE_KINDS.get(cfg.rollout.engine).weights_on_device:
        return 0.0
    return params * PRECISION_MODES.get(cfg.precision.rollout).bytes_per_weight


def engine_reservation(cfg: CampaignConfig, gpu_memory_gib: float, engine_weights: float) -> float:
    """Bytes a colocated vLLM engine holds while awake: ``rollout.gpu_memory_utilization`` of the GPU,
    or, with ``rollout.kv_cache_gib`` set, its weights and that KV cache (0 without vLLM)."""
    r = cfg.rollout
    if not ENGINE_KINDS.get(r.engine).weights_on_device:
        return 0.0
    if r.kv_cache_gib is not None:
        return engine_weights + r.kv_cache_gib * GiB
    return r.gpu_memory_utilization * gpu_memory_gib * GiB


def memory_plan(
    cfg: CampaignConfig, *, gpus: int, gpu_memory_gib: float, prompt_tokens: int = 1024, headroom: float = 0.10
) -> Plan:
    if gpus < 1:
        raise ValueError("--gpus must be >= 1")
    a = arch_of(cfg)
    p = total_params(a)
    tokens = cfg.algorithm.micro_batch_size * (prompt_tokens + cfg.rollout.max_new_tokens)
    if cfg.algorithm.activation_checkpointing:  # block inputs kept, one block's activations live in backward
        act = tokens * a.layers * a.hidden * 2 + tokens * 34 * a.hidden * 2
    else:
        act = tokens * a.layers * 34 * a.hidden * 2
    logits = tokens * a.vocab * 2 + 64 * 2**20
    weights = engine_weight_bytes(cfg, p)
    reservation = engine_reservation(cfg, gpu_memory_gib, weights)
    if cfg.rollout.sleep_between_steps and cfg.rollout.sleep_level >= 1:
        engine_row = ("rollout engine weights (vLLM, sleeping)", weights)
    else:  # an engine that does not sleep keeps its whole reservation through training
        engine_row = ("rollout engine reservation (vLLM, awake)", reservation)
    rows = [
        ("parameters (fp32 master shard)", 4 * p / gpus),
        ("gradients (fp32 shard)", 4 * p / gpus),
        ("optimizer (AdamW, fp32 shard)", 8 * p / gpus),
        ("gathered blocks (2, bf16)", 2 * 2 * block_params(a)),  # FSDP2 all-gathers bf16 (mixed_precision_policy)
        (
            f"activations per micro-batch ({tokens} "
            f"tokens{', checkpointed' if cfg.algorithm.activation_checkpointing else ''})",
            act,
        ),
        ("logits (bf16) + one fp32 vocab chunk", logits),
        engine_row,
        (f"weight sync peak (vLLM, {_sync_name(cfg)})", _sync_peak(cfg, a, p, gpus)),
    ]
    rows = [(k, v / GiB) for k, v in rows]
    total = sum(v for _, v in rows)
    budget = gpu_memory_gib * (1 - headroom)
    # while the engine rolls out it holds its reservation beside the resident fp32 shards and AdamW state
    rollout = (reservation + 12 * p / gpus) / GiB if reservation else 0.0
    return Plan(rows, total, budget, total <= budget and rollout <= budget, p, rollout)


def format_plan(cfg: CampaignConfig, plan: Plan, *, gpus: int, gpu_memory_gib: float) -> str:
    lines = [f"{cfg.name}: {plan.params / 1e9:.2f} B parameters, FSDP2 over {gpus} GPU(s) of {gpu_memory_gib:g} GiB"]
    for k, v in plan.rows:
        lines.append(f"  {k:<48} {v:8.2f} GiB")
    lines.append(
        f"  {'total per GPU':<48} {plan.total_gib:8.2f} GiB  (budget {plan.budget_gib:.1f} GiB after headroom)"
    )
    if plan.rollout_gib:
        lines.append(f"  {'rollout (engine reservation + resident state)':<48} {plan.rollout_gib:8.2f} GiB")
    if plan.fits:
        lines.append("fits")
    elif plan.rollout_gib > plan.budget_gib:
        lines.append("does NOT fit: a smaller rollout.kv_cache_gib or rollout.gpu_memory_utilization, or more GPUs")
    else:
        lines.append("does NOT fit: more GPUs, a smaller micro_batch_size or shorter responses")
    return "\n".join(lines)
