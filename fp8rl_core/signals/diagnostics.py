"""Diagnostics of FP8 noise, clipping errors and garbage generations.

Definitions from docs/method.md ("Diagnostics") and Chen et al. 2026 (section 3):

* ``NMAE(x, ref) = sum |x - ref| / sum |ref|`` over valid tokens. Applied to the
  probabilities pi_theta (FP8 vs BF16 shadow) and to the ratios r8 vs r16; the
  paper measures ratio NMAE 1.7x-2.9x the probability NMAE, the *ratio-noise
  amplification* (both pi_theta and pi_old are noisy, and their errors do not
  cancel).
* Over-clipped token (FP8 silences a token BF16 would train on): A < 0,
  ``r16 >= 1 - eps_low`` and ``r8 < L`` (L = the lower bound in use).
  Under-clipped (FP8 trains on a token BF16 would silence): A < 0,
  ``r16 < 1 - eps_low`` and ``r8 >= L``.
* Clip shares per advantage sign and per entropy bin: which tokens the lower
  bound silences. (In the Parquet tables the same binning is a SQL GROUP BY over
  ``token_stats``; the in-memory version here serves tests and live logging.)
* ``garbled_score``: a cheap text heuristic to flag the garbage outputs that
  follow an entropy surge (docs/method.md, "Failure signals").

All tensor inputs are ``[...]`` of one shape (flattened), float32/float64,
``mask`` bool or 0/1; outputs are Python floats, bool tensors or small dicts.
"""

from __future__ import annotations

import math
import unicodedata

import torch

__all__ = [
    "clip_shares_by_sign",
    "entropy_binned_clip_shares",
    "garbled_components",
    "garbled_score",
    "is_garbled",
    "nmae",
    "noise_amplification",
    "over_clipped_mask",
    "under_clipped_mask",
]

_NAN = float("nan")


def _flat(*ts: torch.Tensor) -> list[torch.Tensor]:
    shapes = {tuple(t.shape) for t in ts}
    if len(shapes) != 1:
        raise ValueError(f"diagnostics expect tensors of one shape, got {sorted(shapes)}")
    return [t.reshape(-1) for t in ts]


