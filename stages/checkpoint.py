"""Checkpoint stage: save everything needed to continue bit-for-bit, apply retention.

Model and optimizer state go through ``torch.distributed.checkpoint`` (DCP) into
``checkpoints/.dcp/step_<n>/``: every rank writes its own shards (into a
temporary folder, hashing each file as it is written; rank 0 gathers the sizes
and hashes into the checkpoint's manifest and renames the folder into place
with the checkpoint), and loading reshards, so a checkpoint written by W ranks restores on any number of ranks
(one process included). The rest goes through :mod:`storage.checkpoints.store` into
``checkpoints/step_<n>/`` (written last, atomically, by rank 0; its manifest is
what makes the checkpoint complete): the policy as a ``from_pretrained`` folder
(safetensors; under FSDP2 the full state is gathered first), LR-schedule state,
RNG states, sampler position, calibrator state, config, policy version, the DCP
folder's name, and the latest eval metrics (for keep-best retention).
:func:`restore` is the inverse used by resume; checkpoints written before DCP
(``optimizer.pt``) still restore in one process.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from fp8rl_core.calibration.calibrated_clipping import CalibratorState
from fp8rl_core.precision.fp4_linear import fp4_rng_state, load_fp4_rng_state
from stages.context import RunEnv, TrainState
from stages.data.prompts import SamplerState
from stages.result import StageResult
from storage import faults
from storage.checkpoints.format import DCP_DIR, HashingStream, new_dcp_tmp_dir
from storage.checkpoints.retention import apply_retention
from storage.checkpoints.store import CheckpointState, load_checkpoint, save_checkpoint
from storage.checkpoints.verify import list_checkpoints


def hashing_dcp_writer(path: Path):
    """A DCP ``FileSystemWriter`` into ``path`` and the dict it fills, file name -> size and sha256,
    computed while each file is written (``write:dcp`` is a fault point before each file)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    files: dict[str, dict] = {}

    class _HashingFileSystem(FileSystem):
        @contextmanager
        def create_stream(self, p, mode: str):
            if "w" not in mode:
                with super().create_stream(p, mode) as stream:
                    yield stream
                return
            p = Path(p)
            faults.point("write:dcp", path=p)

            def record(size: int, sha: str, name: str = p.name) -> None:
                files[name] = {"size": size, "sha256": sha}

            with HashingStream(open(p, mode), record) as stream:
                yield stream

        def rename(self, p, new_path) -> None:
            super().rename(p, new_path)
            if Path(p).name in files:
                files[Path(new_path).name] = files.pop(Path(p).name)

    writer = FileSystemWriter(str(path))
    writer.fs = _HashingFileSystem()
    return writer, files


