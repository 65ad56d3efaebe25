"""Typed configuration of a campaign.

Every knob of a run is a field here, with its default and a description; nothing
is read with ``dict.get(key, default)`` at a call site. Models are frozen and
``extra="forbid"``, so a typo in a YAML preset is an error that names the key.
Loading from YAML files (which touches the filesystem) lives in
``flows.configuration``; this module is pure pydantic.

The defaults follow docs/method.md and the paper (Chen et al. 2026);
values the paper does not give are marked "our choice".
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fp8rl_core.config.corrections import CorrectionConfig
from fp8rl_core.config.timeouts import TimeoutConfig

# Fields that name a registry entry (algorithm.advantage, .loss and .loss_agg, precision.train and .rollout,
# calibration.mode) are plain strings: the registries are the one list of names, and
# fp8rl_core.registered.unknown_names checks a config against them where configs are loaded.


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class ModelConfig(_Frozen):
    """The policy. ``path`` set: a Hugging Face checkpoint; unset: the tiny model
    built and bootstrapped by the project (sizes below)."""

    path: str | None = Field(None, description="HF model id or local dir; None = the embedded tiny Qwen3 model.")
    hidden_size: int = Field(
        128, ge=16, le=16384, multiple_of=16, description="Tiny model hidden size (multiple of 16 for FP8 kernels)."
    )
    num_layers: int = Field(2, ge=1, le=12, description="Tiny model decoder layers.")
    num_heads: int = Field(4, ge=1, le=256, description="Tiny model attention heads.")
    num_kv_heads: int = Field(4, ge=1, le=256, description="Tiny model key/value heads (GQA when < num_heads).")
    intermediate_size: int = Field(384, ge=16, le=65536, multiple_of=16, description="Tiny model MLP width.")
    max_position_embeddings: int = Field(
        256, ge=32, le=1 << 20, description="Tiny model context length (tokens)."
    )
    tie_word_embeddings: bool = Field(True, description="Tie lm_head to the input embeddings (tiny model).")
    seed: int = Field(0, description="Seed of the tiny model's initial weights.")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={self.num_kv_heads}"
            )
        return self


class DatasetRef(_Frozen):
    """A problem set read through ``datasets`` (``stages.data.datasets_io``): a Hugging Face
    dataset name, a local folder laid out as a Hub dataset repo, a ``save_to_disk``
    folder, or a JSONL / JSON / Parquet file."""

    source: str = Field(
        description="HF dataset name (org/name), a local dataset folder, a save_to_disk folder, or "
        "a .jsonl/.json/.parquet file; relative paths resolve against task.data_dir."
    )
    config: str | None = Field(None, description="Dataset config (subset) name, e.g. 'main' for openai/gsm8k.")
    split: str = Field("train", description="Split to read.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    question_field: str = Field("problem", description="Field holding the question text.")
    answer_field: str = Field("answer", description="Field holding the gold answer (see answer_format).")
    id_field: str | None = Field(None, description="Field holding a stable id; None = the row index.")
    answer_format: Literal["plain", "gsm8k", "boxed"] = Field(
        "plain",
        description="How the gold answer reads: "
        "plain value; GSM8K's '#### n' "
        "last line; the last \\boxed{} "
        "of a solution.",
    )
    limit: int | None = Field(None, ge=1, description="Use the first N rows (None = all).")


class TaskConfig(_Frozen):
    """The training prompts and their verifier."""

    kind: Literal[
        "synthetic",
        "deepscaler",
        "gsm8k",
        "dapo_math",
        "stress",
        "code_tiny",
        "leetcode",
        "taco",
        "apps",
        "eurus_code",
        "dataset",
    ] = Field(
        "synthetic",
        description="Prompt source: the procedural arithmetic task, DeepScaleR-format JSON, GSM8K train, "
        "DAPO-Math-17K (BytedTsinghua-SIA/DAPO-Math-17k, verl format), the long-chain stress task "
        "(fp8rl_core.tasks.stress), or a code task (code_tiny: the embedded expression task; leetcode: the shipped "
        "rLLM train set; taco/apps/eurus_code: by HF name), graded in the sandbox (see code), or task.dataset "
        "(any dataset by name or path).",
    )
    difficulty: int = Field(1, ge=0, le=3, description="Synthetic task difficulty level.")
    train_size: int = Field(
        200_000, ge=1, description="Synthetic train split size (problems; drawn lazily from the seed)."
    )
    path: str | None = Field(
        None,
        description="Train file or HF dataset name for non-synthetic kinds; relative paths resolve against data_dir.",
    )
    data_dir: str | None = Field(None, description="Benchmark/data folder; default: $FP8RL_DATA_DIR.")
    seed: int = Field(
        1234, description="Seed of the synthetic task generator (train/test splits are disjoint by construction)."
    )
    hub: bool = Field(
        False,
        description="Read path (or the kind's default dataset) from the Hugging Face Hub (a "
        "machine with network access).",
    )
    dataset: DatasetRef | None = Field(
        None, description="kind=dataset: the training set (HF name or local path, split, config, field mapping)."
    )

    @model_validator(mode="after")
    def _dataset_given(self) -> "TaskConfig":
        if self.kind == "dataset" and self.dataset is None:
            raise ValueError("task.kind=dataset needs task.dataset (source, split, fields)")
        return self


class BootstrapConfig(_Frozen):
    """Supervised warm start of the tiny model (ignored when model.path is set)."""

    steps: int = Field(
        1200,
        ge=0,
        description="SFT step cap. Budget in steps, not seconds (the learning jump "
        "moves by ~200 steps between seeds); typical runs stop at 540-670 "
        "via switch_loss.",
    )
    batch_size: int = Field(128, ge=1, description="SFT batch size (sequences).")
    lr: float = Field(
        1e-3,
        gt=0,
        description="AdamW peak learning rate (cosine decay); 3e-3 left one seed on its plateau past step 1100.",
    )
    warmup_steps: int = Field(50, ge=0, description="Linear warmup steps.")
    seed: int = Field(0, description="Seed of the noisy teacher's demonstrations (weight init is model.seed).")
    carry_drop: float = Field(
        0.45,
        ge=0,
        lt=0.5,
        description="Noisy teacher: probability of forgetting each carry (< 0.5 keeps the right answer the mode).",
    )
    noisy_steps: int = Field(
        200, ge=0, description="Noisy teacher: SFT steps on noisy demonstrations after the clean phase."
    )
    switch_loss: float = Field(
        0.02, gt=0, description="Switch from the exact to the noisy teacher once the running SFT loss is below this."
    )
    threads: int = Field(2, ge=1, description="torch threads during bootstrap.")


class RolloutConfig(_Frozen):
    engine: Literal["transformers", "vllm", "vllm_http"] = Field(
        "transformers",
        description="Rollout engine: transformers (CPU, small GPU), vLLM (GPU, in process) or vllm_http "
        "(a running `vllm serve`).",
    )
    prompts_per_step: int = Field(64, ge=1, description="Prompts sampled per step (train batch size, in prompts).")
    samples_per_prompt: int = Field(8, ge=1, description="Group size G.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    max_new_tokens: int = Field(24, ge=1, description="Response length cap (tokens).")
    generation_batch_size: int = Field(512, ge=1, description="Sequences generated at once by the transformers engine.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vLLM: share of GPU memory (colocated with training)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel degree.")
    sleep_between_steps: bool = Field(True, description="vLLM: sleep the engine during training (colocated).")
    # vLLM engine details
    sleep_level: int = Field(
        1,
        ge=0,
        le=2,
        description="vLLM: llm.sleep level after rollout (0 pause, 1 offload weights, 2 discard weights).",
    )
    vllm_process: Literal["trainer", "separate"] = Field(
        "trainer",
        description="vLLM: run the engine in the "
        "trainer's process (colocated; "
        "vLLM's in-process client or "
        "external launcher) or in vLLM's "
        "own engine process.",
    )
    weight_format: Literal["bf16", "native_fp8"] = Field(
        "bf16",
        description="How trained weights reach the engine: bf16 (the engine quantizes BF16 weights itself, "
        "vLLM's online FP8) or native_fp8 (the trainer quantizes its fp32 masters on the engine's grid and "
        "sends FP8 values with their scales; FP8 rollout modes only).",
    )
    weight_sync: Literal["tensors", "ipc", "nccl", "path"] = Field(
        "tensors",
        description="vLLM: weight transfer to the engine: bf16 tensors streamed per parameter (in-process "
        "engine), CUDA IPC handles or NCCL broadcast (engine in another process), or bf16 safetensors files.",
    )
    verify_sync: Literal["first", "always", "never"] = Field(
        "first",
        description="vLLM: check with the engine's weight checksums that every layer was reloaded and re-processed.",
    )
    data_parallel: Literal["per_rank", "shared_tp"] = Field(
        "per_rank",
        description="Under torchrun: every rank "
        "drives its own engine on its "
        "own prompts (per_rank), or "
        "rank 0's tensor-parallel "
        "engine serves all ranks "
        "(shared_tp).",
    )
    server_url: str | None = Field(
        None, description="vllm_http: base URL of a running `vllm serve` (e.g. http://host:8000)."
    )
    server_timeout_s: float = Field(300.0, gt=0, description="vllm_http: timeout of one HTTP request (s).")
    server_retries: int = Field(3, ge=0, description="vllm_http: retries of a failed request before the step fails.")

    @model_validator(mode="after")
    def _sync_fits_process(self) -> "RolloutConfig":
        if self.engine == "vllm" and self.vllm_process == "trainer" and self.weight_sync == "ipc":
            raise ValueError(
                "rollout.weight_sync: ipc hands CUDA IPC handles to another process, but the vllm engine "
                "runs in the trainer's process (rollout.vllm_process: trainer): use weight_sync: tensors"
            )
        if self.engine == "vllm" and self.vllm_process == "separate" and self.weight_sync == "tensors":
            raise ValueError(
                "rollout.weight_sync: tensors needs rollout.vllm_process: trainer; "
                "for vLLM's own process use ipc, nccl or path"
            )
        return self


class AlgorithmConfig(_Frozen):
    advantage: str = Field(
        "grpo",
        description="Advantage estimator: a name in fp8rl_core.objective.advantages.ADVANTAGE_ESTIMATORS "
        "(grpo, drgrpo).",
    )
    loss: str = Field(
        "ppo",
        description="Policy loss: a name in fp8rl_core.objective.losses.POLICY_LOSSES (ppo, cispo, "
        "gspo); gspo: sequence-level ratio (fp8rl_core.objective.gspo), use eps_low=3e-4, "
        "eps_high=4e-4.",
    )
    loss_agg: str = Field(
        "token-mean", description="Loss aggregation mode: a name in fp8rl_core.objective.losses.AGGREGATIONS."
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="PPO lower clip epsilon (ratio lower bound 1-eps_low).")
    eps_high: float = Field(0.28, ge=0, description="PPO upper clip epsilon (ratio upper bound 1+eps_high).")
    dual_clip: float = Field(3.0, gt=1, description="Dual-clip constant c for negative advantages.")
    cispo_eps_high: float = Field(
        0.2,
        gt=0,
        description="CISPO: the detached IS weight is capped at 1 + this, "
        "with no lower bound. 0.2 = verl's CISPO example "
        "(examples/cispo_trainer: clip_ratio_high=0.2, "
        "clip_ratio_low=10, i.e. lower side unclamped); "
        "MiniMax-M1 tunes only this upper side.",
    )
    tis: bool = Field(True, description="Truncated importance sampling against rollout log-probs.")
    tis_cap: float = Field(2.0, gt=0, description="TIS cap C.")
    correction: CorrectionConfig = Field(
        default_factory=CorrectionConfig,
        description="The mismatch correction applied while tis is on (objective.corrections); default token TIS.",
    )
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas (each in [0, 1)).")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup (optimizer updates).")
    grad_clip: float = Field(1.0, gt=0, description="Global grad-norm clip.")
    ppo_mini_batch_size: int = Field(256, ge=1, description="Sequences per optimizer update (mini-batch).")
    micro_batch_size: int = Field(256, ge=1, description="Sequences per forward/backward (gradient accumulation unit).")
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Token budget of a micro-batch, per "
        "rank (verl's dynamic batch size): rows "
        "sorted by length within each "
        "mini-batch, each micro-batch padded "
        "only to its own longest row (and the "
        "kernel's token multiple), at most "
        "micro_batch_size rows and this many "
        "padded tokens (a longer row runs "
        "alone). The same split on 1 and N "
        "ranks; loss normalization unchanged. "
        "None = off (micro-batches of "
        "micro_batch_size rows, padded to the "
        "batch's longest row).",
    )
    ppo_epochs: int = Field(1, ge=1, description="Passes over the batch per step.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (0 = off).")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose rewards are all equal, refill by new rollouts."
    )
    max_refill_rounds: int = Field(3, ge=0, description="DAPO: extra generation rounds to refill dropped groups.")
    overlong_shaping: bool = Field(False, description="DAPO overlong reward shaping.")
    overlong_max_len: int = Field(24, ge=1, description="DAPO L_max (tokens).")
    overlong_cache_len: int = Field(4, ge=1, description="DAPO L_cache (tokens).")
    overlong_factor: float = Field(1.0, ge=0, description="DAPO overlong penalty factor.")
    token_stats_sample: float = Field(
        0.05, ge=0, le=1, description="Share of tokens written to token_stats on non-calibration steps."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder block's activations in backward (stores block inputs only)."
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW betas must each be in [0, 1), got {list(betas)}")
        return betas

    @model_validator(mode="after")
    def _batches(self) -> "AlgorithmConfig":
        if self.ppo_mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"algorithm.ppo_mini_batch_size={self.ppo_mini_batch_size} must be a multiple of "
                f"algorithm.micro_batch_size={self.micro_batch_size}"
            )
        if self.overlong_cache_len > self.overlong_max_len:
            raise ValueError("algorithm.overlong_cache_len must not exceed algorithm.overlong_max_len")
        if not self.tis and self.correction != CorrectionConfig():
            raise ValueError("algorithm.correction is set but algorithm.tis is off: set algorithm.tis: true")
        return self


class PrecisionConfig(_Frozen):
    train: str = Field(
        "fp8_tensorwise",
        description="Training matmul precision of the decoder linears: a name in "
        "fp8rl_core.precision.conversion.TRAIN_PRECISIONS (bf16, fp8_tensorwise, fp8_rowwise, fp8_blockwise, "
        "nvfp4, mxfp4).",
    )
    rollout: str = Field(
        "fp8_per_tensor",
        description="Rollout scheme (vLLM online quantization names): a name in "
        "fp8rl_core.precision.conversion.ROLLOUT_PRECISIONS (bf16, fp8_per_tensor, fp8_per_block, nvfp4_w4a4, "
        "mxfp4_w4a4).",
    )
    emulate: bool | None = Field(None, description="Emulate FP8 matmuls; None = auto (emulate unless CUDA SM89+).")
    round_scales_to_power_of_2: bool = Field(False, description="Round FP8 scales down to powers of two.")
    cpu_bf16_gemm: Literal["auto", "native", "fp32", "portable"] = Field(
        "auto",
        description="CPU only: native = PyTorch's BF16 GEMM kernels (fast with AMX-BF16/AVX512-BF16, bits "
        "depend on the CPU); fp32 = MKL's FP32 GEMMs on BF16 operands, output rounded to BF16 (the GPU's "
        "BF16 GEMM rule; 10-130x faster than native on CPUs without BF16 hardware, bits depend on the CPU "
        "vendor); portable = the same BF16 rule with exact GEMMs and library-free exp/log/sin/cos/sqrt, the "
        "same bits on every x86-64 CPU with AVX2 (fp8rl_core.cpu_numerics.portable_mode); auto = native only on a CPU "
        "with AMX-BF16/AVX512-BF16 and a model at least 256 wide, else portable (the choice is in "
        "run.json). Ignored on CUDA.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile each decoder block (stages.trainer.block_compile): auto = only on CUDA with "
        "torchao's Float8Linear (tensorwise, rowwise), whose casts torchao leaves to inductor to fuse; eager on "
        "the CPU, for the emulated linears, torchao's blockwise prototype and bf16. on/off: always/never. "
        "The choice is in run.json (layer_precision.compile) and the precision console line.",
    )
    keep_high_precision: tuple[str, ...] = Field(
        (),
        description="FP4 training: decoder linears kept in BF16 "
        "(fnmatch patterns on module names, e.g. "
        "'model.layers.1.mlp.*'); any other layer FP4 "
        "cannot take is an error.",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _yaml_switch(cls, v: object) -> object:
        """YAML reads a bare ``on``/``off`` as a bool: take it as the switch it was written as."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class BapoConfig(_Frozen):
    """BAPO (Xi et al. 2025, arXiv 2510.18927) as published: bounds re-picked before every
    optimizer update from the current ratios (``fp8rl_core.calibration.bapo``). Ranges and rho0 are
    the paper's; the steps are the public verl recipe's (run_bapo_example.sh). The three
    ``*_convention`` fields switch each point where paper and recipe differ."""

    rho0: float = Field(0.5, gt=0, lt=1, description="Target positive share rho0 (paper: 0.5).")
    lower_start: float = Field(0.6, gt=0, description="a-: c_low at the start of every update (paper: 0.6).")
    lower_max: float = Field(0.9, gt=0, description="b-: largest c_low (paper: 0.9).")
    lower_step: float = Field(0.05, gt=0, description="delta2: c_low step (recipe: ratio_lower_step=0.05).")
    upper_start: float = Field(1.2, gt=0, description="a+: c_high at the start of every update (paper: 1.2).")
    upper_max: float = Field(3.0, gt=0, description="b+: largest c_high (paper: 3.0).")
    upper_step: float = Field(
        0.1, gt=0, description="delta1: c_high step (recipe example: ratio_upper_step=0.1; recipe default 0.05)."
    )
    order: Literal["paper", "recipe"] = Field(
        "paper",
        description="paper: raise c_high while it fits, else c_low, "
        "loop while c_low can move; recipe: raise c_low "
        "to its max first, then c_high.",
    )
    boundary: Literal["paper", "recipe"] = Field(
        "paper",
        description="paper: S+ over A>0 with r < c_high, S- over "
        "A<0 with r > c_low (clipped tokens "
        "excluded); recipe: every token counts with "
        "its clamped ratio, min(r, c_high) or max(r, "
        "c_low).",
    )
    target: Literal["share", "ratio"] = Field(
        "share", description="share (paper): rho = S+/(S+ + S-); ratio (recipe): S+/S- compared with rho0."
    )
    last_step: Literal["paper", "recipe"] = Field(
        "paper",
        description="paper: move only while bound + step <= "
        "max; recipe: the last move may be "
        "shortened to land on max.",
    )

    @model_validator(mode="after")
    def _ranges(self) -> "BapoConfig":
        if self.lower_start > self.lower_max or self.upper_start > self.upper_max:
            raise ValueError("calibration.bapo: lower_start <= lower_max and upper_start <= upper_max required")
        return self


