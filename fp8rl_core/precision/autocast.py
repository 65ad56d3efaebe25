"""The autocast every precision mode computes under."""

from __future__ import annotations

import contextlib

import torch

from fp8rl_core.precision.conversion import TRAIN_PRECISIONS
from fp8rl_core.precision.rollout import ROLLOUT_PRECISIONS


def autocast_context(mode: str, device: str | torch.device = "cpu") -> contextlib.AbstractContextManager:
    """The autocast every mode computes under: BF16 on ``device``'s type (cpu or cuda).

    FP8 modes need it too: the non-converted ops (attention, lm_head) run in BF16,
    and the FP8 linears take their output dtype from it.
    """
    if mode not in TRAIN_PRECISIONS and mode not in ROLLOUT_PRECISIONS:
        valid = sorted(set(TRAIN_PRECISIONS.names()) | set(ROLLOUT_PRECISIONS.names()))
        raise KeyError(f"unknown precision mode {mode!r}; valid: {', '.join(valid)}")
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
