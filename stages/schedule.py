"""When a step runs the BF16 shadow passes, and the drift signal of every step (issue 15).

``calibration.schedule: fixed`` keeps the paper's rule (steps 1, 1+K, ...:
``stages.context.is_calibration_step``). ``drift`` decides from the previous
step's drift signal (``fp8rl_core.drift``), read back from its ``steps`` row,
and the step of the last calibration (``ctx.calibrator.last_step``, which
checkpoints carry): both come from persisted state, so a resumed or replayed
step decides exactly as the first attempt did.

The signal's reference is the A<0 FP8 ratios of the last calibration step,
read from that step's ``token_stats`` (calibration steps write every token)
and cached per (run, variant, step).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fp8rl_core.drift import Schedule, ks_distance, negative_ratios, thin
from fp8rl_core.losses import importance_ratio
from stages.context import RunContext, is_calibration_step
from stages.io import read_step

_REFERENCE: dict[tuple[str, str, int], torch.Tensor] = {}


def _previous_signal(ctx: RunContext, step: int) -> float | None:
    try:
        row = read_step(ctx, "steps", step)
    except FileNotFoundError:
        return None
    if "drift_signal" not in row.column_names:
        return None
    vals = [v for v in row.column("drift_signal").to_pylist() if v is not None]
    return float(vals[-1]) if vals else None


def shadow_this_step(ctx: RunContext, step: int) -> bool:
    """Does ``step`` run the BF16 shadow passes (and hence calibrate)?"""
    cfg = ctx.cfg
    if cfg.calibration.schedule == "fixed":
        return is_calibration_step(cfg, step)
    last = ctx.calibrator.last_step
    prev = _previous_signal(ctx, step - 1) if last is not None and step - 1 >= 1 else None
    return Schedule.from_config(cfg.calibration).calibrates(step, last, prev)


def _reference(ctx: RunContext, step: int) -> torch.Tensor | None:
    key = (str(ctx.run_dir), ctx.input_variant or ctx.variant, step)
    if key not in _REFERENCE:
        try:
            tok = read_step(ctx, "token_stats", step)
        except FileNotFoundError:
            return None
        col = {n: torch.from_numpy(tok.column(n).to_numpy(zero_copy_only=False).astype(np.float32))
               for n in ("logp_fp8", "old_logp_fp8", "advantage")}
        r8 = importance_ratio(col["logp_fp8"], col["old_logp_fp8"])
        _REFERENCE.clear()  # one reference in force per process is enough
        _REFERENCE[key] = thin(negative_ratios(r8, col["advantage"], torch.ones_like(r8, dtype=torch.bool)))
    return _REFERENCE[key]


def drift_metrics(ctx: RunContext, step: int, r8: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, shadow: bool) -> dict:
    """``drift_signal`` of this step vs the last calibration (0 on a calibration step itself)."""
    if shadow:
        return {"drift_signal": 0.0}
    last = ctx.calibrator.last_step
    ref = _reference(ctx, last) if last is not None else None
    if ref is None:
        return {}
    d = ks_distance(negative_ratios(r8, adv, mask), ref)
    return {"drift_signal": d} if math.isfinite(d) else {}