class CalibrationConfig(_Frozen):
    """Calibrated Clipping (docs/method.md) and the comparison modes."""

    mode: str = Field(
        "calibrated",
        description="Clip-bound policy, a name in fp8rl_core.calibration.calibrated_clipping.CLIP_MODES: "
        "standard, calibrated, relaxed_lower (fixed wider eps_low), "
        "calibrated_lower_only, bapo (per update, as published), "
        "bapo_joint_every_k (our earlier variant).",
    )
    interval: int = Field(20, ge=1, description="Calibrate every K steps (BF16 shadow passes run on those steps).")
    lower_min: float = Field(0.6, gt=0, description="Search interval of the lower bound L: minimum.")
    lower_max: float = Field(1.0, gt=0, description="Search interval of L: maximum.")
    upper_min: float = Field(1.0, gt=0, description="Search grid of the upper bound H: minimum.")
    upper_max: float = Field(1.8, gt=0, description="Search grid of H: maximum.")
    upper_step: float = Field(0.01, gt=0, description="Search grid step of H.")
    max_delta: float = Field(0.05, ge=0, description="Largest change of a bound per calibration (smoothing).")
    initial_lower: float | None = Field(None, description="Bounds before the first calibration; None = 1 - eps_low.")
    initial_upper: float | None = Field(None, description="None = 1 + eps_high.")
    relaxed_eps_low: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="relaxed_lower: the fixed, wider eps_low (L = 1 - "
        "this) used by the loss; alpha and over-clipping "
        "stay measured against algorithm.eps_low. Sweep: "
        "0.3, 0.4 (our choice).",
    )
    tis_weighted_balance: bool = Field(
        False,
        description="calibrated: weight each token of Pos/Neg by its TIS "
        "weight (the factor that really scales its gradient).",
    )
    bapo: BapoConfig = Field(default_factory=BapoConfig)
    # how the raw L is estimated from the shadow tokens (fp8rl_core.calibration.estimators)
    estimator: str = Field(
        "quantile",
        description=(
            "Raw-L estimator, a name in fp8rl_core.calibration.estimators.LOWER_ESTIMATORS: "
            "quantile (the paper's rule, one step), "
            "pooled (last `estimator_window` calibration steps aligned by quantile level), k_floor (widen the pool "
            "until BF16 clips `estimator_min_clipped` tokens), harrell_davis (smoothed quantile with a confidence "
            "interval)."
        ),
    )
    estimator_window: int = Field(
        4,
        ge=1,
        description=(
            "pooled: calibration steps pooled (this one included); k_floor: the most it may pool (our choice)."
        ),
    )
    estimator_min_clipped: int = Field(
        10, ge=1, description=("k_floor: widen the pool until BF16 clips at least this many A<0 tokens (our choice).")
    )
    estimator_ci_level: float = Field(
        0.9, gt=0, lt=1, description=("harrell_davis: coverage of the interval recorded in bounds.lower_ci_low/high.")
    )
    # when to recalibrate (fp8rl_core.calibration.drift) and how much of the batch the shadow passes see
    schedule: Literal["fixed", "drift"] = Field(
        "fixed",
        description="Recalibration schedule: every `interval` "
        "steps (fixed, the paper's) or when the drift "
        "signal crosses `drift_threshold` "
        "(fp8rl_core.calibration.drift).",
    )
    drift_signal: Literal["ks", "quantile"] = Field(
        "ks",
        description="Drift schedule's signal (fp8rl_core.calibration.drift): "
        "`ks`, the KS distance of the A<0 FP8 ratios "
        "vs the last calibration step; `quantile`, "
        "how far L would move if BF16's clip share "
        "had not (|q(alpha_c) - L|, in ratio units).",
    )
    drift_threshold: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Drift schedule: the signal above which the next "
        "step recalibrates (KS distance, or |dL| for "
        "`quantile`; our choice).",
    )
    drift_min_interval: int = Field(
        2, ge=1, description="Drift schedule: never recalibrate sooner than this many steps after the last calibration."
    )
    drift_max_interval: int = Field(
        20, ge=1, description="Drift schedule: always recalibrate this many steps after the last calibration."
    )
    shadow_target_error: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Subsampled shadow passes "
        "(fp8rl_core.calibration.subsample): target error "
        "of the alpha quantile, in quantile "
        "levels; None = shadow the whole batch.",
    )
    shadow_failure_prob: float = Field(
        0.05,
        gt=0,
        lt=1,
        description="Subsampled shadow: probability that the stated quantile-error bound fails (DKW delta).",
    )
    shadow_min_sequences: int = Field(16, ge=1, description="Subsampled shadow: at least this many sequences.")
    # Calibrated Clipping on GSPO's sequence ratios (fp8rl_core.objective.gspo);
    # scaled from the token-level defaults by 3e-4 / 0.2
    gspo_lower_min: float = Field(
        0.9994, gt=0, description="GSPO calibration: L search interval minimum (1 - 2 * 3e-4; our choice)."
    )
    gspo_lower_max: float = Field(1.0, gt=0, description="GSPO calibration: L search interval maximum.")
    gspo_upper_min: float = Field(1.0, gt=0, description="GSPO calibration: H grid minimum.")
    gspo_upper_max: float = Field(
        1.0012, gt=0, description="GSPO calibration: H grid maximum (1 + 3 * 4e-4; our choice)."
    )
    gspo_upper_step: float = Field(
        1e-5, gt=0, description="GSPO calibration: H grid step (the token grid's 0.01 is ~25x GSPO's whole clip range)."
    )
    gspo_max_delta: float = Field(
        7.5e-5,
        ge=0,
        description="GSPO calibration: largest change of a bound per calibration (0.05 scaled by 3e-4 / 0.2).",
    )

    @model_validator(mode="after")
    def _ranges(self) -> "CalibrationConfig":
        if self.lower_min > self.lower_max:
            raise ValueError("calibration.lower_min must be <= calibration.lower_max")
        if self.upper_min > self.upper_max:
            raise ValueError("calibration.upper_min must be <= calibration.upper_max")
        if self.drift_min_interval > self.drift_max_interval:
            raise ValueError("calibration.drift_min_interval must be <= calibration.drift_max_interval")
        return self


