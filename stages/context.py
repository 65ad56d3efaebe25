"""Explicit stage state: what a checkpoint holds, and the run's environment.

A stage is a plain function over explicit inputs::

    summary, state = run_x(env, state, step, attempt=...)

* :class:`TrainState` — what a checkpoint holds and what moves from stage to
  stage: policy, optimizer, LR schedule, calibrator state, sampler position and
  the policy version (the RNG is the process's, captured at save). It is a
  value: a stage that changes the calibrator or the sampler returns a new one
  (``dataclasses.replace(state, ...)``); nothing reassigns another stage's fields. The
  policy's and optimizer's tensors are updated in place by the train stage
  (copying a model per step would be absurd), which then returns the state with
  its new ``policy_version``.
* :class:`RunEnv` — what does not change during a run: config, run directory,
  table writer, ledger, tokenizer, rollout engine, prompt source, variant, and
  where the process sits (rank, world size, device, process group). Frozen.

:func:`open_run` builds both, once per process. ``flows.campaign.rerun`` builds the same types (a policy-free
state for score and calibrate re-runs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fp8rl_core.calibration.calibrated_clipping import CalibratorState
from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.engine_kinds import ENGINE_KINDS
from fp8rl_core.config.precision_kinds import PRECISION_MODES
from fp8rl_core.tasks.kinds import TASK_KINDS
from fp8rl_core.tasks.verifiers import answer_parser
from stages.data.prompts import PromptSource, SamplerState, make_source
from storage.ledger.events import Ledger
from storage.parts.writer import TableWriter
from storage.run.layout import RunLayout, read_run_info

if TYPE_CHECKING:
    from stages.engines.base import RolloutEngineProtocol

log = logging.getLogger("fp8rl")

MAIN = "main"


def is_calibration_step(cfg: CampaignConfig, step: int) -> bool:
    """The fixed-K rule: steps 1, 1+K, 1+2K, ... (step 0 is the base eval).

    What a run actually did (fixed K, drift or a guard's remedy) is its ``steps.shadow``
    (``stages.runtime.io.shadow_steps``); this rule is for planning and tests only."""
    return step >= 1 and (step - 1) % cfg.calibration.interval == 0


def is_eval_step(cfg: CampaignConfig, step: int) -> bool:
    return step == 0 or step % cfg.evaluation.interval == 0 or step == cfg.steps


def is_checkpoint_step(cfg: CampaignConfig, step: int) -> bool:
    return step >= 1 and (step % cfg.checkpoint.interval == 0 or step == cfg.steps)


@dataclass(frozen=True)
class TrainState:
    """What a checkpoint holds (plus the process RNG, captured at save)."""

    policy: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    calibrator: CalibratorState
    sampler: SamplerState = dataclasses.field(default_factory=SamplerState)
    policy_version: int = 0  # last step whose update the policy holds


@dataclass(frozen=True)
class RunEnv:
    """The run's environment: constant for the life of a process."""

    cfg: CampaignConfig
    run_dir: Path
    writer: TableWriter
    ledger: Ledger
    tokenizer: Any
    engine: RolloutEngineProtocol | None  # None where no stage generates (re-scoring, re-calibrating)
    source: PromptSource
    variant: str = MAIN
    input_variant: str | None = None  # variant stages read from (None: their own)
    base_model_dir: Path | None = None
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    group: Any = None  # torch.distributed process group (None: the default one, or no distribution)

    # Derived once, when the environment is built (read as data by every stage):
    layout: RunLayout = dataclasses.field(init=False, repr=False, compare=False)
    run_id: str = dataclasses.field(init=False, repr=False, compare=False)
    is_main: bool = dataclasses.field(init=False, repr=False, compare=False)  # rank 0: talks to Prefect, writes
    # the ledger and the per-step tables
    answer_parser: Any = dataclasses.field(init=False, repr=False, compare=False)  # the source's verifier's parser:
    # a response it reads None from is garbled (docs/method.md, "Failure signals")

    def __post_init__(self) -> None:  # frozen: the derived fields are set once, here
        object.__setattr__(self, "layout", RunLayout(self.run_dir))
        object.__setattr__(self, "run_id", self.writer.run_id)
        object.__setattr__(self, "is_main", self.rank == 0)
        object.__setattr__(self, "answer_parser", answer_parser(self.source.verifier))

    @property
    def stage_comm(self):
        """The object collectives of stages every rank runs together (rollout, score); built when first
        asked for, as the process group may come after the environment."""
        from stages.runtime.stage_comm import SINGLE_PROCESS_COMM, DistStageComm

        return SINGLE_PROCESS_COMM if self.world_size == 1 else DistStageComm(self.group)

    @property
    def collective(self):
        """The trainer's reductions over ranks (built when first asked for, like :attr:`stage_comm`)."""
        from stages.trainer.collective import SINGLE_PROCESS_COLLECTIVE, DistCollective

        return SINGLE_PROCESS_COLLECTIVE if self.world_size == 1 else DistCollective(self.group, self.device)

    def close(self) -> None:
        try:
            if self.engine is not None:
                self.engine.close()
        except Exception:  # pragma: no cover - best effort
            log.debug("engine close failed", exc_info=True)


def initial_calibrator(cfg: CampaignConfig) -> CalibratorState:
    return CalibratorState.initial(
        eps_low=cfg.algorithm.eps_low, eps_high=cfg.algorithm.eps_high, config=cfg.calibration
    )


def base_model_dir(cfg: CampaignConfig, runs_root: Path) -> Path:
    """The policy's starting weights: ``model.path`` or the (cached) bootstrapped tiny model."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    from stages.bootstrap.math import NoisyTeacher, bootstrap

    b = cfg.bootstrap
    teacher = NoisyTeacher(carry_drop=b.carry_drop, noisy_steps=b.noisy_steps, switch_loss=b.switch_loss)
    cache = os.environ.get("FP8RL_BOOTSTRAP_CACHE")  # else the per-user cache (never beside the run)
    if TASK_KINDS.get(cfg.task.kind).bootstrap == "code":  # code demonstrations (stages.bootstrap.code)
        from stages.bootstrap.code import bootstrap_code

        return Path(bootstrap_code(cfg.model, cfg.task, cfg.bootstrap, cache))
    return Path(bootstrap(cfg.model, cfg.task, cfg.bootstrap, cache, teacher=teacher))


def resolve_device(setting: str) -> torch.device:
    """``auto`` = CUDA (this process's local rank) when present, else CPU; or an explicit device."""
    if setting == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        return torch.device("cpu")
    dev = torch.device(setting)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {setting!r} asked for, but this machine has no CUDA device; use device: auto or cpu")
    return dev


def check_no_silent_emulation(cfg: CampaignConfig, device: torch.device, report: Any) -> None:
    """On a GPU, emulated FP8 is an error unless asked for (``precision.emulate: true``)."""
    mode = PRECISION_MODES.get(cfg.precision.train)
    if device.type != "cuda" or not mode.quantized or cfg.precision.emulate is True:
        return
    if getattr(report, "emulate", False) or getattr(report, "backend", "") == "fp8rl-emulated":
        converted = tuple(getattr(report, "converted", ()) or ("?",))
        try:
            cap = f"SM{''.join(map(str, torch.cuda.get_device_capability(device)))}"
        except Exception:  # no CUDA runtime to ask (tests)
            cap = "unknown capability"
        need = mode.sm
        raise RuntimeError(
            f"precision {cfg.precision.train!r} on {device}: layer {converted[0]} (and {len(converted) - 1} more) "
            f"would silently run emulated FP8 (backend {report.backend}): the real kernels need {need}+, this GPU is "
            f"{cap}; set precision.emulate: true to accept emulation"
        )


def state_layer_precision(
    run_dir: Path, policy: torch.nn.Module, report: Any, *, main: bool, compiled: Any = None
) -> dict:
    """Say which linears train in FP8 and which stay BF16, and why, and whether the decoder blocks run
    compiled (``compiled``: a ``CompileChoice``): one console line and ``run.json``'s ``layer_precision``
    (rank 0). Returns the summary (``fp8rl_core.precision.layers``)."""
    from fp8rl_core.precision.layers import layer_precision, precision_line
    from storage.run.layout import update_run_info

    summary = layer_precision(policy, report)
    if compiled is not None:
        summary["compile"] = compiled.as_dict()
    if main:
        print(precision_line(summary), flush=True)
        update_run_info(run_dir, layer_precision=summary)
    return summary


def _state_sharding(run_dir: Path, policy: torch.nn.Module, world_size: int) -> None:
    """How this launch trains, in ``run.json``'s ``sharding`` (a resume on another rank count rewrites it):
    the rank count and whether FSDP2 all-gathers torchao's float8 weights as float8."""
    from stages.trainer.distributed import uses_fsdp_float8
    from storage.run.layout import update_run_info

    update_run_info(run_dir, sharding={"ranks": world_size, "float8_all_gather": uses_fsdp_float8(policy)})


def _base_model_rank0_first(cfg: CampaignConfig, runs_root: Path, rank: int, world_size: int, group: Any) -> Path:
    """Rank 0 builds (or finds) the bootstrap cache while the other ranks wait, then they read it."""
    if world_size == 1:
        return base_model_dir(cfg, runs_root)
    import torch.distributed as dist

    if rank == 0:
        base = base_model_dir(cfg, runs_root)
        dist.barrier(group=group)
        return base
    dist.barrier(group=group)
    return base_model_dir(cfg, runs_root)


def _base_policy(cfg: CampaignConfig, run_dir: Path, rank: int, world_size: int, group: Any) -> Path:
    """The run's base policy, a bootstrapped one checked: its files as built, and the one the run started
    from (``stages.bootstrap.integrity``; rank 0 records it on the first start). ``model.path`` is read as it is."""
    from stages.bootstrap.integrity import check_base_policy

    base = _base_model_rank0_first(cfg, run_dir.parent, rank, world_size, group)
    if cfg.model.path is None:
        check_base_policy(run_dir, base, record=rank == 0)
    return base


def _load_policy(cfg: CampaignConfig, base: Path) -> tuple[torch.nn.Module, Any]:
    """The base policy (fp32 masters, on the host) with the prompt format's stop tokens, and its tokenizer."""
    from fp8rl_core.tasks.tiny_model import load_policy
    from stages.data.prompt_format import apply_stop_tokens

    policy, tokenizer = load_policy(base)
    apply_stop_tokens(policy, tokenizer, cfg.prompt)  # chat format: stop at the template's end-of-turn
    return policy, tokenizer


def _make_rollout_engine(
    cfg: CampaignConfig,
    policy: torch.nn.Module,
    tokenizer: Any,
    base: Path,
    *,
    rank: int = 0,
    world_size: int = 1,
    group: Any = None,
) -> RolloutEngineProtocol:
    """The run's engine; an engine synced by NCCL gets the rendezvous (a null port: rank 0 picks one and tells
    the other ranks, a collective) and this trainer rank's place in it."""
    from stages.engines import make_engine

    engine_opts: dict[str, Any] = {}
    if ENGINE_KINDS.get(cfg.rollout.engine).loads_from_path:
        engine_opts["model_path"] = str(base)
    if cfg.rollout.syncs_by_nccl:
        from stages.engines.nccl_sync import resolve_rendezvous

        engine_opts["nccl_master"] = resolve_rendezvous(cfg.rollout, rank=rank, world_size=world_size, group=group)
    return make_engine(
        cfg.rollout.engine,
        model=policy,
        tokenizer=tokenizer,
        precision=cfg.precision,
        config=cfg.rollout,
        **engine_opts,
    )


def _checkpoint_activations(policy: torch.nn.Module) -> None:
    from fp8rl_core.precision.bf16_pass import enable_activation_checkpointing, recompute_like_forward

    enable_activation_checkpointing(policy)
    recompute_like_forward(policy)  # the forward's bf16 casts (one process) and CPU GEMM mode


def open_run(
    cfg: CampaignConfig,
    run_dir: str | Path,
    *,
    variant: str = MAIN,
    rank: int = 0,
    world_size: int = 1,
    group: Any = None,
) -> tuple[RunEnv, TrainState]:
    """Load the base policy, build the rollout engine, convert the policy to the training precision and
    place it (one device, or FSDP2 shards), build the optimizer; return the run's environment and state.

    A vLLM engine is built first, while the trainer holds nothing on the device, and
    under torchrun the policy goes from the host straight into its shards: no
    device ever holds the whole fp32 model."""
    from fp8rl_core.precision.conversion import convert_for_training
    from fp8rl_core.precision.outliers import inject_outliers
    from stages.bootstrap.math import capped_threads
    from stages.trainer.block_compile import compile_choice, compile_decoder_blocks
    from stages.trainer.optimizer import make_optimizer

    torch.set_num_threads(capped_threads(cfg.threads))
    run_dir = Path(run_dir)
    read_run_info(run_dir)  # fails clearly on a non-run directory
    device = resolve_device(cfg.device)
    base = _base_policy(cfg, run_dir, rank, world_size, group)
    policy, tokenizer = _load_policy(cfg, base)  # fp32 masters, on the host
    # vLLM loads its own copy from disk: it is built before any trainer weight reaches the device (its start-up
    # check wants utilization x total free), and under torchrun the policy is sharded straight from the host
    own_copy = ENGINE_KINDS.get(cfg.rollout.engine).builds_before_policy
    ranks = {"rank": rank, "world_size": world_size, "group": group}
    engine = _make_rollout_engine(cfg, policy, tokenizer, base, **ranks) if own_copy else None
    if engine is None:  # the transformers engine copies the converted, unsharded policy where it trains
        policy.to(device)
    report = convert_for_training(
        policy,
        cfg.precision.train,
        emulate=cfg.precision.emulate,
        backend=cfg.precision.backend,
        keep_high_precision=cfg.precision.keep_high_precision,
        seed=cfg.seed,
        round_scales_to_power_of_2=cfg.precision.round_scales_to_power_of_2,
        device=device,
    )
    check_no_silent_emulation(cfg, device, report)
    inject_outliers(policy, cfg.model.outliers.channels, cfg.model.outliers.log2_scale, cfg.model.seed)  # a lever
    compiled = compile_choice(cfg.precision.compile, device, report.backend)
    state_layer_precision(run_dir, policy, report, main=rank == 0, compiled=compiled)
    if cfg.algorithm.activation_checkpointing:
        _checkpoint_activations(policy)
    if engine is None:
        engine = _make_rollout_engine(cfg, policy, tokenizer, base, **ranks)
    if compiled.enabled:  # after activation checkpointing and the engine's copy, before fully_shard (torchtitan)
        compile_decoder_blocks(policy)
    if world_size > 1:
        from stages.trainer.distributed import shard_policy

        policy = shard_policy(policy, cfg, device=device)  # FSDP2 moves one block at a time, then shards it
    else:
        policy.to(device)
    if rank == 0:
        _state_sharding(run_dir, policy, world_size)
    optimizer, scheduler = make_optimizer(policy, cfg)
    env = _run_env(
        cfg,
        run_dir,
        TableWriter(run_dir, row_group_size=cfg.storage.row_group_size),
        tokenizer=tokenizer,
        engine=engine,
        variant=variant,
        base_model_dir=base,
        device=device,
        **ranks,
    )
    state = TrainState(policy=policy, optimizer=optimizer, scheduler=scheduler, calibrator=initial_calibrator(cfg))
    return env, state


def _run_env(cfg: CampaignConfig, run_dir: Path, writer: TableWriter, **fields: Any) -> RunEnv:
    """The :class:`RunEnv` of ``run_dir`` writing through ``writer``, with the run's ledger and the task's prompt
    source; ``fields``: the rest of its fields."""
    return RunEnv(
        cfg=cfg, run_dir=run_dir, writer=writer, ledger=Ledger(run_dir), source=make_source(cfg.task), **fields
    )


def open_storage_only(
    cfg: CampaignConfig, run_dir: str | Path, *, variant: str, input_variant: str | None = MAIN
) -> tuple[RunEnv, TrainState]:
    """Environment and state without a policy or engine (re-scoring, re-calibrating)."""
    run_dir = Path(run_dir)
    env = _run_env(
        cfg, run_dir, TableWriter(run_dir), tokenizer=None, engine=None, variant=variant, input_variant=input_variant
    )
    return env, TrainState(policy=None, optimizer=None, scheduler=None, calibrator=initial_calibrator(cfg))
