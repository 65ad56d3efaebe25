"""The rollout-engine interface: what the RL loop asks of a generator.

One step of GRPO/DAPO needs, from whatever generates the samples:

1. ``generate`` — ``n`` samples for each of ``P`` prompts, returned in *group
   layout*: the ``n`` samples of prompt 0, then the ``n`` of prompt 1, …
   (``P * n`` in all), each with its response token ids (up to and including the
   first EOS), the log-probability of every sampled token under the sampling
   distribution, and why it stopped (``"stop"``: EOS; ``"length"``: the
   ``max_new_tokens`` cap);
2. ``load_weights`` — take the trainer's new policy before the next rollout
   (FP8 rollout layers are re-quantized from the new master weights);
3. ``sleep`` / ``wake_up`` — free accelerator memory while the trainer runs
   (meaningful for a colocated vLLM engine; no-ops for the transformers one);
4. ``close``.

**What ``response_logprobs`` are.** For a sampled token ``y_t`` the engine
returns ``log q(y_t | x, y_<t)`` where ``q`` is the distribution it *sampled
from*, in its own precision (bf16, or FP8 W8A8 for an FP8 rollout). With the
default ``logprobs_mode="processed"`` that is vLLM's ``processed_logprobs``:
``log_softmax(logits / T)`` after top-p truncation (tokens outside the nucleus
get ``-inf`` and the rest are renormalised). With ``"raw"`` it is vLLM's
``raw_logprobs``: ``log_softmax(logits)``, ignoring temperature and top-p. For
``T = 1`` and ``top_p = 1`` — the RL setting — both equal the teacher-forced
log-prob a trainer recomputes, which is what truncated importance sampling
(TIS, docs/method.md) compares against. ``T = 0`` means greedy decoding;
its log-probs are ``log_softmax(logits)`` of the argmax token.

Engines are built by name through :data:`ENGINES` (``make_engine("transformers",
...)``); an unknown name is an error listing the registered ones.
"""

from __future__ import annotations

import abc
import importlib
import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypedDict, runtime_checkable

import torch

from fp8rl_core.config.engine_kinds import ENGINE_KINDS
from fp8rl_core.registry import Registry

if TYPE_CHECKING:
    from fp8rl_core.config.method import PrecisionConfig
    from fp8rl_core.config.pipeline import RolloutConfig

FinishReason = Literal["stop", "length"]
LogprobsMode = Literal["processed", "raw"]
LOGPROBS_MODES: tuple[str, ...] = ("processed", "raw")


@dataclass(frozen=True)
class RolloutSample:
    """One generated response.

    ``response_ids`` holds the generated tokens only (no prompt, no padding),
    ending with the EOS token when ``finish_reason == "stop"``;
    ``response_logprobs[t]`` is the log-prob of ``response_ids[t]`` (same length).
    ``top_ids[t]`` / ``top_logprobs[t]`` (``SamplingRequest.top_k = K``; else None): the ``K``
    most likely tokens of the distribution ``response_ids[t]`` was drawn from and
    their log-probs (the same kind as ``response_logprobs``), most likely first.
    """

    prompt_index: int
    sample_index: int
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: FinishReason
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.response_logprobs):
            raise ValueError(
                f"sample ({self.prompt_index}, {self.sample_index}): {len(self.response_ids)} response ids "
                f"but {len(self.response_logprobs)} log-probs"
            )
        if (self.top_ids is None) != (self.top_logprobs is None):
            raise ValueError(f"sample ({self.prompt_index}, {self.sample_index}): top ids and log-probs go together")
        if self.top_ids is not None and not (
            len(self.top_ids) == len(self.top_logprobs) == len(self.response_ids)
            and all(len(i) == len(lp) for i, lp in zip(self.top_ids, self.top_logprobs))
        ):
            raise ValueError(
                f"sample ({self.prompt_index}, {self.sample_index}): one top-k list of ids and of log-probs per "
                f"response token ({len(self.response_ids)})"
            )
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")


