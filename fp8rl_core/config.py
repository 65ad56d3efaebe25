"""Typed configuration of a campaign.

Every knob of a run is a field here, with its default and a description; nothing
is read with ``dict.get(key, default)`` at a call site. Models are frozen and
``extra="forbid"``, so a typo in a YAML preset is an error that names the key.
Loading from YAML files (which touches the filesystem) lives in
``flows.configuration``; this module is pure pydantic.

The defaults follow ``DESIGN.md`` section 2 and the paper (Chen et al. 2026);
values the paper does not give are marked "our choice".
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TrainPrecision = Literal["bf16", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"]
RolloutPrecision = Literal["bf16", "fp8_per_tensor", "fp8_per_block"]
ClipMode = Literal["standard", "calibrated", "relaxed_lower", "bapo"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelConfig(_Frozen):
    """The policy. ``path`` set: a Hugging Face checkpoint; unset: the tiny model
    built and bootstrapped by the project (sizes below)."""

    path: str | None = Field(None, description="HF model id or local dir; None = the embedded tiny Qwen3 model.")
    hidden_size: int = Field(128, ge=16, multiple_of=16, description="Tiny model hidden size (multiple of 16 for FP8 kernels).")
    num_layers: int = Field(2, ge=1, le=12, description="Tiny model decoder layers.")
    num_heads: int = Field(4, ge=1, description="Tiny model attention heads.")
    num_kv_heads: int = Field(4, ge=1, description="Tiny model key/value heads (GQA when < num_heads).")
    intermediate_size: int = Field(384, ge=16, multiple_of=16, description="Tiny model MLP width.")
    max_position_embeddings: int = Field(256, ge=32, description="Tiny model context length (tokens).")
    tie_word_embeddings: bool = Field(True, description="Tie lm_head to the input embeddings (tiny model).")
    seed: int = Field(0, description="Seed of the tiny model's initial weights.")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} is not divisible by model.num_kv_heads={self.num_kv_heads}")
        return self


class TaskConfig(_Frozen):
    """The training prompts and their verifier."""

    kind: Literal["synthetic", "deepscaler", "gsm8k"] = Field("synthetic", description="Prompt source: the procedural arithmetic task, DeepScaleR-format JSON, or GSM8K train.")
    difficulty: int = Field(1, ge=0, le=3, description="Synthetic task difficulty level.")
    train_size: int = Field(200_000, ge=1, description="Synthetic train split size (problems; drawn lazily from the seed).")
    path: str | None = Field(None, description="Train file or HF dataset name for non-synthetic kinds; relative paths resolve against data_dir.")
    data_dir: str | None = Field(None, description="Benchmark/data folder; default: $FP8RL_DATA_DIR.")
    seed: int = Field(1234, description="Seed of the synthetic task generator (train/test splits are disjoint by construction).")


class BootstrapConfig(_Frozen):
    """Supervised warm start of the tiny model (ignored when model.path is set)."""

    steps: int = Field(1200, ge=0, description="SFT step cap. Budget in steps, not seconds (the learning jump moves by ~200 steps between seeds); typical runs stop at 540-670 via switch_loss.")
    batch_size: int = Field(128, ge=1, description="SFT batch size (sequences).")
    lr: float = Field(1e-3, gt=0, description="AdamW peak learning rate (cosine decay); 3e-3 left one seed on its plateau past step 1100.")
    warmup_steps: int = Field(50, ge=0, description="Linear warmup steps.")
    seed: int = Field(0, description="Seed of the noisy teacher's demonstrations (weight init is model.seed).")
    carry_drop: float = Field(0.45, ge=0, lt=0.5, description="Noisy teacher: probability of forgetting each carry (< 0.5 keeps the right answer the mode).")
    noisy_steps: int = Field(200, ge=0, description="Noisy teacher: SFT steps on noisy demonstrations after the clean phase.")
    switch_loss: float = Field(0.02, gt=0, description="Switch from the exact to the noisy teacher once the running SFT loss is below this.")
    threads: int = Field(2, ge=1, description="torch threads during bootstrap.")


class RolloutConfig(_Frozen):
    engine: Literal["transformers", "vllm"] = Field("transformers", description="Rollout engine: transformers (CPU, small GPU) or vLLM (GPU).")
    prompts_per_step: int = Field(64, ge=1, description="Prompts sampled per step (train batch size, in prompts).")
    samples_per_prompt: int = Field(8, ge=1, description="Group size G.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    max_new_tokens: int = Field(24, ge=1, description="Response length cap (tokens).")
    generation_batch_size: int = Field(512, ge=1, description="Sequences generated at once by the transformers engine.")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM: share of GPU memory (colocated with training).")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallel degree.")
    sleep_between_steps: bool = Field(True, description="vLLM: sleep the engine during training (colocated).")


class AlgorithmConfig(_Frozen):
    advantage: Literal["grpo", "drgrpo"] = Field("grpo", description="Advantage estimator (registry name).")
    loss: Literal["ppo", "cispo", "gspo"] = Field("ppo", description="Policy loss (registry name); gspo: sequence-level ratio (fp8rl_core.gspo), use eps_low=3e-4, eps_high=4e-4.")
    loss_agg: LossAgg = Field("token-mean", description="Loss aggregation mode.")
    eps_low: float = Field(0.2, ge=0, lt=1, description="PPO lower clip epsilon (ratio lower bound 1-eps_low).")
    eps_high: float = Field(0.28, ge=0, description="PPO upper clip epsilon (ratio upper bound 1+eps_high).")
    dual_clip: float = Field(3.0, gt=1, description="Dual-clip constant c for negative advantages.")
    cispo_eps_high: float = Field(4.0, gt=0, description="CISPO: upper truncation of the IS weight (1+eps).")
    tis: bool = Field(True, description="Truncated importance sampling against rollout log-probs.")
    tis_cap: float = Field(2.0, gt=0, description="TIS cap C.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup (optimizer updates).")
    grad_clip: float = Field(1.0, gt=0, description="Global grad-norm clip.")
    ppo_mini_batch_size: int = Field(256, ge=1, description="Sequences per optimizer update (mini-batch).")
    micro_batch_size: int = Field(256, ge=1, description="Sequences per forward/backward (gradient accumulation unit).")
    ppo_epochs: int = Field(1, ge=1, description="Passes over the batch per step.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (0 = off).")
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal, refill by new rollouts.")
    max_refill_rounds: int = Field(3, ge=0, description="DAPO: extra generation rounds to refill dropped groups.")
    overlong_shaping: bool = Field(False, description="DAPO overlong reward shaping.")
    overlong_max_len: int = Field(24, ge=1, description="DAPO L_max (tokens).")
    overlong_cache_len: int = Field(4, ge=1, description="DAPO L_cache (tokens).")
    overlong_factor: float = Field(1.0, ge=0, description="DAPO overlong penalty factor.")
    token_stats_sample: float = Field(0.05, ge=0, le=1, description="Share of tokens written to token_stats on non-calibration steps.")
    activation_checkpointing: bool = Field(False, description="Recompute each decoder block's activations in backward (stores block inputs only).")

    @model_validator(mode="after")
    def _batches(self) -> "AlgorithmConfig":
        if self.ppo_mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"algorithm.ppo_mini_batch_size={self.ppo_mini_batch_size} must be a multiple of "
                f"algorithm.micro_batch_size={self.micro_batch_size}"
            )
        if self.overlong_cache_len > self.overlong_max_len:
            raise ValueError("algorithm.overlong_cache_len must not exceed algorithm.overlong_max_len")
        return self


class PrecisionConfig(_Frozen):
    train: TrainPrecision = Field("fp8_tensorwise", description="Training matmul precision of the decoder linears.")
    rollout: RolloutPrecision = Field("fp8_per_tensor", description="Rollout W8A8 scheme (vLLM online quantization names).")
    emulate: bool | None = Field(None, description="Emulate FP8 matmuls; None = auto (emulate unless CUDA SM89+).")
    round_scales_to_power_of_2: bool = Field(False, description="Round FP8 scales down to powers of two.")


class CalibrationConfig(_Frozen):
    """Calibrated Clipping (DESIGN.md section 2) and the comparison modes."""

    mode: ClipMode = Field("calibrated", description="Clip-bound policy: standard, calibrated, relaxed_lower, bapo.")
    interval: int = Field(20, ge=1, description="Calibrate every K steps (BF16 shadow passes run on those steps).")
    lower_min: float = Field(0.6, gt=0, description="Search interval of the lower bound L: minimum.")
    lower_max: float = Field(1.0, gt=0, description="Search interval of L: maximum.")
    upper_min: float = Field(1.0, gt=0, description="Search grid of the upper bound H: minimum.")
    upper_max: float = Field(1.8, gt=0, description="Search grid of H: maximum.")
    upper_step: float = Field(0.01, gt=0, description="Search grid step of H.")
    max_delta: float = Field(0.05, ge=0, description="Largest change of a bound per calibration (smoothing).")
    initial_lower: float | None = Field(None, description="Bounds before the first calibration; None = 1 - eps_low.")
    initial_upper: float | None = Field(None, description="None = 1 + eps_high.")
    bapo_rho0: float = Field(0.4, gt=0, lt=1, description="BAPO: target share of positive contribution.")
    bapo_lower_min: float = Field(0.6, gt=0, description="BAPO lower grid minimum.")
    bapo_lower_max: float = Field(0.9, gt=0, description="BAPO lower grid maximum.")
    bapo_lower_step: float = Field(0.02, gt=0, description="BAPO lower grid step.")
    bapo_upper_min: float = Field(1.2, gt=0, description="BAPO upper grid minimum.")
    bapo_upper_max: float = Field(3.0, gt=0, description="BAPO upper grid maximum.")
    bapo_upper_step: float = Field(0.05, gt=0, description="BAPO upper grid step.")
    # issue 15: when to recalibrate (fp8rl_core.drift) and how much of the batch the shadow passes see
    schedule: Literal["fixed", "drift"] = Field("fixed", description="Recalibration schedule: every `interval` steps (fixed, the paper's) or when the drift signal crosses `drift_threshold` (fp8rl_core.drift).")
    drift_threshold: float = Field(0.1, gt=0, le=1, description="Drift schedule: KS distance of the A<0 FP8 ratios vs the last calibration step that triggers a recalibration (our choice).")
    drift_min_interval: int = Field(2, ge=1, description="Drift schedule: never recalibrate sooner than this many steps after the last calibration.")
    drift_max_interval: int = Field(20, ge=1, description="Drift schedule: always recalibrate this many steps after the last calibration.")
    shadow_target_error: float | None = Field(None, gt=0, lt=1, description="Subsampled shadow passes (fp8rl_core.subsample): target error of the alpha quantile, in quantile levels; None = shadow the whole batch.")
    shadow_failure_prob: float = Field(0.05, gt=0, lt=1, description="Subsampled shadow: probability that the stated quantile-error bound fails (DKW delta).")
    shadow_min_sequences: int = Field(16, ge=1, description="Subsampled shadow: at least this many sequences.")
    # issue 15: Calibrated Clipping on GSPO's sequence ratios (fp8rl_core.gspo); scaled from the token-level defaults by 3e-4 / 0.2
    gspo_lower_min: float = Field(0.9994, gt=0, description="GSPO calibration: L search interval minimum (1 - 2 * 3e-4; our choice).")
    gspo_lower_max: float = Field(1.0, gt=0, description="GSPO calibration: L search interval maximum.")
    gspo_upper_min: float = Field(1.0, gt=0, description="GSPO calibration: H grid minimum.")
    gspo_upper_max: float = Field(1.0012, gt=0, description="GSPO calibration: H grid maximum (1 + 3 * 4e-4; our choice).")
    gspo_upper_step: float = Field(1e-5, gt=0, description="GSPO calibration: H grid step (the token grid's 0.01 is ~25x GSPO's whole clip range).")
    gspo_max_delta: float = Field(7.5e-5, ge=0, description="GSPO calibration: largest change of a bound per calibration (0.05 scaled by 3e-4 / 0.2).")

    @model_validator(mode="after")
    def _ranges(self) -> "CalibrationConfig":
        if self.lower_min > self.lower_max:
            raise ValueError("calibration.lower_min must be <= calibration.lower_max")
        if self.upper_min > self.upper_max:
            raise ValueError("calibration.upper_min must be <= calibration.upper_max")
        if self.bapo_lower_min > self.bapo_lower_max or self.bapo_upper_min > self.bapo_upper_max:
            raise ValueError("calibration.bapo_* ranges must have min <= max")
        if self.drift_min_interval > self.drift_max_interval:
            raise ValueError("calibration.drift_min_interval must be <= calibration.drift_max_interval")
        return self


class BenchmarkEval(_Frozen):
    name: str = Field(description="Benchmark: 'synthetic' or one of aime24, aime25, amc23, math500, minerva_math, olympiadbench, gsm8k.")
    k: int = Field(1, ge=1, description="Samples per problem.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass.")
    max_new_tokens: int = Field(24, ge=1, description="Response cap (tokens).")
    limit: int | None = Field(None, ge=1, description="Use the first N problems (None = all).")


class EvaluationConfig(_Frozen):
    interval: int = Field(5, ge=1, description="Evaluate every E steps (and at step 0, and at the end).")
    benchmarks: tuple[BenchmarkEval, ...] = Field(
        (BenchmarkEval(name="synthetic", k=1, limit=1000),), description="Benchmarks evaluated on eval steps."
    )


class CheckpointConfig(_Frozen):
    interval: int = Field(10, ge=1, description="Checkpoint every C steps and at the end.")
    keep_last: int = Field(2, ge=1, description="Keep the newest N checkpoints.")
    keep_best_metric: str | None = Field("synthetic/avg@1", description="Also keep the best checkpoint by this eval metric (benchmark/metric@k).")


class StorageConfig(_Frozen):
    runs_root: str = Field("runs", description="Folder holding run directories (each run's Parquet tables live under <run dir>/tables).")
    row_group_size: int = Field(1_000_000, ge=1, description="Parquet row-group size (rows).")


class GuardConfig(_Frozen):
    """Issue 15: a monitor over the step rows that rolls a campaign back (fp8rl_core.guard, flows.guard)."""

    enabled: bool = Field(True, description="Watch every step; on a trip restore the last good checkpoint and apply the remedy.")
    surge_factor: float = Field(1.5, gt=1, description="Surge: value > factor x the median of the `window` steps before (DESIGN).")
    window: int = Field(10, ge=1, description="Surge / collapse reference: median of this many earlier steps (DESIGN).")
    persist: int = Field(3, ge=1, description="Surge / collapse: for at least this many consecutive steps (DESIGN).")
    entropy_floor: float = Field(0.2, ge=0, description="Entropy surge also needs entropy above this (nats; our choice).")
    garbled_floor: float = Field(0.05, ge=0, description="Garbled surge also needs a garbled share above this (our choice).")
    reward_collapse_factor: float = Field(0.5, gt=0, lt=1, description="Reward collapse: reward < factor x the median before.")
    reward_min: float = Field(0.1, ge=0, description="Reward collapse only counts when the reference median is at least this.")
    remedy: Literal["recalibrate_now", "recalibrate_every_step", "tighten", "stop"] = Field(
        "recalibrate_every_step", description="After a rollback: calibrate at the next step; at every step for remedy_steps; "
        "tighten the bounds by tighten_factor; or stop and alert.")
    remedy_steps: int = Field(5, ge=1, description="recalibrate_every_step: for this many steps after the rollback.")
    tighten_factor: float = Field(0.5, gt=0, le=1, description="tighten: L -> 1 - f(1 - L), H -> 1 + f(H - 1).")
    max_trips: int = Field(2, ge=1, description="After this many rollbacks in one run the next trip stops the campaign.")


class CampaignConfig(_Frozen):
    """One RL campaign: all of the above plus the step budget."""

    name: str = Field("tiny-cpu", description="Preset / campaign name (run ids start with it).")
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
    guard: GuardConfig = Field(default_factory=GuardConfig)
    device: str = Field("auto", description="Where policy, batches and optimizer live: auto (CUDA when present), cpu, cuda, cuda:N.")

    @model_validator(mode="after")
    def _batch_fits(self) -> "CampaignConfig":
        n = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if n % self.algorithm.ppo_mini_batch_size:
            raise ValueError(
                f"rollout.prompts_per_step * rollout.samples_per_prompt = {n} must be a multiple of "
                f"algorithm.ppo_mini_batch_size={self.algorithm.ppo_mini_batch_size}"
            )
        return self

    def initial_bounds(self) -> tuple[float, float]:
        """(L, H) in force before the first calibration."""
        c = self.calibration
        lo = c.initial_lower if c.initial_lower is not None else 1.0 - self.algorithm.eps_low
        hi = c.initial_upper if c.initial_upper is not None else 1.0 + self.algorithm.eps_high
        return lo, hi
