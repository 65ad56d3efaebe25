"""The engine-core process of the vLLM stand-in (``tests/vllm_standin.py`` is its frontend).

:class:`EngineCore` answers the frontend's utility calls (sleep, wake-up, prefix-cache reset,
``collective_rpc``, the RL weight-transfer calls) in a spawned child, decoded by an untyped msgpack
decoder as vLLM's ``EngineCoreProc`` does; :class:`Worker` holds vLLM-named, fused parameters and
reloads them by vLLM's layerwise rules, re-quantizing a fused FP8 layer only once all its parts
arrived. See the frontend's docstring for the vLLM source each rule follows.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import torch

STANDIN_GPU_UUID = "GPU-standin-0000"
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
        self.extension = kwargs.get("worker_extension_cls")  # vLLM mixes its methods into the worker class
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

    def rpc_method(self, method: str):
        """``collective_rpc(method)``: the worker's own method, or one of ``worker_extension_cls`` bound to it."""
        if hasattr(self, method):
            return getattr(self, method)
        if self.extension:
            import importlib

            module, _, name = self.extension.rpartition(".")
            cls = getattr(importlib.import_module(module), name)
            if hasattr(cls, method):
                return getattr(cls, method).__get__(self)
        raise AttributeError(f"the worker has no method {method!r} (worker_extension_cls={self.extension!r})")

    def get_model(self):
        return self.hf

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
        from stages.engines.base import SamplingRequest

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
            request = SamplingRequest(
                n=sp["n"], temperature=sp["temperature"], top_p=sp["top_p"], max_new_tokens=sp["max_tokens"], seed=seed
            )
            batch = self._engine.generate([ids], request)
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
        result = self.worker.rpc_method(method)(*args, **(kwargs or {}))
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