@dataclass(frozen=True)
class RolloutBatch:
    """The ``P * n`` samples of one ``generate`` call, in group layout.

    ``samples[p * n + i]`` is sample ``i`` of prompt ``p``. ``generated_tokens``
    counts response tokens (EOS included, padding excluded); ``tokens_per_second``
    divides it by the wall time of the whole call.
    """

    samples: list[RolloutSample]
    num_prompts: int
    n: int
    wall_seconds: float
    engine: str
    precision: str
    generated_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        if len(self.samples) != self.num_prompts * self.n:
            raise ValueError(f"expected {self.num_prompts} * {self.n} samples, got {len(self.samples)}")
        for k, s in enumerate(self.samples):
            if (s.prompt_index, s.sample_index) != divmod(k, self.n):
                raise ValueError(
                    f"samples are not in group layout: position {k} holds (prompt {s.prompt_index}, "
                    f"sample {s.sample_index}), expected {divmod(k, self.n)}"
                )
        object.__setattr__(self, "generated_tokens", sum(len(s.response_ids) for s in self.samples))

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.wall_seconds if self.wall_seconds > 0 else float("inf")

    def group(self, prompt_index: int) -> list[RolloutSample]:
        """The ``n`` samples of one prompt."""
        return self.samples[prompt_index * self.n : (prompt_index + 1) * self.n]

    def response_tensors(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``(ids [N, L] int64, logprobs [N, L] float32, mask [N, L] bool)``.

        ``N = P * n`` in group layout, ``L`` = the longest response; padded
        positions hold ``pad_id`` / ``0.0`` / ``False``.
        """
        n_rows = len(self.samples)
        width = max((len(s.response_ids) for s in self.samples), default=0)
        ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
        logp = torch.zeros((n_rows, width), dtype=torch.float32)
        mask = torch.zeros((n_rows, width), dtype=torch.bool)
        for r, s in enumerate(self.samples):
            k = len(s.response_ids)
            ids[r, :k] = torch.tensor(s.response_ids, dtype=torch.long)
            logp[r, :k] = torch.tensor(s.response_logprobs, dtype=torch.float32)
            mask[r, :k] = True
        return ids, logp, mask


@dataclass(frozen=True)
class SamplingRequest:
    """What one ``generate`` call asks for besides its prompts.

    ``n`` samples per prompt in group layout (``[P * n]``), drawn at ``temperature`` (0: greedy)
    within the nucleus ``top_p``, each at most ``max_new_tokens`` long; deterministic given ``seed``.

    ``top_k > 0`` also returns, per response token, the ``top_k`` most likely tokens of the
    distribution it was sampled from and their log-probs (``RolloutSample.top_ids`` /
    ``top_logprobs``: what score centering needs); an engine that cannot says so in one line.

    ``seeds`` (``[P]``, optional) seeds each prompt's group on its own, so a
    prompt's samples do not depend on which other prompts share the call; an
    engine that samples a whole call from one stream (transformers) says so
    and uses ``seed`` alone (``stages.runtime.rollout_plan`` then keeps calls the same
    on any number of ranks).
    """

    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    seeds: list[int] | None = None
    top_k: int = 0


def validate_generate_args(prompt_ids: list[list[int]], request: SamplingRequest) -> None:
    """Reject malformed ``generate`` arguments with a message naming the culprit."""
    if not prompt_ids:
        raise ValueError("generate: prompt_ids is empty; pass at least one prompt")
    seeds = request.seeds
    if seeds is not None and len(seeds) != len(prompt_ids):
        raise ValueError(f"generate: {len(seeds)} seeds for {len(prompt_ids)} prompts; pass one seed per prompt")
    for i, p in enumerate(prompt_ids):
        if len(p) == 0:
            raise ValueError(f"generate: prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
    if request.n < 1:
        raise ValueError(f"generate: n must be >= 1, got {request.n}")
    if request.temperature < 0:
        raise ValueError(f"generate: temperature must be >= 0 (0 = greedy), got {request.temperature}")
    if not 0.0 < request.top_p <= 1.0:
        raise ValueError(f"generate: top_p must be in (0, 1], got {request.top_p}")
    if request.max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {request.max_new_tokens}")


def truncate_at_eos(token_ids: list[int], eos_ids: frozenset[int]) -> tuple[list[int], FinishReason]:
    """Cut ``token_ids`` after the first EOS (kept). Returns ``(kept_ids, finish_reason)``."""
    for t, tok in enumerate(token_ids):
        if tok in eos_ids:
            return token_ids[: t + 1], "stop"
    return list(token_ids), "length"


@runtime_checkable
class RolloutEngineProtocol(Protocol):
    """What the stages ask of a rollout engine (``RunEnv.engine``); :class:`RolloutEngine` implements it.

    ``policy_version`` is the trainer's policy version the engine holds (``None``: none
    pushed yet); ``weights_discarded`` is true while only a weight push can wake it
    (vLLM asleep at level 2); ``last_sleep_memory_gib`` is the device memory in use
    before and after the last ``sleep`` (``None``: not measured).
    """

    name: str
    policy_version: int | None
    last_sleep_memory_gib: tuple[float, float] | None

    @property
    def weights_discarded(self) -> bool: ...

    def generate(self, prompt_ids: list[list[int]], request: SamplingRequest) -> RolloutBatch: ...

    def load_weights(self, train_model: torch.nn.Module) -> None: ...

    def sync_policy(self, train_model: torch.nn.Module, version: int) -> None: ...

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def close(self) -> None: ...


class EngineInputs(TypedDict):
    """What every registered engine is built from, as keyword arguments beside its own options.

    ``model``: the trainer's policy; ``tokenizer``; ``precision``
    (:class:`~fp8rl_core.config.method.PrecisionConfig`; its ``rollout`` field selects
    bf16 / ``fp8_per_tensor`` / ``fp8_per_block``); ``config``
    (:class:`~fp8rl_core.config.pipeline.RolloutConfig`). An engine's ``__init__`` takes them as
    ``**inputs: Unpack[EngineInputs]`` and reads them with :meth:`RolloutEngine._take_inputs`.
    """

    model: torch.nn.Module
    tokenizer: Any
    precision: PrecisionConfig
    config: RolloutConfig


class RolloutEngine(abc.ABC):
    """Generates grouped samples from the current policy; see the module docstring.

    Subclasses are constructed with the keyword arguments of :class:`EngineInputs`
    (``model``, ``tokenizer``, ``precision``, ``config``), plus engine-specific options.
    """

    name: str = "abstract"
    config: RolloutConfig
    precision_mode: str  # precision.rollout
    policy_version: int | None = None
    last_sleep_memory_gib: tuple[float, float] | None = None
    holds_trainer_copy: bool = False  # computes the trainer's log-probs at its own weights (train_logprobs)
    computes_apart: bool = False  # generates in processes of its own (vLLM's engine process, a server)

    def _take_inputs(self, inputs: EngineInputs) -> tuple[torch.nn.Module, Any, PrecisionConfig, RolloutConfig]:
        """``(model, tokenizer, precision, config)`` from an engine's ``**inputs``, keeping ``config`` and
        ``precision_mode``; a missing or unknown keyword is a ``TypeError``, as for a named parameter."""
        given, needed = set(inputs), EngineInputs.__required_keys__
        if given != needed:
            wrong = (("missing", needed - given), ("unexpected", given - needed))
            what = "; ".join(f"{kind} keyword arguments {sorted(names)}" for kind, names in wrong if names)
            raise TypeError(f"{type(self).__name__}(): {what}")
        self.config = inputs["config"]
        self.precision_mode = inputs["precision"].rollout
        return inputs["model"], inputs["tokenizer"], inputs["precision"], inputs["config"]

    def batch(self, samples: list[RolloutSample], num_prompts: int, n: int, start: float) -> RolloutBatch:
        """``samples`` (group layout) as this engine's batch, timed from ``start`` (``time.perf_counter()``)."""
        return RolloutBatch(
            samples=samples,
            num_prompts=num_prompts,
            n=n,
            wall_seconds=time.perf_counter() - start,
            engine=self.name,
            precision=self.precision_mode,
        )

    @property
    def weights_discarded(self) -> bool:
        """Only a weight push can wake the engine (vLLM asleep at level 2); never for most engines."""
        return False

    def sync_policy(self, train_model: torch.nn.Module, version: int) -> None:
        """:meth:`load_weights` and remember which policy version the engine now holds."""
        self.load_weights(train_model)
        self.policy_version = version

    @abc.abstractmethod
    def generate(self, prompt_ids: list[list[int]], request: SamplingRequest) -> RolloutBatch:
        """``request.n`` samples per prompt in group layout (``[P * n]``), as :class:`SamplingRequest`
        describes; deterministic given its seeds."""

    @abc.abstractmethod
    def load_weights(self, train_model: torch.nn.Module) -> None:
        """Refresh the rollout policy from the trainer's current weights."""

    def sleep(self) -> None:
        """Release accelerator memory until :meth:`wake_up` (no-op by default)."""

    def wake_up(self) -> None:
        """Undo :meth:`sleep` (no-op by default)."""

    def close(self) -> None:
        """Release every resource; the engine is unusable afterwards."""

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


