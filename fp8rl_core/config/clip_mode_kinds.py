"""The clip modes as data: what each ``calibration.mode`` asks of the trainer beyond its bounds.

Plain data (no torch, no pydantic), so that the config can refuse a combination a mode
cannot run when it loads, and the trainer reads what to compute from the record, never
from the mode's name. The bounds themselves are the modes' functions
(``fp8rl_core.calibration.clip_modes.CLIP_MODES``, the same names).

=====================  ==============  ========================================================
mode                   clip decided    what it needs
                       on the ratio of
=====================  ==============  ========================================================
standard               training        nothing
calibrated             training        BF16 shadow passes on calibration steps
calibrated_lower_only  training        the same
relaxed_lower          training        nothing
bapo                   training        a no-grad forward before every update (per-update rule)
bapo_joint_every_k     training        BF16 shadow passes on calibration steps
oracle                 BF16            a BF16 pi_old every step and a BF16 forward of every
                                       micro-batch in every epoch; low-precision training
                                       (else nothing to correct); one process; the PPO loss
=====================  ==============  ========================================================

**The oracle** (``oracle``, for CPU experiments, docs/method.md "Comparison modes"): every
mini-batch, each token's clip decision is taken on its BF16 ratio r16 = pi_theta / pi_old,
both from BF16 forwards of the same master weights, against the standard bounds
1 - eps_low and 1 + eps_high and the dual clip c; the loss and its gradient stay the
training precision's. It clips exactly as BF16 would, so it bounds what matching BF16's
clipping can recover.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl_core.registry import Registry

__all__ = ["CLIP_MODE_KINDS", "ClipModeKind", "cost_warning", "refusals"]


@dataclass(frozen=True)
class ClipModeKind:
    """One clip mode's demands on the trainer (the module docstring's table)."""

    decides_on_bf16: bool = False  # each token's clip decision is taken on its BF16 ratio, every mini-batch
    losses: tuple[str, ...] | None = None  # the policy losses it can decide for (None: every loss)
    one_process: bool = False  # refused on several ranks
    cost: str = ""  # what it costs beyond a standard step, said where it runs on a GPU ("" : nothing to say)


CLIP_MODE_KINDS: Registry[ClipModeKind] = Registry("clip mode")
for _name in ("standard", "calibrated", "calibrated_lower_only", "relaxed_lower", "bapo", "bapo_joint_every_k"):
    CLIP_MODE_KINDS.register(_name)(ClipModeKind())
CLIP_MODE_KINDS.register("oracle")(
    ClipModeKind(
        decides_on_bf16=True,
        losses=("ppo",),
        one_process=True,
        cost="a BF16 pi_old pass every step and a BF16 forward of every micro-batch in every epoch "
        "(the policy update 1.3x its CPU seconds per step on tiny-cpu, docs/calibration.md); meant for CPU "
        "experiments",
    )
)


def refusals(cfg) -> list[str]:
    """One line per setting of ``cfg`` (a ``CampaignConfig``) that its clip mode cannot run with.

    A name no registry holds is left to the load's name check."""
    mode = cfg.calibration.mode
    if mode not in CLIP_MODE_KINDS:
        return []
    kind, out = CLIP_MODE_KINDS.get(mode), []
    where = f"calibration.mode {mode} clips on the BF16 ratio"
    if kind.decides_on_bf16:
        from fp8rl_core.config.precision_kinds import PRECISION_MODES

        train = cfg.precision.train
        if train in PRECISION_MODES and not PRECISION_MODES.get(train).quantized:
            out.append(
                f"{where}, and precision.train {train} is not quantized: there is nothing to correct; "
                "use calibration.mode standard"
            )
        if cfg.calibration.shadow_target_error is not None:
            out.append(
                f"{where} of every token: leave calibration.shadow_target_error unset (it subsamples the BF16 passes)"
            )
        if cfg.calibration.initial_lower is not None or cfg.calibration.initial_upper is not None:
            out.append(
                f"{where} against the standard bounds 1 - eps_low, 1 + eps_high: leave "
                "calibration.initial_lower and initial_upper unset"
            )
    if kind.losses is not None and cfg.algorithm.loss not in kind.losses:
        out.append(
            f"calibration.mode {mode} takes the clip decisions of the {', '.join(kind.losses)} loss only; "
            f"algorithm.loss is {cfg.algorithm.loss}"
        )
    return out


def cost_warning(cfg, *, on_gpu: bool) -> str | None:
    """The one line a run of ``cfg`` (a ``CampaignConfig``) states on a GPU when its clip mode has a cost to
    state (its record's ``cost``), else None."""
    mode = cfg.calibration.mode
    cost = CLIP_MODE_KINDS.get(mode).cost if mode in CLIP_MODE_KINDS else ""
    return f"calibration.mode {mode} on a GPU costs {cost}" if cost and on_gpu else None