class BenchmarkEval(_Frozen):
    name: str = Field(
        description="Benchmark: 'synthetic' or one of aime24, aime25, amc23, math500, minerva_math, "
        "olympiadbench, gsm8k."
    )
    k: int = Field(1, ge=1, description="Samples per problem.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass.")
    max_new_tokens: int = Field(24, ge=1, description="Response cap (tokens).")
    limit: int | None = Field(None, ge=1, description="Use the first N problems (None = all).")
    dataset: DatasetRef | None = Field(
        None,
        description="Read this benchmark from a dataset (HF name or local "
        "path) instead of the shipped file; name is then free.",
    )


class EvaluationConfig(_Frozen):
    interval: int = Field(5, ge=1, description="Evaluate every E steps (and at step 0, and at the end).")
    benchmarks: tuple[BenchmarkEval, ...] = Field(
        (BenchmarkEval(name="synthetic", k=1, limit=1000),), description="Benchmarks evaluated on eval steps."
    )


class CheckpointConfig(_Frozen):
    interval: int = Field(10, ge=1, description="Checkpoint every C steps and at the end.")
    keep_last: int = Field(2, ge=1, description="Keep the newest N checkpoints.")
    keep_best_metric: str | None = Field(
        "synthetic/avg@1", description="Also keep the best checkpoint by this eval metric (benchmark/metric@k)."
    )