ENGINES: Registry[type[RolloutEngine]] = Registry("rollout engine")
"""Engine classes by name: ``"transformers"`` and ``"vllm"``."""


def register_engine(name: str):
    """Class decorator: ``@register_engine("transformers")``; sets ``cls.name``.

    The name must have a row in :data:`fp8rl_core.config.engine_kinds.ENGINE_KINDS` whose
    ``module`` is the class's, and an engine that loads from a path must take ``model_path``."""
    kind = ENGINE_KINDS.get(name)
    register = ENGINES.register_class(name)

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
            raise TypeError(f"rollout engine {name!r}: {cls!r} is not a RolloutEngine")
        if cls.__module__ != kind.module:
            raise TypeError(f"rollout engine {name!r}: its kind names module {kind.module}, the class is in "
                            f"{cls.__module__}")
        if kind.loads_from_path and "model_path" not in inspect.signature(cls.__init__).parameters:
            raise TypeError(f"rollout engine {name!r} loads from a path: its __init__ must take model_path")
        return register(cls)

    return deco


def make_engine(
    name: str,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    precision: "PrecisionConfig",
    config: "RolloutConfig",
    **options: Any,
) -> RolloutEngine:
    """Build the engine registered under ``name`` (``config.engine`` in a campaign).

    ``options`` go to the engine class (e.g. ``logprobs_mode``, or vLLM's
    ``model_path``); an unknown name raises ``KeyError`` listing the valid ones. The kind's
    module is imported first, so an engine registers itself wherever it is first built.
    """
    importlib.import_module(ENGINE_KINDS.get(name).module)
    return ENGINES.get(name)(model=model, tokenizer=tokenizer, precision=precision, config=config, **options)
