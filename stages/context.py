"""The in-process state a campaign's stages share.

Stages are plain functions ``stage(ctx, step) -> summary``: they read inputs
from storage (and the in-process policy held here), write outputs to storage,
and return a small dict. :class:`RunContext` is that explicit input — config,
run directory, writer, ledger, policy, optimizer, engine, calibrator and
sampler state — built once per process by :func:`open_context`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.calibration import CalibratorState
from fp8rl_core.config import CampaignConfig
from stages.prompts import PromptSource, SamplerState, make_source
from storage.layout import RunLayout, read_run_info
from storage.ledger import Ledger
from storage.writer import TableWriter

log = logging.getLogger("fp8rl")

MAIN = "main"


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A per-(step, purpose) seed, stable across processes (no ``hash()``)."""
    return (seed * 1_000_003 + step * 10_007 + salt * 101 + 1) % (2**62)


def is_calibration_step(cfg: CampaignConfig, step: int) -> bool:
    """Shadow passes and calibration run on steps 1, 1+K, 1+2K, ... (step 0 is the base eval)."""
    return step >= 1 and (step - 1) % cfg.calibration.interval == 0


def is_eval_step(cfg: CampaignConfig, step: int) -> bool:
    return step == 0 or step % cfg.evaluation.interval == 0 or step == cfg.steps


def is_checkpoint_step(cfg: CampaignConfig, step: int) -> bool:
    return step >= 1 and (step % cfg.checkpoint.interval == 0 or step == cfg.steps)


@dataclass
class RunContext:
    cfg: CampaignConfig
    run_dir: Path
    writer: TableWriter
    ledger: Ledger
    policy: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    engine: Any  # stages.engines.base.RolloutEngine
    source: PromptSource
    calibrator: CalibratorState
    sampler: SamplerState = field(default_factory=SamplerState)
    sampler_after_rollout: dict[int, SamplerState] = field(default_factory=dict)
    policy_version: int = 0  # last step whose update the policy holds
    variant: str = MAIN
    base_model_dir: Path | None = None
    timings: dict[int, dict[str, float]] = field(default_factory=dict)
    attempt: int = 0  # set by the flow for the stage being run
    input_variant: str | None = None  # variant stages read from (None: their own)
    last_eval: dict[str, float] = field(default_factory=dict)

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.run_dir)

    @property
    def run_id(self) -> str:
        return self.writer.run_id

    def record_time(self, step: int, stage: str, seconds: float) -> None:
        self.timings.setdefault(step, {})[f"{stage}_seconds"] = seconds

    def close(self) -> None:
        try:
            self.engine.close()
        except Exception:  # pragma: no cover - best effort
            log.debug("engine close failed", exc_info=True)


def base_model_dir(cfg: CampaignConfig, runs_root: Path) -> Path:
    """The policy's starting weights: ``model.path`` or the (cached) bootstrapped tiny model."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    from stages.bootstrap import NoisyTeacher, bootstrap

    b = cfg.bootstrap
    teacher = NoisyTeacher(carry_drop=b.carry_drop, noisy_steps=b.noisy_steps, switch_loss=b.switch_loss)
    cache = os.environ.get("FP8RL_BOOTSTRAP_CACHE") or str(Path(runs_root) / ".bootstrap-cache")
    return Path(bootstrap(cfg.model, cfg.task, cfg.bootstrap, cache, teacher=teacher))


def open_context(cfg: CampaignConfig, run_dir: str | Path, *, variant: str = MAIN) -> RunContext:
    """Load the base policy, convert it to the training precision, build optimizer and engine."""
    from fp8rl_core.precision import convert_for_training
    from fp8rl_core.tiny_model import load_policy
    from stages.engines import make_engine
    from stages.prompt_format import apply_stop_tokens
    from stages.train_core import make_optimizer

    torch.set_num_threads(cfg.threads)
    run_dir = Path(run_dir)
    read_run_info(run_dir)  # fails clearly on a non-run directory
    base = base_model_dir(cfg, run_dir.parent)
    policy, tokenizer = load_policy(base)
    apply_stop_tokens(policy, tokenizer, cfg.prompt)  # chat format: stop at the template's end-of-turn
    report = convert_for_training(
        policy, cfg.precision.train, emulate=cfg.precision.emulate,
        round_scales_to_power_of_2=cfg.precision.round_scales_to_power_of_2,
    )
    for line in getattr(report, "skipped", ()) or ():
        log.info("precision: %s", line)
    optimizer, scheduler = make_optimizer(policy, cfg)
    engine_opts = {"model_path": str(base)} if cfg.rollout.engine == "vllm" else {}
    engine = make_engine(cfg.rollout.engine, model=policy, tokenizer=tokenizer, precision=cfg.precision,
                         config=cfg.rollout, **engine_opts)
    calibrator = CalibratorState.initial(eps_low=cfg.algorithm.eps_low, eps_high=cfg.algorithm.eps_high, config=cfg.calibration)
    return RunContext(
        cfg=cfg, run_dir=run_dir, writer=TableWriter(run_dir, row_group_size=cfg.storage.row_group_size),
        ledger=Ledger(run_dir), policy=policy, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler,
        engine=engine, source=make_source(cfg.task), calibrator=calibrator, variant=variant, base_model_dir=base,
    )
