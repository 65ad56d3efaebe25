"""``algorithm.correction``: which rollout-vs-trainer mismatch correction weights the loss, and its thresholds.

The corrections and the sources they follow are told in ``fp8rl_core.objective.corrections``;
this is the setting, checked when the config loads (a bad value is one line that
names the key).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fp8rl_core.config.correction_kinds import CORRECTIONS, DEFAULT_CORRECTION, thresholds
from fp8rl_core.config.section import known_name

__all__ = ["CorrectionConfig"]


class CorrectionConfig(BaseModel):
    """The mismatch correction (in force while ``algorithm.tis`` is on)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    mode: str = Field(
        DEFAULT_CORRECTION,
        description="A name in fp8rl_core.config.correction_kinds.CORRECTIONS: token-tis (default: min(rho_t, "
        "algorithm.tis_cap)), seq-tis, token-mis, seq-mis, icepop, geo-mask.",
    )
    lower: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Lower threshold of a masking correction (None: the correction's reference value; "
        "a truncation has none).",
    )
    upper: float | None = Field(
        None,
        ge=1,
        description="Upper threshold / cap (None: the correction's reference value; token-tis takes "
        "algorithm.tis_cap).",
    )
    calibrate: bool = Field(
        False,
        description="Re-set the thresholds on every calibration step from the BF16 shadow pass, so FP8 truncates "
        "or masks as many units as BF16 would at the thresholds above (recorded in bounds); off: fixed.",
    )
    max_factor: float = Field(
        2.0,
        ge=1,
        description="Calibrated thresholds widen at most to this many times the reference's distance from 1 "
        "in log-ratio.",
    )

    @model_validator(mode="after")
    def _known(self) -> "CorrectionConfig":
        known_name(self.mode, CORRECTIONS.kind, CORRECTIONS.names(), key="mode")
        kind = CORRECTIONS.get(self.mode)
        if self.lower is not None and not kind.has_lower:
            raise ValueError(f"lower: correction {self.mode} truncates from above only; it has no lower threshold")
        if self.mode == DEFAULT_CORRECTION and self.upper is not None:
            raise ValueError("upper: token-tis takes its cap from algorithm.tis_cap; leave correction.upper unset")
        lo, hi = thresholds(self.mode, self.lower, self.upper)
        if not lo < hi:
            raise ValueError(f"correction {self.mode}: lower threshold {lo} must be below upper {hi}")
        return self