class CodeConfig(_Frozen):
    """Code RL: sandbox limits and prompt templates (stages.grade.sandbox, stages.grade.code). Defaults: our choice."""

    per_test_s: float = Field(4.0, gt=0, description="Wall-clock (and CPU, rounded up) limit of one test case.")
    per_sample_s: float = Field(
        20.0, gt=0, description="Wall-clock limit of all test cases of one response; cases left fail."
    )
    batch_wall_s: float = Field(
        120.0,
        gt=0,
        description="Grading of one batch never holds the step longer than this; responses not started score 0.",
    )
    max_sandboxes: int = Field(4, ge=1, description="Sandboxes run at once.")
    memory_mb: int = Field(1024, ge=64, description="Address-space limit of a program (RLIMIT_AS).")
    output_bytes: int = Field(1 << 20, ge=1024, description="stdout cap; a program writing more is killed and fails.")
    nproc: int = Field(32, ge=2, description="Process/thread cap of a program (RLIMIT_NPROC under its throw-away uid).")
    allow_unisolated: bool = Field(
        False, description="Run programs even when no namespace isolation is available (rlimits only). Unsafe."
    )
    stdio_template: str = Field(
        "{problem}\n\nWrite a Python 3 program that reads the input from stdin and prints the answer to stdout. "
        "Put the complete program in one ```python code block.",
        description="Prompt of stdin/stdout problems ({problem} = the statement).",
    )
    functional_template: str = Field(
        "{problem}\n\nComplete the class Solution in Python 3 and put it in one ```python code block.",
        description="Prompt of LeetCode-style (function-call) problems.",
    )


