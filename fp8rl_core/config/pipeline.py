"""The pipeline's sections: rollout, evaluation, checkpoints, storage, trackers, the guard, surges."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fp8rl_core.config.engine_kinds import ENGINE_KINDS
from fp8rl_core.config.model import DatasetRef
from fp8rl_core.config.section import Section, known_name


class WeightSyncRendezvous(Section):
    """Where the trainer and vLLM's workers meet for ``weight_sync: nccl`` (vLLM's ``NCCLTrainerInitInfo``).

    The NCCL group has ``1 + group`` ranks: the trainer's sender is rank 0 (trainer rank 0; the
    other trainer ranks only take part in the per-parameter all-gathers), the engine's workers
    ranks 1..group."""

    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="The trainer's address as the engine's workers reach it (trainer rank 0 listens there for "
        "the TCP rendezvous; loopback only serves an engine on the same machine).",
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="The TCP rendezvous port on host; null: a free port chosen at start-up by trainer rank 0 "
        "(and told to the other ranks).",
    )
    group: int | None = Field(
        None,
        ge=1,
        description="vLLM workers that join the transfer group: the engine's tensor x data parallel degree; null: "
        "rollout.tensor_parallel_size. The group then has 1 + group ranks.",
    )


class RolloutConfig(Section):
    engine: str = Field(
        "transformers",
        description="Rollout engine: a name in fp8rl_core.config.engine_kinds.ENGINE_KINDS: transformers (CPU, "
        "small GPU), vllm (GPU, in process or its own) or vllm_http (a running `vllm serve`).",
    )
    prompts_per_step: int = Field(64, ge=1, description="Prompts sampled per step (train batch size, in prompts).")
    samples_per_prompt: int = Field(8, ge=1, description="Group size G.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    max_new_tokens: int = Field(24, ge=1, description="Response length cap (tokens).")
    generation_batch_size: int = Field(512, ge=1, description="Sequences generated at once by the transformers engine.")
    max_staleness: int = Field(
        0,
        ge=0,
        description="Policy versions between sampling and training (lag): step t trains on rows sampled by "
        "version t - 1 - max_staleness, so the rollout of step t + max_staleness runs beside step t's training "
        "(the first max_staleness steps' rows come from version 0). 0: lockstep. Needs algorithm.tis.",
    )
    overlap: bool = Field(
        True,
        description="With max_staleness >= 1, a CPU run in one process runs its rollout side (the transformers "
        "engine in a worker process) beside training; false keeps lockstep order. The tables are the same "
        "either way at threads: 1.",
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vLLM: share of GPU memory (colocated with training)."
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="vLLM: KV cache size in GiB, in place of the share gpu_memory_utilization leaves for it "
        "(None: that share). On vLLM's CPU build the legacy VLLM_CPU_KVCACHE_SPACE variable overrides it.",
    )
    enforce_eager: bool = Field(
        False,
        description="vLLM: run the model eagerly (no torch.compile, no CUDA graphs): a start-up of seconds "
        "instead of a compilation, at a slower generation; for short runs and rehearsals.",
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
        "own engine process (under torchrun: "
        "a whole engine per rank, on its GPU).",
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
        "engine), CUDA IPC handles or NCCL broadcast (engine in another process), or bf16 safetensors files. "
        "The vllm_http engine always syncs by NCCL (tensors, the default, or nccl).",
    )
    weight_sync_rendezvous: WeightSyncRendezvous | None = Field(
        None,
        description="weight_sync nccl (and the vllm_http engine): where the trainer and the engine's workers meet "
        "(host, port, group); null: all their defaults. Set with any other weight sync it is refused at load, "
        "as a setting that would do nothing.",
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

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        return known_name(v, ENGINE_KINDS.kind, ENGINE_KINDS.names())

    @property
    def syncs_by_nccl(self) -> bool:
        """The weights reach the engine by vLLM's NCCL transfer (``weight_sync: nccl``, or the vllm_http engine)."""
        return "nccl" in (self.weight_sync, ENGINE_KINDS.get(self.engine).fixed_sync)

    @model_validator(mode="after")
    def _separate_engine_per_rank(self) -> "RolloutConfig":
        if self.vllm_process == "separate" and self.data_parallel == "shared_tp":
            raise ValueError(
                "rollout.data_parallel: shared_tp spreads one engine over the trainer's ranks, inside their "
                "processes; with rollout.vllm_process: separate every rank owns a whole engine: use per_rank"
            )
        return self

    @model_validator(mode="after")
    def _sync_fits_process(self) -> "RolloutConfig":
        self._rendezvous_fits()
        kind = ENGINE_KINDS.get(self.engine)
        if kind.fixed_sync is not None and self.weight_sync not in ("tensors", kind.fixed_sync):  # tensors: default
            raise ValueError(
                f"rollout.weight_sync: {self.weight_sync} does not reach the {self.engine} engine: it receives the "
                f"trainer's weights by {kind.fixed_sync} only (weight_sync: {kind.fixed_sync})"
            )
        if not kind.weight_syncs:
            if self.weight_sync == "nccl" and kind.fixed_sync is None:
                raise ValueError(
                    f"rollout.weight_sync: nccl is for a vLLM engine in another process, but the {self.engine} "
                    "engine copies the policy in the trainer's process: use rollout.engine: vllm with "
                    "vllm_process: separate, or vllm_http"
                )
            return self
        reach = kind.weight_syncs.get(self.vllm_process)
        if reach is None or self.weight_sync in reach:
            return self
        if self.weight_sync == "nccl":
            raise ValueError(
                f"rollout.weight_sync: nccl broadcasts from the trainer to the engine's workers in other processes, "
                f"but the {self.engine} engine runs in the trainer's process (rollout.vllm_process: trainer), where "
                "NCCL cannot group a process with itself: use vllm_process: separate, or weight_sync: tensors"
            )
        if self.weight_sync == "ipc":
            raise ValueError(
                f"rollout.weight_sync: ipc hands CUDA IPC handles to another process, but the {self.engine} engine "
                "runs in the trainer's process (rollout.vllm_process: trainer): use weight_sync: tensors"
            )
        raise ValueError(
            f"rollout.weight_sync: {self.weight_sync} needs rollout.vllm_process: trainer; "
            f"for vLLM's own process use {', '.join(reach[:-1])} or {reach[-1]}"
        )

    def _rendezvous_fits(self) -> None:
        r = self.weight_sync_rendezvous
        if r is None:
            return
        if not self.syncs_by_nccl:
            raise ValueError(
                f"rollout.weight_sync_rendezvous is set but rollout.weight_sync is {self.weight_sync}: the rendezvous "
                "is for weight_sync: nccl (or the vllm_http engine); remove it or set weight_sync: nccl"
            )
        own_engine = ENGINE_KINDS.get(self.engine).fixed_sync is None  # its workers are the engine this run builds
        if own_engine and r.group is not None and r.group != self.tensor_parallel_size:
            raise ValueError(
                f"rollout.weight_sync_rendezvous.group={r.group}, but the {self.engine} engine's workers are its "
                f"rollout.tensor_parallel_size={self.tensor_parallel_size}: leave group null or make them equal"
            )


