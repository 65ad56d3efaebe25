"""Typed configuration of a campaign: the root model that holds every section.

Every knob of a run is a field here, with its default and a description; nothing
is read with ``dict.get(key, default)`` at a call site. Models are frozen and
``extra="forbid"``, so a typo in a YAML preset is an error that names the key.
Loading from YAML files (which touches the filesystem) lives in
``flows.campaign.configuration``; this module is pure pydantic.

The defaults follow docs/method.md and the paper (Chen et al. 2026);
values the paper does not give are marked "our choice".
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from fp8rl_core.config.clip_mode_kinds import refusals as clip_mode_refusals
from fp8rl_core.config.cluster import ClusterConfig, RetryConfig
from fp8rl_core.config.corrections import CorrectionConfig
from fp8rl_core.config.engine_kinds import ENGINE_KINDS
from fp8rl_core.config.method import AlgorithmConfig, CalibrationConfig, PrecisionConfig
from fp8rl_core.config.model import BootstrapConfig, CodeConfig, ModelConfig, PromptConfig, TaskConfig
from fp8rl_core.config.pipeline import (
    CheckpointConfig,
    EvaluationConfig,
    GuardConfig,
    RolloutConfig,
    StorageConfig,
    SurgeConfig,
    TrackerName,
    TrackingConfig,
)
from fp8rl_core.config.precision_kinds import PRECISION_MODES
from fp8rl_core.config.section import Section
from fp8rl_core.config.timeouts import TimeoutConfig

# Fields that name a registry entry (algorithm.advantage, .loss and .loss_agg, precision.train and .rollout,
# calibration.mode) are plain strings: the registries are the one list of names, and
# fp8rl_core.registered.unknown_names checks a config against them where configs are loaded.


class CampaignConfig(Section):
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
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig, description="The job `fp8rl submit` renders: nodes, GPUs, partition, paths."
    )
    retries: RetryConfig = Field(default_factory=RetryConfig, description="Resubmissions of a failed cluster job.")

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
        engine = ENGINE_KINDS.get(self.rollout.engine)  # the rollout section checked the name
        if self.precision.rollout in PRECISION_MODES and not engine.serves(self.precision.rollout):
            raise ValueError(
                f"rollout.engine {self.rollout.engine} does not serve precision.rollout {self.precision.rollout!r}; "
                f"it serves {', '.join(engine.rollout_precisions or ())}"
            )
        if self.rollout.weight_format == "native_fp8" and _family(self.precision.rollout) != "fp8":
            raise ValueError(
                f"rollout.weight_format native_fp8 sends FP8 weights: it needs an FP8 precision.rollout "
                f"(fp8_per_tensor, fp8_per_block), got {self.precision.rollout!r}"
            )
        if c.tis_weighted_balance and a.correction != CorrectionConfig():
            raise ValueError("calibration.tis_weighted_balance weighs by token TIS: leave algorithm.correction unset")
        if a.score_centering_k and not engine.serves_top_k:
            raise ValueError(
                "algorithm.score_centering_k needs the rollout engine's top-k log-probs, which rollout.engine "
                f"{self.rollout.engine} does not request: use rollout.engine "
                f"{' or '.join(n for n in ENGINE_KINDS.names() if ENGINE_KINDS.get(n).serves_top_k)}"
            )
        if self.model.outliers.channels and engine.builds_before_policy:
            raise ValueError(
                f"model.outliers is put into the loaded policy, which rollout.engine {self.rollout.engine} does "
                "not use (it holds its own copy of the weights): use rollout.engine transformers"
            )
        refused = clip_mode_refusals(self)  # what the clip mode's record cannot run with
        if refused:
            raise ValueError("; ".join(refused))
        self._staleness_fits()
        return self

    def _staleness_fits(self) -> None:
        """``rollout.max_staleness`` needs the behaviour weight, and a rollout side that can run beside training."""
        k, r = self.rollout.max_staleness, self.rollout
        if not k:
            return
        if not self.algorithm.tis:
            raise ValueError(
                f"rollout.max_staleness={k} trains on rows sampled {k} policy version{'s' * (k > 1)} back: the "
                "behaviour weight pi_old/mu (algorithm.tis) is what corrects them; set algorithm.tis: true or "
                "rollout.max_staleness: 0"
            )
        engine = ENGINE_KINDS.get(r.engine)
        process = r.vllm_process if engine.weight_syncs else engine.processes[0]
        if process == "trainer" and (self.device.startswith("cuda") or engine.weights_on_device):
            raise ValueError(
                f"rollout.max_staleness={k} overlaps rollout with training, but rollout.engine {r.engine} runs in "
                "the trainer's process and shares its GPU (colocated), so it cannot overlap: give the engine a "
                "process and GPUs of its own (rollout.vllm_process: separate) or set rollout.max_staleness: 0"
            )


def _family(mode: str) -> str | None:
    """The precision family of ``mode`` (None for a name no registry holds: the load reports it)."""
    return PRECISION_MODES.get(mode).family if mode in PRECISION_MODES else None
