"""Checkpoint stage: save everything needed to continue bit-for-bit, apply retention.

Model and optimizer state go through ``torch.distributed.checkpoint`` (DCP) into
``checkpoints/.dcp/step_<n>/``: every rank writes its own shards, and loading
reshards, so a checkpoint written by W ranks restores on any number of ranks
(one process included). The rest goes through :mod:`storage.checkpoints` into
``checkpoints/step_<n>/`` (written last, atomically, by rank 0; its manifest is
what makes the checkpoint complete): the policy as a ``from_pretrained`` folder
(safetensors; under FSDP2 the full state is gathered first), LR-schedule state,
RNG states, sampler position, calibrator state, config, policy version, the DCP
folder's name, and the latest eval metrics (for keep-best retention).
:func:`restore` is the inverse used by resume; checkpoints written before DCP
(``optimizer.pt``) still restore in one process.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from fp8rl_core.calibration import CalibratorState
from fp8rl_core.fp4_linear import fp4_rng_state, load_fp4_rng_state
from stages.context import RunEnv, TrainState
from stages.prompts import SamplerState
from stages.result import StageResult
from storage.checkpoints import apply_retention, list_checkpoints, load_checkpoint, save_checkpoint

DCP_DIR = ".dcp"


class _FullStateExport:
    """``save_pretrained`` of a sharded policy from its gathered full state (rank 0)."""

    def __init__(self, model, state: dict) -> None:
        self.model, self.state = model, state

    def save_pretrained(self, path) -> None:
        self.model.save_pretrained(path, state_dict=self.state)


def _barrier(env: RunEnv) -> None:
    if env.world_size > 1:
        import torch.distributed as dist

        dist.barrier(group=env.group)


def run_checkpoint(env: RunEnv, state: TrainState, step: int, *, attempt: int = 0,
                   metrics: dict | None = None) -> tuple[StageResult, TrainState]:
    """Save ``state`` (and the process RNG) as ``checkpoints/step_<step>``; apply retention.

    A collective under several ranks: every rank calls it."""
    from stages.distributed import full_model_state, save_sharded

    t0 = time.perf_counter()
    cfg = env.cfg
    dcp_path = env.layout.checkpoints / DCP_DIR / f"step_{int(step)}"
    if env.is_main and dcp_path.exists():
        shutil.rmtree(dcp_path)  # a re-run of this step's checkpoint
    _barrier(env)
    save_sharded(dcp_path, state.policy, state.optimizer)
    model = state.policy if env.world_size == 1 else _FullStateExport(state.policy, full_model_state(state.policy))
    out = StageResult(info={"removed": []})
    if env.is_main:
        path = save_checkpoint(
            env.run_dir, step, model=model, tokenizer=env.tokenizer, optimizer=None,
            sampler_state=state.sampler.to_dict(), calibrator_state=state.calibrator.to_dict(),
            config=cfg.model_dump(mode="json"), metrics=metrics or {},
            extra={"scheduler": state.scheduler.state_dict(), "policy_version": state.policy_version,
                   "dcp": f"{DCP_DIR}/step_{int(step)}", "world_size": env.world_size,
                   "fp4_rng": fp4_rng_state(state.policy)},
        )
        removed = apply_retention(env.run_dir, keep_last=cfg.checkpoint.keep_last, best_metric=cfg.checkpoint.keep_best_metric)
        _drop_orphan_shards(env)
        out = StageResult(outputs=[str(path)], info={"removed": [str(p) for p in removed]})
    _barrier(env)
    out.seconds = time.perf_counter() - t0
    return out, state


def _drop_orphan_shards(env: RunEnv) -> None:
    """DCP folders whose ``step_<n>`` checkpoint was removed by retention (or never committed, for older steps)."""
    base = env.layout.checkpoints / DCP_DIR
    if not base.is_dir():
        return
    steps = {p.name for _, p in list_checkpoints(env.run_dir)}
    for d in base.iterdir():
        if d.is_dir() and d.name not in steps:
            shutil.rmtree(d, ignore_errors=True)


def restore(env: RunEnv, state: TrainState, path: str | Path) -> tuple[int, TrainState]:
    """Load a checkpoint into ``state``'s policy and optimizer (in place; resharded to this
    world size) and return ``(step, state)`` with the checkpoint's schedule, sampler,
    calibrator and policy version. A collective under several ranks."""
    path = Path(path)
    ck = load_checkpoint(path, restore_rng=True)
    dcp = ck.extra.get("dcp")
    if dcp:
        from stages.distributed import load_sharded

        load_sharded(path.parent / dcp, state.policy, state.optimizer)
    else:  # a checkpoint from before DCP: full weights + optimizer.pt, one process
        load_checkpoint(path, model=state.policy, optimizer=state.optimizer, restore_rng=False)
    sched = ck.extra.get("scheduler")
    if sched:
        state.scheduler.load_state_dict(sched)
    calibrator = CalibratorState.from_dict(ck.calibrator_state) if ck.calibrator_state else state.calibrator
    load_fp4_rng_state(state.policy, ck.extra.get("fp4_rng"))  # FP4 stochastic rounding resumes its stream
    return ck.step, state.replace(
        sampler=SamplerState.from_dict(ck.sampler_state), calibrator=calibrator,
        policy_version=int(ck.extra.get("policy_version", ck.step)),
    )


def eval_scores(info: dict | None) -> dict[str, float]:
    """The numeric scores of an ``evaluate`` ledger record's info (or of an evaluate stage's summary)."""
    return {k: float(v) for k, v in ((info or {}).get("scores") or {}).items() if isinstance(v, (int, float))}


def restore_latest(env: RunEnv, state: TrainState, *, before_step: int | None = None) -> tuple[int, TrainState, dict]:
    """Restore the newest complete checkpoint (of a step < ``before_step``); all ranks together.

    Returns ``(first step to run, restored state, eval scores recorded at that step)``."""
    from stages.stage_comm import broadcast
    from storage.checkpoints import latest_complete

    at_most = None if before_step is None else before_step - 1
    path = broadcast(env, latest_complete(env.run_dir, at_most=at_most) if env.is_main else None)
    if path is None:
        return 0, state, {}
    step, state = restore(env, state, path)
    rec = env.ledger.current(variant=env.variant).get((step, "evaluate")) if env.is_main else None
    ev = broadcast(env, rec.info if rec is not None else {} if env.is_main else None)
    return step + 1, state, eval_scores(ev)
