"""What the trainer's scale-out tests share: a small model, config and batch, and 2-rank spawning.

Ranks are forked (``torch.multiprocessing``, start method fork) and meet through a FileStore of
their own, so no two groups of the suite can meet by accident."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from fp8rl_core.config.campaign import CampaignConfig
from fp8rl_core.config.model import ModelConfig
from fp8rl_core.precision.conversion import convert_for_training
from fp8rl_core.tasks.tiny_model import build_tiny_model
from stages.trainer.types import TrainBatch

SMALL = ModelConfig(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=256)


def small_cfg(mode: str = "fp8_rowwise", calibration: str | None = None, **algo) -> CampaignConfig:
    a = {"ppo_mini_batch_size": 8, "micro_batch_size": 4, "lr": 1e-3, **algo}
    c = {
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "max_new_tokens": 8},
        "algorithm": a,
        "precision": {"train": mode},
    }
    if calibration is not None:
        c["calibration"] = {"mode": calibration}
    return CampaignConfig.model_validate(c)


def ragged_masks(lengths: torch.Tensor, p: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention mask, response mask), both [n, t], of rows of ``p`` prompt tokens and ``lengths`` response tokens."""
    n = len(lengths)
    am = torch.zeros(n, t, dtype=torch.long)
    rm = torch.zeros(n, t)
    for i, ln in enumerate(lengths.tolist()):
        am[i, : p + ln] = 1
        rm[i, p : p + ln] = 1
    return am, rm


def ragged_batch(n: int, p: int, r: int, *, vocab: int = 60, seed: int = 0) -> TrainBatch:
    """``n`` rows of ``p`` prompt tokens and 2 to ``r`` response tokens (ids in [4, vocab)), random old
    log-probs and advantages; drawn in that order: lengths, ids, old log-probs, advantages."""
    g = torch.Generator().manual_seed(seed)
    t = p + r
    lengths = torch.randint(2, r + 1, (n,), generator=g)
    am, rm = ragged_masks(lengths, p, t)
    ids = torch.randint(4, vocab, (n, t), generator=g) * am
    return TrainBatch(ids, am, rm, -torch.rand(n, t, generator=g) * rm, torch.randn(n, generator=g), torch.arange(n))


def small_batch(n=16, p=7, r=6, seed=0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    t = p + r
    ids = torch.randint(4, 60, (n, t), generator=g)
    lengths = torch.randint(2, r + 1, (n,), generator=g)
    am, rm = ragged_masks(lengths, p, t)
    ids = ids * am
    adv = torch.randn(n, generator=g)
    return TrainBatch(ids, am, rm, -torch.rand(n, t, generator=g) * rm, adv, torch.arange(n))


def small_model(mode: str, seed: int = 0):
    torch.manual_seed(seed)
    m = build_tiny_model(SMALL)
    convert_for_training(m, mode)
    return m


def rendezvous() -> str:
    """A rendezvous of its own for one group of ranks: a fresh FileStore (a TCP port picked free here could
    be taken by another test's group before the ranks bind it, and two groups would then meet)."""
    import tempfile

    return f"file://{tempfile.mkdtemp(prefix='fp8rl-store-')}/store"


def leave_rank() -> None:
    """End a rank started by ``torch.multiprocessing.spawn`` (which exits through the interpreter's
    teardown) without that teardown: gloo's threads, and any thread that takes the GIL back then,
    abort the process (std::terminate, SIGABRT) one time in many. Call it once the rank's work is done
    and its results are written; a rank that raised is left to spawn's own error path."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn, args: tuple, timeout: float = 180.0, nprocs: int = 2) -> None:
    """Run ``fn(rank, *args)`` on ``nprocs`` forked ranks; fail (killing them) if they outlive ``timeout``:
    ranks whose collectives do not match hang rather than fail."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{nprocs} ranks still running after {timeout:.0f} s (mismatched collectives?)")
