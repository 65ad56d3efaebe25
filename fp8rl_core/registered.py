"""Every registry a config names, complete, and the check of a config against them.

Every loss registers itself in its own module (the token losses in
``fp8rl_core.objective.losses``, the sequence-level GSPO loss in ``fp8rl_core.objective.gspo``);
this module imports each once, so a reader of a registry sees every loss and
no module imports another only for its side effect of registering. The config
(``fp8rl_core.config``) names registry entries as plain strings;
:func:`unknown_names` is where those names meet the registries (called where
configs are loaded, ``flows.campaign.configuration``), so the registries stay the one list.
"""

from __future__ import annotations

from fp8rl_core.calibration.clip_modes import CLIP_MODES
from fp8rl_core.calibration.estimators import LOWER_ESTIMATORS
from fp8rl_core.objective import gspo  # noqa: F401  registers "gspo"
from fp8rl_core.objective.advantages import ADVANTAGE_ESTIMATORS
from fp8rl_core.objective.losses import AGGREGATIONS, CALIBRATION_UNITS, LOSS_BOUNDS, LOSS_STATISTICS, POLICY_LOSSES
from fp8rl_core.precision.conversion import TRAIN_PRECISIONS
from fp8rl_core.precision.rollout import ROLLOUT_PRECISIONS
from fp8rl_core.tasks.kinds import TASK_KINDS

__all__ = ["CALIBRATION_UNITS", "LOSS_BOUNDS", "LOSS_STATISTICS", "POLICY_LOSSES", "unknown_names"]

# config key -> (how to read it from a CampaignConfig, the registry that lists its valid names)
NAMED_BY_REGISTRY = {
    "algorithm.advantage": (lambda c: c.algorithm.advantage, ADVANTAGE_ESTIMATORS),
    "algorithm.loss": (lambda c: c.algorithm.loss, POLICY_LOSSES),
    "algorithm.loss_agg": (lambda c: c.algorithm.loss_agg, AGGREGATIONS),
    "precision.train": (lambda c: c.precision.train, TRAIN_PRECISIONS),
    "precision.rollout": (lambda c: c.precision.rollout, ROLLOUT_PRECISIONS),
    "calibration.mode": (lambda c: c.calibration.mode, CLIP_MODES),
    "calibration.estimator": (lambda c: c.calibration.estimator, LOWER_ESTIMATORS),
    "task.kind": (lambda c: c.task.kind, TASK_KINDS),
}


def unknown_names(cfg) -> list[str]:
    """One message per config key whose value no registry holds: ``key: unknown <kind> 'x'; valid: ...``."""
    out = []
    for key, (read, registry) in NAMED_BY_REGISTRY.items():
        name = read(cfg)
        if name not in registry:
            out.append(f"{key}: unknown {registry.kind} {name!r}; valid: {', '.join(registry.names())}")
    return out
