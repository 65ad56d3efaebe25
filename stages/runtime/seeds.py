"""The campaign's derived seeds: one per (step, purpose), one per prompt group. Pure integer arithmetic,
stable across processes, hosts and rank counts (no ``hash()``, no global RNG)."""

from __future__ import annotations


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A per-(step, purpose) seed, stable across processes (no ``hash()``)."""
    return (seed * 1_000_003 + step * 10_007 + salt * 101 + 1) % (2**62)


def rollout_seed(seed: int, step: int, round_: int, prompt_index: int) -> int:
    """The sampling seed of one prompt group: (campaign seed, step, DAPO round, the prompt's
    global index in the step's draw). Independent of the number of ranks (``stages.runtime.rollout_plan``)."""
    return (step_seed(seed, step, 1 + round_) * 1_000_003 + prompt_index) % (2**62)


__all__ = ["rollout_seed", "step_seed"]
