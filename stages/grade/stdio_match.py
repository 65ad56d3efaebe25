"""Whether a program's stdout answers a stdio case: token by token, by the expected token's kind.

Line breaks, trailing spaces and blank lines do not matter (any whitespace
separates tokens). An integer matches only an integer of the same value; a
float or ``p/q`` matches any number within :data:`FLOAT_TOL` absolute or
relative (``0.333333333`` matches ``1/3``, ``5e-1`` matches ``0.5``); any other
token exactly, or ignoring letter case when the statement says answers may be
printed in any case (:func:`statement_allows_any_case`).
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_INT_RE = re.compile(r"[+-]?\d+")
_FRACTION_RE = re.compile(r"([+-]?\d+)/(\d+)")
_ANY_CASE_RE = re.compile(r"\bin any (?:case|register)\b|\bany (?:letter )?case\b|\bcase[- ]insensitive\b", re.I)
FLOAT_TOL = 1e-6


def statement_allows_any_case(statement: str) -> bool:
    """Whether a problem statement accepts letters in any case ("You may print each letter
    in any case", "case-insensitive", Codeforces' "in any register"); default: exact."""
    return bool(_ANY_CASE_RE.search(statement))


def _number(tok: str) -> Fraction | float | None:
    """A token's value as a number: integer, ``p/q`` or a finite float literal; ``None`` otherwise."""
    if _INT_RE.fullmatch(tok):
        return Fraction(int(tok))
    m = _FRACTION_RE.fullmatch(tok)
    if m:
        return Fraction(int(m.group(1)), int(m.group(2))) if int(m.group(2)) else None
    try:
        v = float(tok)
    except ValueError:
        return None
    return v if math.isfinite(v) and tok.lower().lstrip("+-") not in ("inf", "nan", "infinity") else None


def tokens_match(got: str, expected: str, case_insensitive: bool = False) -> bool:
    """One token by the expected token's kind: an integer matches only an integer of the same
    value; a float or ``p/q`` matches any number within 1e-6 absolute or relative (computed
    exactly for two fractions); any other token matches exactly (or ignoring case, when allowed)."""
    if got == expected:
        return True
    if _INT_RE.fullmatch(expected):
        return bool(_INT_RE.fullmatch(got)) and int(got) == int(expected)
    e = _number(expected)
    if e is not None:
        g = _number(got)
        if g is None:
            return False
        if isinstance(g, Fraction) and isinstance(e, Fraction):
            diff = abs(g - e)
            return diff <= Fraction(FLOAT_TOL) or diff <= Fraction(FLOAT_TOL) * abs(e)
        return math.isclose(float(g), float(e), rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL)
    return case_insensitive and got.casefold() == expected.casefold()


def outputs_match(got: str, expected: str, case_insensitive: bool = False) -> bool:
    """Token-wise equality (any whitespace separates tokens) under :func:`tokens_match`."""
    g, e = got.split(), expected.split()
    if g == e:
        return True
    return len(g) == len(e) and all(tokens_match(a, b, case_insensitive) for a, b in zip(g, e))
