"""When a step runs the BF16 shadow passes, and the drift signal of every step.

The decision is taken here, once, by the train stage, and recorded in its
``steps`` row (``steps.shadow``); everything after reads that record
(``stages.runtime.io.shadow_steps``). A guard's remedy comes first: after a
rollback with ``recalibrate_now`` / ``recalibrate_every_step`` the steps right
after the restored checkpoint shadow (:func:`guard_forces_shadow`, from the
ledger's ``guard`` records). ``calibration.schedule: fixed`` keeps the
paper's rule (steps 1, 1+K, ...). ``drift`` decides from the previous
step's drift signal (``fp8rl_core.calibration.drift``), read back from its ``steps`` row,
and the step of the last calibration (``state.calibrator.last_step``, which
checkpoints carry): both come from persisted state, so a resumed or replayed
step decides exactly as the first attempt did.

The KS signal's reference is the A<0 FP8 ratios of the last calibration step,
read from that step's ``token_stats`` (calibration steps write every token)
and cached per (run, variant, step); the quantile signal needs only the
calibrator's state (alpha and L of the last calibration).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fp8rl_core.calibration.drift import Schedule, negative_ratios, thin
from fp8rl_core.calibration.subsample import choose_size, sample_sequences
from fp8rl_core.objective.losses import importance_ratio
from stages.context import RunEnv, TrainState
from stages.runtime.io import read_step
from stages.runtime.seeds import step_seed

_REFERENCE: dict[tuple[str, str, int], torch.Tensor] = {}


def _previous_signal(env: RunEnv, step: int) -> float | None:
    try:
        row = read_step(env, "steps", step)
    except FileNotFoundError:
        return None
    if "drift_signal" not in row.column_names:
        return None
    vals = [v for v in row.column("drift_signal").to_pylist() if v is not None]
    return float(vals[-1]) if vals else None


def guard_records(env: RunEnv) -> list:
    """Live ``guard`` ledger records that finished (each one rollback, ``flows.campaign.guard``)."""
    return [r for r in env.ledger.records(variant=env.variant) if r.stage == "guard" and r.status == "done"]


def guard_forces_shadow(env: RunEnv, step: int) -> bool:
    """After a rollback with remedy ``recalibrate_now`` / ``recalibrate_every_step``, the steps right
    after the restored checkpoint run the shadow passes and calibrate. Read from the ledger's
    ``guard`` records, so a resumed run keeps the remedy."""
    for r in guard_records(env):
        c, remedy = r.info.get("rollback_to"), r.info.get("remedy")
        if c is None:
            continue
        n = {"recalibrate_now": 1, "recalibrate_every_step": int(r.info.get("remedy_steps", 1))}.get(remedy, 0)
        if int(c) < step <= int(c) + n:
            return True
    return False


def shadow_this_step(env: RunEnv, state: TrainState, step: int) -> bool:
    """Does ``step`` run the BF16 shadow passes (and hence calibrate)? A guard remedy, then the schedule."""
    if step >= 1 and guard_forces_shadow(env, step):
        return True
    previous = lambda: _previous_signal(env, step - 1)  # noqa: E731 (read only where the drift rule needs it)
    return Schedule.decide(env.cfg.calibration, step, state.calibrator.last_step, previous)


def shadow_plan(
    env: RunEnv,
    state: TrainState,
    step: int,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[bool, torch.Tensor | None]:
    """The train stage's one question to the schedule: (shadow passes on ``step``?, ``[N]`` bool rows to
    shadow or None for all). Recorded as ``steps.shadow``."""
    shadow = shadow_this_step(env, state, step)
    return shadow, (shadow_subset(env, step, advantages, response_mask) if shadow else None)


def _reference(env: RunEnv, step: int) -> torch.Tensor | None:
    key = (str(env.run_dir), env.input_variant or env.variant, step)
    if key not in _REFERENCE:
        try:
            tok = read_step(env, "token_stats", step)
        except FileNotFoundError:
            return None
        col = {
            n: torch.from_numpy(tok.column(n).to_numpy(zero_copy_only=False).astype(np.float32))
            for n in ("logp_fp8", "old_logp_fp8", "advantage")
        }
        r8 = importance_ratio(col["logp_fp8"], col["old_logp_fp8"])
        _REFERENCE.clear()  # one reference in force per process is enough
        _REFERENCE[key] = thin(negative_ratios(r8, col["advantage"], torch.ones_like(r8, dtype=torch.bool)))
    return _REFERENCE[key]


def drift_metrics(
    env: RunEnv, state: TrainState, step: int, r8: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, shadow: bool
) -> dict:
    """``drift_signal`` of this step vs the last calibration (0 on a calibration step itself)."""
    if shadow:
        return {"drift_signal": 0.0}
    sched, last = Schedule.from_config(env.cfg.calibration), state.calibrator.last_step
    if last is None:
        return {}
    ref = _reference(env, last) if sched.signal == "ks" else None  # the quantile signal needs only the state
    if sched.signal == "ks" and ref is None:
        return {}
    d = sched.measure(negative_ratios(r8, adv, mask), ref, state.calibrator)
    return {"drift_signal": d} if math.isfinite(d) else {}


# --------------------------------------------------------------------------- subsampled shadow passes


def shadow_subset(env: RunEnv, step: int, advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor | None:
    """``[N]`` bool rows to shadow on ``step`` (``calibration.shadow_target_error`` set), None = all."""
    c = env.cfg.calibration
    if c.shadow_target_error is None:
        return None
    neg_per_seq = ((advantages < 0)[:, None] & (response_mask > 0)).sum(1)
    m = choose_size(neg_per_seq, c.shadow_target_error, c.shadow_failure_prob, c.shadow_min_sequences)
    g = torch.Generator().manual_seed(step_seed(env.cfg.seed, step, 9))  # the same subset on every rank
    return sample_sequences(int(neg_per_seq.numel()), m, g)


def subsample_columns(cols: dict[str, np.ndarray], sample_ids: np.ndarray, cfg, step: int) -> tuple[np.ndarray, dict]:
    """For a calibration step's token columns: (rows with a BF16 shadow, extra ``bounds`` columns).

    Full shadow: every row, the bound columns say m = N and error 0.
    """
    from fp8rl_core.calibration.subsample import BootstrapSpec, bootstrap_lower_error, lower_error_bound

    has16 = np.isfinite(cols["logp_bf16"]) & np.isfinite(cols["old_logp_bf16"])
    adv = cols["advantage"]
    uniq, inv = np.unique(sample_ids, return_inverse=True)
    neg_tok = adv < 0
    neg_per_seq = torch.from_numpy(np.bincount(inv, weights=neg_tok, minlength=len(uniq)).astype(np.int64))
    keep = torch.from_numpy(np.bincount(inv, weights=has16, minlength=len(uniq)) > 0)
    m, n = int(keep.sum()), len(uniq)
    delta = cfg.calibration.shadow_failure_prob
    out = {"shadow_sequences": m, "total_sequences": n, "shadow_failure_prob": delta}
    if m >= n:
        out.update(alpha_level_error=0.0, lower_error_bound=0.0, lower_error_bootstrap=0.0)
        return has16, out

    def ratio(a, b):
        return importance_ratio(torch.from_numpy(a.astype(np.float32)), torch.from_numpy(b.astype(np.float32)))

    r8 = ratio(cols["logp_fp8"], cols["old_logp_fp8"])
    r16 = ratio(np.nan_to_num(cols["logp_bf16"]), np.nan_to_num(cols["old_logp_bf16"]))
    thr = 1.0 - cfg.algorithm.eps_low
    sel = torch.from_numpy(has16 & neg_tok)
    n_sel = int(sel.sum())
    alpha = float((r16[sel] < thr).double().mean()) if n_sel else float("nan")
    b = lower_error_bound(r8[torch.from_numpy(neg_tok)], alpha, m=m, neg_per_seq=neg_per_seq, keep=keep, delta=delta)
    boot = bootstrap_lower_error(
        r8[sel],
        r16[sel],
        torch.from_numpy(inv)[sel],
        BootstrapSpec(threshold=thr, delta=delta, m=m, n_total=n),
        generator=torch.Generator().manual_seed(step_seed(cfg.seed, step, 10)),
    )
    out.update(alpha_level_error=b.level_error, lower_error_bound=b.lower_error_bound, lower_error_bootstrap=boot)
    return has16, out
