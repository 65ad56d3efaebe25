"""The vLLM rollout engine (GPU): an adapter from our interface to ``vllm.LLM``.

**Status: written against vLLM 0.33's documented offline API, unit-tested on CPU
against a stand-in ``vllm`` module (tests/test_vllm_adapter.py); it has not been
run on a GPU with a real vLLM in this project yet.** ``vllm`` is imported only
when a :class:`VLLMEngine` is constructed (``pip install 'fp8rl[gpu]'``).

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
  seed ``seed * 1_000_003 + p * n`` and no two samples share a stream. top-k is
  left at vLLM's default (disabled).
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
* **Weights.** Each RL step: ``llm.collective_rpc("reload_weights",
  kwargs={"weights_iterator": [(name, bf16 tensor), ...]})`` — vLLM's layerwise
  reload, which re-runs the online FP8 quantization of each layer as its weights
  arrive (``weight_sync="path"`` instead writes the policy with
  ``save_pretrained`` and passes ``weights_path``). Then
  ``llm.reset_prefix_cache()``, since cached KV blocks belong to the old policy.
  Tensors are sent in state-dict order, i.e. layer by layer, which keeps
  vLLM's reload buffers small.
* **Sleep.** With ``config.sleep_between_steps`` the engine is built with
  ``enable_sleep_mode=True``; ``sleep()`` calls ``llm.sleep(level)`` (level 1
  offloads weights to CPU and drops the KV cache; level 2 drops both), and
  ``load_weights`` on a sleeping engine wakes the ``"weights"`` first, reloads,
  then wakes the ``"kv_cache"`` — so weights and KV cache are never both
  resident while the trainer's memory is still being released.

For large multi-GPU runs vLLM's weight-transfer engines (NCCL, CUDA IPC) avoid
the host round trip of ``collective_rpc``; they are not wired here.
"""

from __future__ import annotations

import gc
import importlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fp8rl_core.config import PrecisionConfig, RolloutConfig
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

VLLM_QUANTIZATION: dict[str, str | None] = {
    "bf16": None,
    "fp8_per_tensor": "fp8_per_tensor",
    "fp8_per_block": "fp8_per_block",
}
"""Our ``precision.rollout`` -> vLLM's ``LLM(quantization=...)`` online scheme."""

VLLM_LOGPROBS_MODE: dict[str, str] = {"processed": "processed_logprobs", "raw": "raw_logprobs"}

WeightSync = Literal["iterator", "path"]


def import_vllm() -> Any:
    """``import vllm`` with an actionable error when it is missing."""
    try:
        return importlib.import_module("vllm")
    except ImportError as err:
        raise ImportError(
            "the 'vllm' rollout engine needs vLLM 0.33 on a CUDA machine: pip install 'fp8rl[gpu]' "
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
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for our config (``llm_options`` override/extend them)."""
    if precision.rollout not in VLLM_QUANTIZATION:
        raise ValueError(f"no vLLM quantization for rollout precision {precision.rollout!r}; valid: {list(VLLM_QUANTIZATION)}")
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
    kwargs.update(llm_options or {})
    return kwargs


def prompt_seed(seed: int, prompt_index: int, n: int) -> int:
    """Base seed of one prompt's request; its ``n`` children use ``base + 0 .. base + n - 1``."""
    return (seed * 1_000_003 + prompt_index * n) % (2**63 - 1)


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


def trainer_weights(train_model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, bf16 CPU tensor)`` pairs of the trainer's state dict, in layer order.

    HF names are what vLLM's ``load_weights`` expects (it fuses q/k/v and
    gate/up itself). ``torch.compile``'s ``_orig_mod.`` prefix is stripped; a
    tied ``lm_head.weight`` is skipped (vLLM ties it to the embedding).
    """
    tied = bool(getattr(getattr(train_model, "config", None), "tie_word_embeddings", False))
    out = []
    for name, tensor in train_model.state_dict().items():
        name = name.replace("_orig_mod.", "")
        if tied and name == "lm_head.weight":
            continue
        out.append((name, tensor.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()))
    return out


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
        sleep_level: ``llm.sleep`` level, 1 (offload weights) or 2 (discard them).
        weight_sync: ``"iterator"`` (tensors through ``collective_rpc``) or ``"path"``.
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
        sleep_level: int = 1,
        weight_sync: WeightSync = "iterator",
        llm_options: dict[str, Any] | None = None,
        vllm_module: Any | None = None,
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        if weight_sync not in ("iterator", "path"):
            raise ValueError(f"weight_sync must be 'iterator' or 'path', got {weight_sync!r}")
        self._vllm = vllm_module if vllm_module is not None else import_vllm()
        self.config = config
        self.precision_mode = precision.rollout
        self.sleep_level = sleep_level
        self.weight_sync: WeightSync = weight_sync
        self._asleep = False
        self._tmpdir: str | None = None
        if model_path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="fp8rl-vllm-")
            model_path = self._tmpdir
            model.save_pretrained(model_path)
            if tokenizer is not None:
                tokenizer.save_pretrained(model_path)
        self.model_path = str(model_path)
        gen_cfg = getattr(model, "generation_config", None)
        eos = {getattr(tokenizer, "eos_token_id", None)}
        gen_eos = getattr(gen_cfg, "eos_token_id", None)
        eos.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        self.eos_ids = frozenset(int(e) for e in eos if e is not None)
        kwargs = build_llm_kwargs(
            config,
            precision,
            model_path=self.model_path,
            seed=seed,
            logprobs_mode=logprobs_mode,
            max_model_len=max_model_len,
            llm_options=llm_options,
        )
        self.llm: Any | None = self._vllm.LLM(**kwargs)

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
    ) -> RolloutBatch:
        llm = self._require_llm()
        if self._asleep:
            raise RuntimeError("the vLLM engine is asleep: call wake_up() or load_weights() before generate()")
        validate_generate_args(prompt_ids, n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
        params = [
            self._vllm.SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                seed=prompt_seed(seed, p, n),
                logprobs=0,
                detokenize=False,
            )
            for p in range(len(prompt_ids))
        ]
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompt_ids]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        if len(outputs) != len(prompt_ids):
            raise RuntimeError(f"vLLM returned {len(outputs)} request outputs for {len(prompt_ids)} prompts")
        return batch_from_request_outputs(
            outputs, n=n, eos_ids=self.eos_ids, wall_seconds=wall, engine=self.name, precision=self.precision_mode
        )

    def load_weights(self, train_model: nn.Module) -> None:
        llm = self._require_llm()
        if self._asleep:
            llm.wake_up(tags=["weights"])
        if self.weight_sync == "iterator":
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": trainer_weights(train_model)})
        else:
            train_model.save_pretrained(self.model_path)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": self.model_path})
        if self._asleep:
            llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        llm.reset_prefix_cache()

    def sleep(self) -> None:
        llm = self._require_llm()
        if self.config.sleep_between_steps and not self._asleep:
            llm.sleep(level=self.sleep_level)
            self._asleep = True

    def wake_up(self) -> None:
        llm = self._require_llm()
        if self._asleep:
            llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        self.llm = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _require_llm(self) -> Any:
        if self.llm is None:
            raise RuntimeError("this VLLMEngine was closed; build a new one with make_engine(...)")
        return self.llm
