"""Evaluation metrics over k samples per problem: avg@k, pass@k, maj@k.

Inputs are per-problem lists of the k samples' correctness (``bool``) and, for
maj@k, their extracted answers (``str | None``; ``None`` = no answer).

* **avg@k** — mean correctness over all samples of all problems (the expected
  accuracy of one sample; avg@1 with temperature 1 is the campaign's headline).
* **pass@k** — probability that at least one of k samples is correct, estimated
  without bias from ``n >= k`` samples of which ``c`` are correct (Chen et al.
  2021, "Evaluating Large Language Models Trained on Code", eq. 1)::

      pass@k = 1 - C(n - c, k) / C(n, k)

  computed as the stable product ``1 - prod_{i=n-c+1..n} (1 - k / i)``; drawing
  exactly k samples and counting "any correct" is the same estimator with n = k
  but has higher variance.
* **maj@k** — accuracy of the majority vote: the most frequent extracted answer
  among the k samples (samples without an answer do not vote; ties go to the
  answer seen first) is correct when a sample giving that answer was graded
  correct. A problem where no sample answers scores 0.

All functions return a fraction in [0, 1] averaged over problems.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence


def _check_nonempty(per_problem: Sequence[Sequence[object]], what: str) -> None:
    if not per_problem:
        raise ValueError(f"{what}: no problems given")
    for i, samples in enumerate(per_problem):
        if not samples:
            raise ValueError(f"{what}: problem {i} has no samples")


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """Mean correctness of all samples (each problem weighted equally)."""
    _check_nonempty(correct, "avg@k")
    return sum(sum(map(bool, s)) / len(s) for s in correct) / len(correct)


def pass_at_k_single(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """Mean unbiased pass@k over problems (each needs at least k samples)."""
    _check_nonempty(correct, "pass@k")
    return sum(pass_at_k_single(len(s), sum(map(bool, s)), k) for s in correct) / len(correct)


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """Most frequent non-``None`` answer; ties go to the one seen first."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a in answers if a is not None and votes[a] == best)


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool]]) -> float:
    """Majority-vote accuracy. ``answers[i][j]`` and ``correct[i][j]`` describe
    sample j of problem i; answers are compared as strings, so normalise them
    first (e.g. the verifier's extracted answer)."""
    _check_nonempty(correct, "maj@k")
    if len(answers) != len(correct):
        raise ValueError(f"maj@k: {len(answers)} answer lists for {len(correct)} problems")
    total = 0.0
    for i, (ans, cor) in enumerate(zip(answers, correct)):
        if len(ans) != len(cor):
            raise ValueError(f"maj@k: problem {i} has {len(ans)} answers and {len(cor)} grades")
        voted = majority_answer(ans)
        total += float(voted is not None and any(c for a, c in zip(ans, cor) if a == voted))
    return total / len(correct)
