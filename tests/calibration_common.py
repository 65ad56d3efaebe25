"""What the calibration tests share: the standard PPO clip they calibrate against (BF16's reference)."""

from __future__ import annotations

from fp8rl_core.calibration.calibrated_clipping import StandardClip

EPS_LOW, EPS_HIGH = 0.2, 0.28
STANDARD = StandardClip(EPS_LOW, EPS_HIGH)
