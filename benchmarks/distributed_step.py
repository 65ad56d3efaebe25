"""2-rank FSDP2 train step (gloo, 1 thread each) vs 1 process (2 threads), same global batch.

Both run ``policy_update`` on the same global batch, mini-batches and
micro-batches (the ranks together run the 1-process micro-batches); the script
prints the 2-rank step time divided by the 1-process step time. Goal <= 1.15.
The ranks' time includes FSDP2's all-gathers and reduce-scatters and the
gathers of the global statistics.

    nice -n 15 python benchmarks/distributed_step.py [--rows 128] [--mode fp8_rowwise] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time

import torch


def _setup(rows: int, mode: str):
    from fp8rl_core.config.campaign import CampaignConfig
    from fp8rl_core.config.model import ModelConfig
    from fp8rl_core.precision.conversion import convert_for_training
    from fp8rl_core.tasks.tiny_model import build_tiny_model
    from stages.trainer.types import TrainBatch

    cfg = CampaignConfig.model_validate(
        {
            "rollout": {"prompts_per_step": rows // 8, "samples_per_prompt": 8},
            "algorithm": {"ppo_mini_batch_size": rows // 2, "micro_batch_size": rows // 4},
            "precision": {"train": mode},
        }
    )
    torch.manual_seed(0)
    model = build_tiny_model(ModelConfig())
    convert_for_training(model, mode)
    g = torch.Generator().manual_seed(1)
    n, p, r = rows, 14, 12
    ids = torch.randint(4, 60, (n, p + r), generator=g)
    rm = torch.zeros(n, p + r)
    rm[:, p:] = 1
    batch = TrainBatch(
        ids,
        torch.ones_like(ids),
        rm,
        -torch.rand(n, p + r, generator=g) * rm,
        torch.randn(n, generator=g),
        torch.arange(n),
    )
    return cfg, model, batch


def _time_steps(model, cfg, batch, repeats, collective=None) -> float:
    from stages.trainer.collective import SINGLE_PROCESS_COLLECTIVE
    from stages.trainer.optimizer import make_optimizer
    from stages.trainer.update import UpdateSpec, policy_update

    opt, sched = make_optimizer(model, cfg)
    kw = dict(collective=collective or SINGLE_PROCESS_COLLECTIVE)
    policy_update(model, opt, sched, batch, cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=0), **kw)  # warm-up
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        policy_update(model, opt, sched, batch, cfg, UpdateSpec(bounds=(0.8, 1.28), shadow=False, seed=i + 1), **kw)
        best = min(best, time.perf_counter() - t0)
    return best


def _rank(rank: int, port: int, rows: int, mode: str, repeats: int, out: str) -> None:
    import torch.distributed as dist

    from stages.trainer.collective import DistCollective
    from stages.trainer.distributed import shard_policy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg, model, batch = _setup(rows, mode)
    t = _time_steps(shard_policy(model), cfg, batch, repeats, DistCollective())
    t_max = DistCollective().max(t)
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(t_max))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--mode", default="fp8_rowwise")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mktemp(prefix="fp8rl-dist-")
    mp.start_processes(
        _rank, args=(port, args.rows, args.mode, args.repeats, out), nprocs=2, join=True, start_method="spawn"
    )
    t2 = float(open(out).read())
    torch.set_num_threads(2)
    cfg, model, batch = _setup(args.rows, args.mode)
    t1 = _time_steps(model, cfg, batch, args.repeats)
    print(f"mode {args.mode}, {args.rows} rows, best of {args.repeats}")
    print(
        f"1 process (2 threads): {t1:.3f} s   2 ranks (1 thread each): {t2:.3f} s   ratio: {t2 / t1:.3f} (goal <= 1.15)"
    )


if __name__ == "__main__":
    main()