@contextmanager
def dcp_errors():
    """Re-raise a DCP ``CheckpointException`` (a ``BaseException`` whose text is every rank's
    traceback) as the error of a rank that failed: an ``OSError`` (a full disk) first, so that
    it reaches the console as the one line an I/O failure is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        causes = [exc for exc, _trace in err.failures.values() if isinstance(exc, BaseException)]
        cause = next((c for c in causes if isinstance(c, OSError)), causes[0] if causes else None)
        if cause is None:
            raise RuntimeError(f"checkpoint save/load failed on ranks {sorted(err.failures)}") from None
        raise cause from None


class _FullStateExport:
    """``save_pretrained`` of a sharded policy from its gathered full state (rank 0): the files one process
    writes. A tied parameter (the output embedding of a tied-embedding model) is written once, under its
    first name: the gathered state holds a separate copy for each name, which ``save_pretrained`` would
    otherwise write twice."""

    def __init__(self, model, state: dict) -> None:
        self.model, self.state = model, state

    def save_pretrained(self, path) -> None:
        first: dict[int, str] = {}
        tied = {n for n, p in self.model.named_parameters(remove_duplicate=False) if first.setdefault(id(p), n) != n}
        self.model.save_pretrained(path, state_dict={k: v for k, v in self.state.items() if k not in tied})


def _barrier(env: RunEnv) -> None:
    if env.world_size > 1:
        import torch.distributed as dist

        dist.barrier(group=env.group)


def run_checkpoint(
    env: RunEnv, state: TrainState, step: int, *, attempt: int = 0, metrics: dict | None = None
) -> tuple[StageResult, TrainState]:
    """Save ``state`` (and the process RNG) as ``checkpoints/step_<step>``; apply retention.

    A collective under several ranks: every rank calls it."""
    from stages.trainer.distributed import full_model_state, save_sharded

    t0 = time.perf_counter()
    cfg = env.cfg
    tmp_dcp = env.stage_comm.broadcast(new_dcp_tmp_dir(env.layout.checkpoints, step) if env.is_main else None)
    writer, written = hashing_dcp_writer(tmp_dcp)
    try:
        with dcp_errors():
            save_sharded(tmp_dcp, state.policy, state.optimizer, storage_writer=writer)
    except BaseException:
        if env.world_size == 1:  # (under several ranks the next save's _drop_orphan_shards removes it)
            shutil.rmtree(tmp_dcp, ignore_errors=True)
        raise
    shards = env.stage_comm.gather(written)  # every rank's files, sizes and hashes, on rank 0
    model = state.policy if env.world_size == 1 else _FullStateExport(state.policy, full_model_state(state.policy))
    out = StageResult(info={"removed": []})
    if env.is_main:
        dcp_files = {name: meta for per_rank in shards for name, meta in per_rank.items()}
        path = save_checkpoint(
            env.run_dir,
            step,
            model=model,
            tokenizer=env.tokenizer,
            optimizer=None,
            state=CheckpointState(
                sampler_state=state.sampler.to_dict(),
                calibrator_state=state.calibrator.to_dict(),
                config=cfg.model_dump(mode="json"),
                metrics=metrics or {},
                extra={
                    "scheduler": state.scheduler.state_dict(),
                    "policy_version": state.policy_version,
                    "dcp": f"{DCP_DIR}/step_{int(step)}",
                    "world_size": env.world_size,
                    "fp4_rng": fp4_rng_state(state.policy),
                },
            ),
            dcp=(tmp_dcp, dcp_files),
        )
        removed = apply_retention(
            env.run_dir, keep_last=cfg.checkpoint.keep_last, best_metric=cfg.checkpoint.keep_best_metric
        )
        _drop_orphan_shards(env)
        out = StageResult(outputs=[str(path)], info={"removed": [str(p) for p in removed]})
    _barrier(env)
    out.seconds = time.perf_counter() - t0
    return out, state


def _drop_orphan_shards(env: RunEnv) -> None:
    """DCP folders whose ``step_<n>`` checkpoint was removed by retention, or never committed (a save that
    was interrupted left its temporary folder)."""
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
    ck = load_checkpoint(path, restore_rng=True)  # sizes, the DCP shards' included, verified first
    dcp = ck.extra.get("dcp")
    if dcp:
        from stages.trainer.distributed import load_sharded

        with dcp_errors():
            load_sharded(path.parent / dcp, state.policy, state.optimizer)
    else:  # a checkpoint from before DCP: full weights + optimizer.pt, one process
        load_checkpoint(path, model=state.policy, optimizer=state.optimizer, restore_rng=False)
    sched = ck.extra.get("scheduler")
    if sched:
        state.scheduler.load_state_dict(sched)
    calibrator = CalibratorState.from_dict(ck.calibrator_state) if ck.calibrator_state else state.calibrator
    load_fp4_rng_state(state.policy, ck.extra.get("fp4_rng"))  # FP4 stochastic rounding resumes its stream
    return ck.step, dataclasses.replace(state,
        sampler=SamplerState.from_dict(ck.sampler_state),
        calibrator=calibrator,
        policy_version=int(ck.extra.get("policy_version", ck.step)),
    )


def eval_scores(info: dict | None) -> dict[str, float]:
    """The numeric scores of an ``evaluate`` ledger record's info (or of an evaluate stage's summary)."""
    return {k: float(v) for k, v in ((info or {}).get("scores") or {}).items() if isinstance(v, (int, float))}


def restore_latest(env: RunEnv, state: TrainState, *, before_step: int | None = None) -> tuple[int, TrainState, dict]:
    """Restore the newest complete checkpoint (of a step < ``before_step``); all ranks together.

    Returns ``(first step to run, restored state, eval scores recorded at that step)``."""
    from stages.runtime.stage_comm import broadcast
    from storage.checkpoints.verify import latest_complete

    at_most = None if before_step is None else before_step - 1
    path = broadcast(env, latest_complete(env.run_dir, at_most=at_most) if env.is_main else None)
    if path is None:
        return 0, state, {}
    step, state = restore(env, state, path)
    rec = env.ledger.current(variant=env.variant).get((step, "evaluate")) if env.is_main else None
    ev = broadcast(env, rec.info if rec is not None else {} if env.is_main else None)
    return step + 1, state, eval_scores(ev)