class StorageConfig(_Frozen):
    runs_root: str = Field(
        "runs", description="Folder holding run directories (each run's Parquet tables live under <run dir>/tables)."
    )
    row_group_size: int = Field(1_000_000, ge=1, description="Parquet row-group size (rows).")


class SurgeConfig(_Frozen):
    """Entropy surge (docs/method.md, "Failure signals"): a step whose mean token entropy exceeds
    ``factor`` x the median of the previous ``window`` steps and stays above it
    for at least ``min_steps`` steps (``fp8rl_core.signals.failure_signals``)."""

    factor: float = Field(1.5, gt=1, description="Surge threshold: multiple of the trailing median entropy.")
    window: int = Field(10, ge=1, description="Steps in the trailing median.")
    min_steps: int = Field(3, ge=1, description="Consecutive steps above the threshold that make a surge.")


class PromptConfig(_Frozen):
    """How a problem becomes the model's input (``stages.data.prompt_format``)."""

    format: Literal["auto", "chat", "plain"] = Field(
        "auto",
        description="chat: the tokenizer's chat template "
        "(instruct checkpoints); plain: the text "
        "as is (base models, as the paper's "
        "Qwen3-8B-Base runs); auto: chat only for "
        "an instruct checkpoint that has a "
        "template.",
    )
    system_prompt: str | None = Field(None, description="System message (chat format only); None = none.")
    instruction: str | None = Field(
        None,
        description="Answer-format instruction appended to each math problem; "
        "None = the built-in step-by-step/\\boxed{} one.",
    )
    enable_thinking: bool | None = Field(
        None, description="Passed to chat templates that take it (Qwen3); None = the template's default."
    )