class BenchmarkEval(Section):
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


class EvaluationConfig(Section):
    interval: int = Field(5, ge=1, description="Evaluate every E steps (and at step 0, and at the end).")
    benchmarks: tuple[BenchmarkEval, ...] = Field(
        (BenchmarkEval(name="synthetic", k=1, limit=1000),), description="Benchmarks evaluated on eval steps."
    )


class CheckpointConfig(Section):
    interval: int = Field(10, ge=1, description="Checkpoint every C steps and at the end.")
    keep_last: int = Field(2, ge=1, description="Keep the newest N checkpoints.")
    keep_best_metric: str | None = Field(
        "synthetic/avg@1", description="Also keep the best checkpoint by this eval metric (benchmark/metric@k)."
    )


class StorageConfig(Section):
    runs_root: str = Field(
        "runs", description="Folder holding run directories (each run's Parquet tables live under <run dir>/tables)."
    )
    row_group_size: int = Field(1_000_000, ge=1, description="Parquet row-group size (rows).")


class SurgeConfig(Section):
    """Entropy surge (docs/method.md, "Failure signals"): a step whose mean token entropy exceeds
    ``factor`` x the median of the previous ``window`` steps and stays above it
    for at least ``min_steps`` steps (``fp8rl_core.signals.failure_signals``)."""

    factor: float = Field(1.5, gt=1, description="Surge threshold: multiple of the trailing median entropy.")
    window: int = Field(10, ge=1, description="Steps in the trailing median.")
    min_steps: int = Field(3, ge=1, description="Consecutive steps above the threshold that make a surge.")


TrackerName = Literal["tensorboard", "mlflow", "wandb"]


class TrackingConfig(Section):
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


class GuardConfig(Section):
    """A monitor over the step rows that rolls a campaign back (fp8rl_core.signals.guard, flows.campaign.guard)."""

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
