"""Methods of our own on vLLM's workers, called by name (``collective_rpc``) in any process layout.

``LLM(..., worker_extension_cls=WORKER_EXTENSION)`` mixes :class:`FP8RLWorkerExtension`
into each worker's class, so ``llm.collective_rpc("fp8rl_repack_tied_head")`` reaches
the model whether the worker lives in the trainer's process (in-process, vLLM's
external launcher) or in an engine-core process of its own (``vllm_process:
separate``). A callable (``apply_model``) would have to be pickled across that
process boundary, which vLLM allows only with ``VLLM_ALLOW_INSECURE_SERIALIZATION``;
a method name crosses as a string. A ``vllm serve`` started with
``--worker-extension-cls stages.engines.vllm_worker_extension.FP8RLWorkerExtension``
has the same methods.
"""

from __future__ import annotations

from torch import nn

WORKER_EXTENSION = "stages.engines.vllm_worker_extension.FP8RLWorkerExtension"
REPACK_TIED_HEAD = "fp8rl_repack_tied_head"


def repack_tied_head(model: nn.Module) -> None:
    """Re-process vLLM's ``lm_head`` after a reload when it is tied to the embedding.

    The tied head shares the embedding's parameter but is never sent (vLLM's
    Qwen3 ``load_weights`` skips ``lm_head.*`` when tied), so the layerwise reload
    does not re-process it. On the CPU backend its processing packs a private
    copy of the weight for oneDNN (``UnquantizedEmbeddingMethod.
    process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm``): the
    logits would keep the old embedding (found with the real CPU engine, for every
    transport: ``reload_weights`` from an iterator or a folder, NCCL). On a GPU the
    call re-runs a no-op.
    """
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


class FP8RLWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): ``self`` is the worker."""

    def fp8rl_repack_tied_head(self) -> None:
        repack_tied_head(self.get_model())  # type: ignore[attr-defined]


__all__ = ["FP8RLWorkerExtension", "REPACK_TIED_HEAD", "WORKER_EXTENSION", "repack_tied_head"]
