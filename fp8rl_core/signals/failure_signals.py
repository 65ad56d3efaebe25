"""The failure's observable signals (docs/method.md, "Failure signals"): garbled share and entropy surge.

* Garbled response: one the task's answer parser cannot read (``parse(response)
  is None``). ``garbled_share`` is the share of a step's responses that are
  garbled: the ``steps.garbled_share`` column. (The text heuristic
  ``fp8rl_core.signals.diagnostics.garbled_score`` — repeats, script mixing, junk bytes —
  is a different, softer flag, kept as ``steps.garbled_heuristic_share``.)
* Entropy surge: a step t whose mean token entropy ``e[t]`` exceeds ``factor``
  x the median of the previous ``window`` steps' entropies (``M_t``) and stays
  above that same threshold for at least ``min_steps`` steps (t included);
  defaults 1.5, 10, 3 (config fields ``surge.*``). A step with fewer than
  ``window`` predecessors cannot open a surge. ``surge_onsets`` lists the steps
  that open one; ``surge_mask`` flags every step inside one.

Pure functions over Python sequences: the train stage and the report call the
same code, and the guard of the beyond-the-paper issue reuses it.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence

__all__ = ["garbled_mask", "garbled_share", "surge_onsets", "surge_mask", "first_surge"]


def garbled_mask(responses: Sequence[str], parse: Callable[[str], object | None]) -> list[bool]:
    """Per response: True when ``parse`` cannot read an answer from it."""
    return [parse(r) is None for r in responses]


def garbled_share(responses: Sequence[str], parse: Callable[[str], object | None]) -> float:
    """Share of ``responses`` the parser cannot read (0.0 for no responses)."""
    mask = garbled_mask(responses, parse)
    return sum(mask) / len(mask) if mask else 0.0


def garbled_shares(responses: Sequence[str], parse: Callable[[str], object | None]) -> dict[str, float]:
    """The step's two garbled shares: ``garbled_share`` (the answer parser cannot read the response) and
    ``garbled_heuristic_share`` (:func:`fp8rl_core.signals.diagnostics.is_garbled`); 0.0 without responses."""
    from fp8rl_core.signals.diagnostics import is_garbled

    heuristic = [is_garbled(r) for r in responses]
    return {
        "garbled_share": garbled_share(responses, parse),
        "garbled_heuristic_share": sum(heuristic) / len(heuristic) if heuristic else 0.0,
    }


def _check(factor: float, window: int, min_steps: int) -> None:
    if not factor > 1 or window < 1 or min_steps < 1:
        raise ValueError(f"surge needs factor > 1, window >= 1, min_steps >= 1; got {factor}, {window}, {min_steps}")


def _surge_runs(entropy: Sequence[float], factor: float, window: int, min_steps: int) -> list[tuple[int, int]]:
    """(onset, end exclusive) of every surge, in order; a surge's steps cannot open another."""
    _check(factor, window, min_steps)
    e = [float(x) for x in entropy]
    runs: list[tuple[int, int]] = []
    t = window
    while t < len(e):
        prev = [x for x in e[t - window : t] if not math.isnan(x)]
        if len(prev) == window and not math.isnan(e[t]):
            threshold = factor * statistics.median(prev)
            end = t
            while end < len(e) and e[end] > threshold:
                end += 1
            if end - t >= min_steps:
                runs.append((t, end))
                t = end
                continue
        t += 1
    return runs


def surge_onsets(entropy: Sequence[float], *, factor: float = 1.5, window: int = 10, min_steps: int = 3) -> list[int]:
    """Indices (into ``entropy``, one value per consecutive step) of steps that open a surge."""
    return [a for a, _ in _surge_runs(entropy, factor, window, min_steps)]


def surge_mask(entropy: Sequence[float], *, factor: float = 1.5, window: int = 10, min_steps: int = 3) -> list[bool]:
    """Per step: inside a surge (from its onset while entropy stays above the onset's threshold)."""
    mask = [False] * len(entropy)
    for a, b in _surge_runs(entropy, factor, window, min_steps):
        for i in range(a, b):
            mask[i] = True
    return mask


def first_surge(steps: Sequence[int], entropy: Sequence[float], **kw) -> int | None:
    """The step number (from ``steps``) of the first surge onset, or None."""
    onsets = surge_onsets(entropy, **kw)
    return int(steps[onsets[0]]) if onsets else None
