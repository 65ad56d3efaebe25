"""The registries of the policy losses, complete: import them from here.

Every loss registers itself in its own module (the token losses in
``fp8rl_core.losses``, the sequence-level GSPO loss in ``fp8rl_core.gspo``);
this module imports each once, so a reader of a registry sees every loss and
no module imports another only for its side effect of registering.
"""

from __future__ import annotations

from fp8rl_core import gspo  # noqa: F401  registers "gspo"
from fp8rl_core.losses import CALIBRATION_UNITS, LOSS_BOUNDS, LOSS_STATISTICS, POLICY_LOSSES

__all__ = ["CALIBRATION_UNITS", "LOSS_BOUNDS", "LOSS_STATISTICS", "POLICY_LOSSES"]
