"""The method's sections: the RL algorithm, the precisions, BAPO and Calibrated Clipping.

The defaults follow docs/method.md and the paper (Chen et al. 2026); values the paper does
not give are marked "our choice"."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fp8rl_core.config.corrections import CorrectionConfig
from fp8rl_core.config.precision_kinds import PRECISION_MODES
from fp8rl_core.config.section import Section


class AlgorithmConfig(Section):
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
    score_centering_k: int = Field(
        0,
        ge=0,
        le=20,
        description="Score centering (0 = off): each token's score grad log pi(y) is centered by its expectation "
        "under the rollout engine's distribution, renormalized over that distribution's K most likely tokens "
        "(the engine returns them; stored in rollouts.top_token_ids / top_logprobs). Values and ratios unchanged.",
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
    old_logp_micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="How pi_old is batched. None (the default): on the training micro-batches of the "
        "step's first epoch, so each token meets the same rows in pi_old as in pi_theta. A number: in a "
        "pass of its own over this rank's rows in sample order, in micro-batches of that many rows "
        "(verl's log_prob_micro_batch_size, OpenRLHF's micro_batch_size of the old-policy pass). With "
        "per-tensor FP8 scaling a token's scale then depends on other rows in pi_old than in pi_theta: "
        "ratio noise at unchanged weights (docs/calibration.md, 'Where FP8 over-clips').",
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


class PrecisionConfig(Section):
    train: str = Field(
        "fp8_tensorwise",
        description="Training matmul precision of the decoder linears: a name in "
        "fp8rl_core.precision.conversion.TRAIN_PRECISIONS (bf16, fp8_tensorwise, fp8_rowwise, fp8_blockwise, "
        "nvfp4, mxfp4).",
    )
    rollout: str = Field(
        "fp8_per_tensor",
        description="Rollout scheme (vLLM online quantization names): a name in "
        "fp8rl_core.precision.rollout.ROLLOUT_PRECISIONS (bf16, fp8_per_tensor, fp8_per_block, nvfp4_w4a4, "
        "mxfp4_w4a4).",
    )
    emulate: bool | None = Field(None, description="Emulate FP8 matmuls; None = auto (emulate unless CUDA SM89+).")
    backend: Literal["auto", "emulated", "torchao"] = Field(
        "auto",
        description="Whose FP8 training linears: auto = torchao's float8 modules where real FP8 kernels run, "
        "the project's emulated linears elsewhere; emulated = always the project's; torchao = torchao's "
        "modules even when emulating (tensorwise, rowwise: on a CPU, the GPU run's module stack with FSDP2's "
        "float8 all-gather, slower; torchao's blockwise prototype has no emulation). FP8 modes only.",
    )
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

    @model_validator(mode="after")
    def _backend_fits_mode(self) -> "PrecisionConfig":
        fp8 = tuple(n for n in PRECISION_MODES.names() if PRECISION_MODES.get(n).trains and _family(n) == "fp8")
        if self.backend != "auto" and self.train not in fp8:
            raise ValueError(f"precision.backend: {self.backend!r} applies to FP8 training ({', '.join(fp8)}), "
                             f"not to {self.train!r}; leave it at 'auto'")
        if self.backend == "torchao" and _gpu_backend(self.train) == "torchao-blockwise" and self.emulate:
            raise ValueError("precision.backend: torchao's blockwise FP8 prototype has no emulation; "
                             "with emulate: true use backend 'auto' or 'emulated'")
        return self


class BapoConfig(Section):
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


class CalibrationConfig(Section):
    """Calibrated Clipping (docs/method.md) and the comparison modes."""

    mode: str = Field(
        "calibrated",
        description="Clip-bound policy, a name in fp8rl_core.calibration.clip_modes.CLIP_MODES: "
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


def _mode(name: str):
    return PRECISION_MODES.get(name) if name in PRECISION_MODES else None


def _family(name: str) -> str | None:
    return getattr(_mode(name), "family", None)


def _gpu_backend(name: str) -> str | None:
    return getattr(_mode(name), "gpu_backend", None)