TrackerName = Literal["tensorboard", "mlflow", "wandb"]


class TrackingConfig(_Frozen):
    """Experiment-tracker sinks (``CampaignConfig.trackers``); the Parquet tables stay the truth."""

    dir: str | None = Field(None, description="Folder of local tracker files; None = <run dir>/trackers.")
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI (server http(s)://, sqlite:///, file:); "
        "None = sqlite:///<tracker dir>/mlflow.db.",
    )
    experiment: str | None = Field(None, description="MLflow experiment / W&B project; None = the campaign name.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="W&B mode: offline (no network; `wandb sync` later) or online."
    )
    wandb_entity: str | None = Field(None, description="W&B entity (team or user); None = the default.")
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="At the end of a campaign, wait at most this long for each "
        "sink to flush (a hung sink is abandoned).",
    )
    queue_size: int = Field(
        10_000, ge=1, description="Rows buffered per sink; a full queue drops rows for that sink (warned once)."
    )


class GuardConfig(_Frozen):
    """A monitor over the step rows that rolls a campaign back (fp8rl_core.signals.guard, flows.guard)."""

    enabled: bool = Field(
        True, description="Watch every step; on a trip restore the last good checkpoint and apply the remedy."
    )
    surge_factor: float = Field(
        1.5, gt=1, description="Surge: value > factor x the median of the `window` steps before (docs/method.md)."
    )
    window: int = Field(10, ge=1, description="Surge / collapse reference: median of this many earlier steps.")
    persist: int = Field(3, ge=1, description="Surge / collapse: for at least this many consecutive steps.")
    entropy_floor: float = Field(
        0.2, ge=0, description="Entropy surge also needs entropy above this (nats; our choice)."
    )
    garbled_floor: float = Field(
        0.05, ge=0, description="Garbled surge also needs a garbled share above this (our choice)."
    )
    reward_collapse_factor: float = Field(
        0.5, gt=0, lt=1, description="Reward collapse: reward < factor x the median before."
    )
    reward_min: float = Field(
        0.1, ge=0, description="Reward collapse only counts when the reference median is at least this."
    )
    remedy: Literal["recalibrate_now", "recalibrate_every_step", "tighten", "stop"] = Field(
        "recalibrate_every_step",
        description="After a rollback: calibrate at the next step; at every step for "
        "remedy_steps; "
        "tighten the bounds by tighten_factor; or stop and alert.",
    )
    remedy_steps: int = Field(5, ge=1, description="recalibrate_every_step: for this many steps after the rollback.")
    tighten_factor: float = Field(0.5, gt=0, le=1, description="tighten: L -> 1 - f(1 - L), H -> 1 + f(H - 1).")
    max_trips: int = Field(
        2, ge=1, description="After this many rollbacks in one run the next trip stops the campaign."
    )


