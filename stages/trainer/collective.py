"""The trainer's reductions over ranks: one process (identity) or a ``torch.distributed`` group.

Every batch statistic of a step is global: the token-mean denominator is all-reduced (an
integer count: exact), and the step metrics are computed on the gathered per-token tensors
by the same code as in one process.
"""

from __future__ import annotations

import torch


class Collective:
    """Global reductions of the trainer; this base class is one process (identity)."""

    rank: int = 0
    world_size: int = 1

    def sum(self, x: float) -> float:
        return x

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``[n_r, ...]`` rows in rank order."""
        return t

    def max(self, x: float) -> float:
        return x


class DistCollective(Collective):
    """Reductions over a ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, group=None, device: torch.device | str = "cpu") -> None:
        import torch.distributed as dist

        self.dist, self.group, self.device = dist, group, torch.device(device)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def sum(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, group=self.group)
        return float(t.item())

    def max(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        n = torch.tensor([t.shape[0]], device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        self.dist.all_gather(sizes, n, group=self.group)
        rows = [int(s.item()) for s in sizes]
        big = max(rows)
        src = t.to(self.device)
        if src.shape[0] < big:  # all_gather needs equal shapes: pad, then cut
            src = torch.cat([src, src.new_zeros((big - src.shape[0], *src.shape[1:]))])
        out = [torch.empty_like(src) for _ in range(self.world_size)]
        self.dist.all_gather(out, src.contiguous(), group=self.group)
        return torch.cat([o[:r] for o, r in zip(out, rows)]).to(t.device)


SINGLE_PROCESS_COLLECTIVE = Collective()
