"""The registered rollout-vs-trainer mismatch corrections: unit, rule, reference thresholds.

Plain data (no torch, no pydantic), so that the config can check a setting
against it when it loads and the trainer's numerics (``fp8rl_core.objective.corrections``,
where the definitions and their sources are told) can read it without pydantic.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8rl_core.registry import Registry

__all__ = ["CORRECTIONS", "DEFAULT_CORRECTION", "Correction", "thresholds"]

DEFAULT_CORRECTION = "token-tis"


@dataclass(frozen=True)
class Correction:
    """One mismatch correction: its unit, its rule and its reference thresholds (``lower`` None: none)."""

    unit: str  # token | sequence | geometric
    rule: str  # truncate | masked-is | mask
    lower: float | None
    upper: float
    follows: str

    @property
    def has_lower(self) -> bool:
        """Whether a lower threshold means anything (a truncation only caps from above)."""
        return self.rule != "truncate"


CORRECTIONS: Registry[Correction] = Registry("mismatch correction")
CORRECTIONS.register("token-tis")(Correction("token", "truncate", None, 2.0, "Yao et al. 2025 (TIS)"))
CORRECTIONS.register("seq-tis")(Correction("sequence", "truncate", None, 2.0, "verl seq_is"))
CORRECTIONS.register("token-mis")(Correction("token", "masked-is", 0.0, 2.0, "Liu, Li et al. 2025, token MIS"))
CORRECTIONS.register("seq-mis")(Correction("sequence", "masked-is", 0.0, 2.0, "Liu, Li et al. 2025, Seq-MIS"))
CORRECTIONS.register("icepop")(Correction("token", "masked-is", 0.5, 5.0, "IcePop (Ring-1T)"))
CORRECTIONS.register("geo-mask")(Correction("geometric", "mask", 1.0 / 1.001, 1.001, "verl geo_rs"))


def thresholds(name: str, lower: float | None = None, upper: float | None = None) -> tuple[float, float]:
    """``(lower, upper)`` of correction ``name``: the given values, else its reference ones (no lower: 0)."""
    c = CORRECTIONS.get(name)
    lo = lower if lower is not None else (c.lower if c.lower is not None else 0.0)
    return float(lo), float(upper if upper is not None else c.upper)