class CampaignConfig(_Frozen):
    """One RL campaign: all of the above plus the step budget."""

    name: str = Field(
        "tiny-cpu",
        min_length=1,
        max_length=200,
        description="Preset / campaign name (run ids start with it; at most 200 characters, it names a folder).",
    )
    seed: int = Field(0, description="Campaign seed (prompt sampling, generation, minibatch order).")
    steps: int = Field(40, ge=1, description="RL steps.")
    threads: int = Field(2, ge=1, description="torch intra-op threads.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    prompt: PromptConfig = Field(default_factory=PromptConfig)
    trackers: tuple[TrackerName, ...] = Field(
        (),
        description="Experiment trackers fed from the "
        "steps/bounds/eval_scores rows: tensorboard, mlflow, "
        "wandb (optional extras).",
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    device: str = Field(
        "auto", description="Where policy, batches and optimizer live: auto (CUDA when present), cpu, cuda, cuda:N."
    )
    surge: SurgeConfig = Field(default_factory=SurgeConfig)
    code: CodeConfig = Field(default_factory=CodeConfig)
    timeouts: TimeoutConfig = Field(
        default_factory=TimeoutConfig, description="Stage and process-group time limits, enforced alike on every rank."
    )

    @field_validator("device")
    @classmethod
    def _device_name(cls, device: str) -> str:
        # whether the machine has it is checked where a run starts (this module does not import torch)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError(f"{device!r}: expected auto, cpu, cuda or cuda:N")
        return device

    @model_validator(mode="after")
    def _batch_fits(self) -> "CampaignConfig":
        n = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if n % self.algorithm.ppo_mini_batch_size:
            raise ValueError(
                f"rollout.prompts_per_step * rollout.samples_per_prompt = {n} must be a multiple of "
                f"algorithm.ppo_mini_batch_size={self.algorithm.ppo_mini_batch_size}"
            )
        c, a = self.calibration, self.algorithm
        # a bound left unset resolves to 1 -/+ eps (eps >= 0), so only a set one can invert the pair
        lo = c.initial_lower if c.initial_lower is not None else 1.0 - a.eps_low
        hi = c.initial_upper if c.initial_upper is not None else 1.0 + a.eps_high
        if not 0 < lo <= hi:
            raise ValueError(
                f"the initial clip bounds must satisfy 0 < lower <= upper, got calibration.initial_lower "
                f"{lo} and calibration.initial_upper {hi} (None resolves from algorithm.eps_low/eps_high)"
            )
        if self.rollout.weight_format == "native_fp8" and not self.precision.rollout.startswith("fp8_"):
            raise ValueError(
                f"rollout.weight_format native_fp8 sends FP8 weights: it needs an FP8 precision.rollout "
                f"(fp8_per_tensor, fp8_per_block), got {self.precision.rollout!r}"
            )
        if c.tis_weighted_balance and a.correction != CorrectionConfig():
            raise ValueError("calibration.tis_weighted_balance weighs by token TIS: leave algorithm.correction unset")
        return self
