"""The rollout engines as data: what each engine kind can do, read wherever a decision depends on it.

Plain data (no torch, no pydantic), so that the config checks ``rollout.engine`` against
it when it loads, the memory plan reads it without building an engine, and the engine
registry (``stages/engines/base.py``) checks each class against its row when it
registers. No caller compares an engine's name: it asks its kind.

================ ============= ========== ========= ======= ===================== =======================
engine           built before  loads from weights   top-k   processes             rollout precisions
                 the policy    a path     on device log-p
================ ============= ========== ========= ======= ===================== =======================
transformers     no            no         no        yes     trainer               every registered mode
vllm             yes           yes        yes       yes     trainer, separate     bf16, fp8_per_tensor,
                                                                                  fp8_per_block
vllm_http        yes           no         no        no      server                the server's own
================ ============= ========== ========= ======= ===================== =======================

* **built before the policy**: the engine is built before the trainer converts and places
  its policy (vLLM's start-up check wants the device's free memory); the others copy the
  converted policy where it trains.
* **loads from a path**: the engine loads the base checkpoint from disk (it is given
  ``model_path``), so what is put into the in-process policy at load time never reaches it.
* **weights on the device**: the engine keeps its own copy of the weights in accelerator
  memory beside the trainer's (the memory plan counts it).
* **top-k log-probs**: the engine returns the top-k log-probs of each sampled token's
  distribution (score centering needs them).
* **tensor parallel**: one engine may span several ranks (``rollout.tensor_parallel_size``
  and the data-parallel layouts of ``stages/runtime/rollout_plan.py``); the others run one
  engine per rank.
* **processes**: where the engine may live: the trainer's process, its own engine-core
  process (``separate``), or a server of its own; ``weight_syncs`` gives, per process
  the config chooses with ``rollout.vllm_process``, the weight transfers that reach it (NCCL
  only to another process: it cannot group a process with itself); ``fixed_sync`` the one
  transfer of an engine that has no choice (``vllm_http``: NCCL from the trainer to the
  server's workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp8rl_core.registry import Registry

__all__ = ["ENGINE_KINDS", "EngineKind"]

_FP8_AND_BF16 = ("bf16", "fp8_per_tensor", "fp8_per_block")


@dataclass(frozen=True)
class EngineKind:
    """One rollout engine's capabilities; ``module`` registers its class (imported when it is built)."""

    module: str
    builds_before_policy: bool
    loads_from_path: bool
    weights_on_device: bool
    serves_top_k: bool
    processes: tuple[str, ...]
    rollout_precisions: tuple[str, ...] | None  # None: every registered rollout precision
    tensor_parallel: bool = False  # one engine may span several ranks (rollout.tensor_parallel_size, DP layouts)
    weight_syncs: dict[str, tuple[str, ...]] = field(default_factory=dict)  # rollout.vllm_process -> syncs
    fixed_sync: str | None = None  # the one weight transfer of an engine that has no choice (rollout.weight_sync aside)

    def serves(self, precision: str) -> bool:
        return self.rollout_precisions is None or precision in self.rollout_precisions


ENGINE_KINDS: Registry[EngineKind] = Registry("rollout engine")
ENGINE_KINDS.register("transformers")(
    EngineKind("stages.engines.hf_engine", False, False, False, True, ("trainer",), None)
)
ENGINE_KINDS.register("vllm")(
    EngineKind(
        "stages.engines.vllm_engine", True, True, True, True, ("trainer", "separate"), _FP8_AND_BF16,
        tensor_parallel=True,
        weight_syncs={"trainer": ("tensors", "path"), "separate": ("ipc", "nccl", "path")},
    )
)  # fmt: skip
ENGINE_KINDS.register("vllm_http")(
    EngineKind("stages.engines.http_engine", True, False, False, False, ("server",), None, fixed_sync="nccl")
)