def nmae(x: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    """``sum |x - ref| / sum |ref|`` over valid tokens where both are finite.

    Accumulates in float64. Returns NaN when no token is valid, +inf when
    ``sum |ref| = 0`` but the difference is not.
    """
    x, ref, mask = _flat(x, ref, mask)
    m = mask.bool() & torch.isfinite(x) & torch.isfinite(ref)
    xd, rd = x[m].to(torch.float64), ref[m].to(torch.float64)
    if xd.numel() == 0:
        return _NAN
    num, den = float((xd - rd).abs().sum()), float(rd.abs().sum())
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return num / den


def noise_amplification(
    logp8: torch.Tensor,
    logp16: torch.Tensor,
    old_logp8: torch.Tensor,
    old_logp16: torch.Tensor,
    mask: torch.Tensor,
) -> dict[str, float]:
    """Probability and ratio NMAE of FP8 against BF16, and their quotient.

    Args: ``[B, T]`` (or any one shape) log-probs of pi_theta and pi_old in FP8
    and in the BF16 shadow pass, and the valid-token mask.

    Returns ``prob_nmae`` (pi_theta), ``old_prob_nmae`` (pi_old), ``ratio_nmae``
    (r8 vs r16, ratios as in the loss: ``exp(clamp(dlogp, -20, 20))``) and
    ``amplification = ratio_nmae / prob_nmae`` (NaN if prob_nmae is 0).
    """

    def ratio(lp: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.clamp(lp.double() - old.double(), -20.0, 20.0))

    prob = nmae(logp8.double().exp(), logp16.double().exp(), mask)
    old_prob = nmae(old_logp8.double().exp(), old_logp16.double().exp(), mask)
    rat = nmae(ratio(logp8, old_logp8), ratio(logp16, old_logp16), mask)
    amp = rat / prob if prob and math.isfinite(prob) else _NAN
    return {"prob_nmae": prob, "old_prob_nmae": old_prob, "ratio_nmae": rat, "amplification": amp}


def over_clipped_mask(
    r8: torch.Tensor, r16: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, eps_low: float, lower: float
) -> torch.Tensor:
    """Bool, same shape as ``r8``: A<0, r16 >= 1 - eps_low, r8 < lower (FP8 wrongly silences)."""
    neg = mask.bool() & (advantages < 0)
    return neg & (r16 >= 1.0 - eps_low) & (r8 < lower)


def under_clipped_mask(
    r8: torch.Tensor, r16: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, eps_low: float, lower: float
) -> torch.Tensor:
    """Bool, same shape as ``r8``: A<0, r16 < 1 - eps_low, r8 >= lower (FP8 wrongly trains)."""
    neg = mask.bool() & (advantages < 0)
    return neg & (r16 < 1.0 - eps_low) & (r8 >= lower)


def clip_shares_by_sign(
    r: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *, lower: float, upper: float
) -> dict[str, float]:
    """Clip shares split by advantage sign.

    ``neg_lower_share`` = share of A<0 tokens with r < L (gradient zeroed);
    ``pos_upper_share`` = share of A>0 tokens with r > H (gradient zeroed);
    ``neg_upper_share`` / ``pos_lower_share``: the same bounds crossed on the
    other sign (no clip there, the PPO min keeps the gradient), for
    completeness; ``n_neg``/``n_pos`` the counts. NaN share where a sign has no
    token.
    """
    r, advantages, mask = _flat(r, advantages, mask)
    m = mask.bool() & torch.isfinite(r)
    neg, pos = m & (advantages < 0), m & (advantages > 0)
    below, above = r < lower, r > upper
    c = torch.stack(
        [neg.sum(), pos.sum(), (neg & below).sum(), (neg & above).sum(), (pos & below).sum(), (pos & above).sum()]
    )
    n_neg, n_pos, nl, nu, pl, pu = (int(v) for v in c.tolist())

    def share(k: int, n: int) -> float:
        return k / n if n else _NAN

    return {
        "n_neg": float(n_neg),
        "n_pos": float(n_pos),
        "neg_lower_share": share(nl, n_neg),
        "neg_upper_share": share(nu, n_neg),
        "pos_lower_share": share(pl, n_pos),
        "pos_upper_share": share(pu, n_pos),
    }


def entropy_binned_clip_shares(
    entropy: torch.Tensor,
    r: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    lower: float,
    upper: float,
    edges: list[float] | tuple[float, ...],
) -> list[dict[str, float]]:
    """Clip shares per token-entropy bin: one row per bin ``[edges[i], edges[i+1])``.

    The last bin includes its right edge; tokens outside ``[edges[0], edges[-1]]``
    are left out. Each row: ``bin_lo``, ``bin_hi``, ``n_tokens``, ``n_neg``,
    ``n_pos``, ``clipfrac_lower`` [A<0, r<L] and ``clipfrac_upper`` [A>0, r>H]
    as shares of the bin's tokens, ``neg_lower_share`` as a share of the bin's
    A<0 tokens (NaN where a bin is empty).
    """
    entropy, r, advantages, mask = _flat(entropy, r, advantages, mask)
    e = list(edges)
    if len(e) < 2 or any(b <= a for a, b in zip(e, e[1:])):
        raise ValueError(f"edges must be strictly increasing with at least 2 values, got {e}")
    m = mask.bool() & torch.isfinite(r) & torch.isfinite(entropy)
    m &= (entropy >= e[0]) & (entropy <= e[-1])
    g = torch.tensor(e, dtype=entropy.dtype, device=entropy.device)
    b = torch.bucketize(entropy, g, right=True) - 1  # bin i: e[i] <= x < e[i+1]
    nb = len(e) - 1
    b = torch.clamp(b, 0, nb - 1)  # x == e[-1] joins the last bin
    neg, pos = advantages < 0, advantages > 0
    stats = []
    for sel in (m, m & neg, m & pos, m & neg & (r < lower), m & pos & (r > upper)):
        stats.append(torch.bincount(b[sel], minlength=nb))
    n, nn, npos, cl, cu = (s.tolist() for s in stats)
    rows = []
    for i in range(nb):
        rows.append(
            {
                "bin_lo": float(e[i]),
                "bin_hi": float(e[i + 1]),
                "n_tokens": float(n[i]),
                "n_neg": float(nn[i]),
                "n_pos": float(npos[i]),
                "clipfrac_lower": cl[i] / n[i] if n[i] else _NAN,
                "clipfrac_upper": cu[i] / n[i] if n[i] else _NAN,
                "neg_lower_share": cl[i] / nn[i] if nn[i] else _NAN,
            }
        )
    return rows


# --------------------------------------------------------------------------- garbled text

_SCRIPT_ALIASES = {"HIRAGANA": "CJK", "KATAKANA": "CJK", "HANGUL": "CJK"}


def _script(ch: str) -> str:
    """Unicode script of a letter, approximated by the first word of its name."""
    name = unicodedata.name(ch, "")
    word = name.split(" ", 1)[0] if name else "UNKNOWN"
    return _SCRIPT_ALIASES.get(word, word)


def _nonprintable_share(text: str) -> float:
    bad = sum(1 for ch in text if ch == "\ufffd" or (not ch.isprintable() and ch not in "\n\t\r"))
    return bad / len(text)


def _script_mixing_share(text: str) -> float:
    """Share of letters in words (maximal letter runs) that mix >= 2 scripts.

    Multilingual text keeps one script per word; broken generations glue
    fragments of several scripts together (``"theм表"``).
    """
    letters = mixed = 0
    word: list[str] = []
    for ch in text + " ":
        if ch.isalpha():
            word.append(ch)
            continue
        if word:
            letters += len(word)
            if len({_script(c) for c in word}) > 1:
                mixed += len(word)
            word = []
    return mixed / letters if letters else 0.0


def _repeat_share(text: str, min_len: int) -> float:
    """Length of the longest substring occurring at least twice (overlaps allowed)
    over the text length: a text with period p scores ``(n - p) / n``.

    Binary search on the length; each probe is one rolling-hash pass (O(n),
    candidate matches verified by comparing the strings). Texts shorter than
    ``min_len`` score 0 (a short answer like "1111" is not a loop).
    """
    n = len(text)
    if n < min_len:
        return 0.0
    codes = [ord(c) for c in text]
    mod, base = (1 << 61) - 1, 1_000_003

    def repeated(length: int) -> bool:
        power = pow(base, length, mod)
        seen: dict[int, int] = {}
        h = 0
        for i, c in enumerate(codes):
            h = (h * base + c) % mod
            if i >= length:
                h = (h - codes[i - length] * power) % mod
            if i >= length - 1:
                start = i - length + 1
                first = seen.setdefault(h, start)
                if first != start and text[first : first + length] == text[start : start + length]:
                    return True
        return False

    lo, hi = 0, n - 1  # invariant: a repeat of length lo exists (0 trivially)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if repeated(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo / n


def garbled_components(text: str, *, min_len: int = 16) -> dict[str, float]:
    """The three parts of ``garbled_score``, each in [0, 1]."""
    if not text:
        return {"nonprintable": 0.0, "script_mixing": 0.0, "repetition": 0.0}
    return {
        "nonprintable": _nonprintable_share(text),
        "script_mixing": _script_mixing_share(text),
        "repetition": _repeat_share(text, min_len),
    }


def garbled_score(text: str, *, min_len: int = 16) -> float:
    """Heuristic garbage score in [0, 1]: the max of the non-printable share,
    the script-mixing share and the longest-repeat share (``garbled_components``).

    Clean text scores near 0; a degenerate loop ("the the the ...") or binary
    junk near 1. It is a cheap flag for dashboards, not a classifier.
    """
    return max(garbled_components(text, min_len=min_len).values())


def is_garbled(text: str, threshold: float = 0.5, *, min_len: int = 16) -> bool:
    """``garbled_score(text) >= threshold``."""
    return garbled_score(text, min_len=min_len) >= threshold
