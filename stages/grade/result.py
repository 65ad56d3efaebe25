"""The outcome of grading one response, shared by the math graders (``stages.grade.pool``) and the
code graders (``stages.data.code_benchmarks``), so neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "timeout", "error", "no_answer"]


@dataclass(frozen=True)
class GradeResult:
    """Outcome of one item. ``extracted`` is the final answer read from the
    response (``None``: no answer), for majority voting and logs."""

    id: str
    correct: bool
    extracted: str | None
    status: Status
    seconds: float
    detail: str = ""
    fraction: float | None = None  # code verifiers: share of test cases passed
