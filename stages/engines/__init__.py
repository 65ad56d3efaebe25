"""Rollout engines behind one interface (:class:`RolloutEngine`), built by name.

``make_engine("transformers", model=..., tokenizer=..., precision=..., config=...)``
gives the CPU / small-GPU engine; ``"vllm"`` the vLLM adapter (GPU; ``vllm`` is
imported only when that engine is constructed); ``"vllm_http"`` a client of a
running ``vllm serve`` (disaggregated rollout).
"""

from stages.engines.base import (
    ENGINES,
    FinishReason,
    LogprobsMode,
    RolloutBatch,
    RolloutEngine,
    RolloutSample,
    SamplingRequest,
    make_engine,
    register_engine,
    truncate_at_eos,
    validate_generate_args,
)
from stages.engines.hf_engine import TransformersEngine
from stages.engines.http_engine import VLLMHTTPEngine
from stages.engines.vllm_engine import VLLMEngine

__all__ = [
    "ENGINES",
    "FinishReason",
    "LogprobsMode",
    "RolloutBatch",
    "RolloutEngine",
    "RolloutSample",
    "SamplingRequest",
    "TransformersEngine",
    "VLLMEngine",
    "VLLMHTTPEngine",
    "make_engine",
    "register_engine",
    "truncate_at_eos",
    "validate_generate_args",
]
