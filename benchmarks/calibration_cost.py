"""Cost of Calibrated Clipping next to the policy loss it serves.

For N tokens (default 1M, 10M, 50M) this times

* ``calibrate`` (mode ``calibrated``) on float32 r8, r16, A and a mask, and
* one ``policy_loss`` forward + backward on the same N tokens as ``[N/1024, 1024]``,

and prints medians over ``--repeats`` runs side by side, as wall seconds and as
process CPU seconds (summed over threads: on a CPU shared with other jobs the
wall time inflates, the CPU time much less), plus the growth check: the calibration time
divided by ``N log2 N``, relative to the smallest size, should stay near (or
below) 1 if the cost grows no faster than N log N. Goal: 10M tokens in < 2 s on
a 2-core CPU.

    .venv/bin/python benchmarks/calibration_cost.py [--sizes 1e6 1e7 5e7] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import time

import torch

from fp8rl_core.calibration.calibrated_clipping import StandardClip, calibrate
from fp8rl_core.config.method import CalibrationConfig
from fp8rl_core.objective.losses import LossSpec, policy_loss

T = 1024  # response length of the loss benchmark's [B, T] layout


def _tokens(n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    r16 = torch.randn(n, generator=gen).mul_(0.15).exp_()  # [N] float32
    r8 = torch.randn(n, generator=gen).mul_(0.1).exp_().mul_(r16)  # FP8 noise on top
    adv = torch.randn(n, generator=gen)
    mask = torch.rand(n, generator=gen) < 0.95
    return r8, r16, adv, mask


def _median_time(fn, repeats: int) -> tuple[float, float]:
    """(median wall seconds, median process CPU seconds summed over threads)."""
    walls, cpus = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e6, 1e7, 5e7])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = CalibrationConfig()
    rows = []
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.repeats}: wall s [CPU s]")
    print(
        f"{'tokens':>10} | {'calibrate':>16} | {'loss fwd+bwd':>16} | {'cal/loss':>8} | {'cal CPU/(N log N) rel':>21}"
    )
    for size in args.sizes:
        n = int(size)
        r8, r16, adv, mask = _tokens(n)
        std = StandardClip(0.2, 0.28)
        calibrate(r8[:1000], r16[:1000], adv[:1000], mask[:1000], standard=std, config=cfg)  # warm-up
        cal_med, cal_cpu = _median_time(
            lambda: calibrate(r8, r16, adv, mask, standard=std, config=cfg), args.repeats
        )
        b = max(n // T, 1)
        old = -torch.rand(b, T, generator=torch.Generator().manual_seed(1))  # [B, T]
        logp = (old + r8[: b * T].view(b, T).log()).requires_grad_()
        adv2, mask2 = adv[: b * T].view(b, T), mask[: b * T].view(b, T)

        def loss_step() -> None:
            loss, _ = policy_loss(logp, old, adv2, mask2, LossSpec(lower=0.8, upper=1.28))
            loss.backward()
            logp.grad = None

        loss_med, loss_cpu = _median_time(loss_step, args.repeats)
        r8 = r16 = adv = mask = old = logp = adv2 = mask2 = None  # freed before the next size
        per_nlogn = cal_cpu / (n * math.log2(n))
        rows.append((n, per_nlogn))
        rel = per_nlogn / rows[0][1]
        print(
            f"{n:>10,} | {cal_med:>7.3f} [{cal_cpu:>6.3f}] | {loss_med:>7.3f} [{loss_cpu:>6.3f}] | "
            f"{cal_cpu / loss_cpu:>8.2f} | {rel:>21.2f}"
        )
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak_gb:.1f} GiB; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
