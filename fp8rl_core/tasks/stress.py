"""The stress task: long column additions with every intermediate written out.

Built to make the paper's failure mechanism reachable on a CPU: responses of
40-120 tokens whose answer follows a worked chain, so quantization noise
compounds over many tokens and one slip anywhere makes the answer wrong.

A problem adds two ``digits``-digit numbers. The prompt is the blank worksheet:
one 9-character cell per column, least significant column first; the response
fills every cell — the two digits, the carry in, the two-digit column sum — then
``#`` and the answer (big-endian)::

    problem   4821 + 3759                      (difficulty 0: 4 digits)
    prompt    Q:1+9+?=??;2+5+?=??;8+7+?=??;4+3+?=??;A:
    response  1+9+0=10;2+5+1=08;8+7+0=15;4+3+1=08;#8580

Why this layout: the response's cells have the prompt's stride, so each digit
the model copies sits at a constant distance behind the position that writes
it, and the carry in is the tens digit written 6 positions earlier — the trick
that made the short synthetic task learnable by a two-layer model
(``fp8rl_core.tasks.synthetic``), at 5-10x the response length. Reading the answer back
from the units digits is the one non-constant-distance copy.

Headroom for RL, as in the short task: the bootstrap's noisy teacher writes
``+0`` for a carry in of 1 with probability ``carry_drop`` (the pupil's slip) and
then continues faithfully, so a clone samples a fully right chain only when it
keeps every carry, while keeping it stays the mode (greedy).

Garbled (docs/method.md, "Failure signals"): a response ``extract_answer`` cannot read (no
``#`` or no integer after it) — the same parser as the short task.

Splits: a hash of ``(difficulty, operands)`` as in ``fp8rl_core.tasks.synthetic``; levels
(:data:`LEVELS`): 0 = 4 digits (~44 tokens), 1 = 6 digits (~62), 2 = 8 digits
(~81), 3 = 11 digits (~111).
"""

from __future__ import annotations

import random

from fp8rl_core.tasks.synthetic import (
    ANSWER_MARKER,
    Draw,
    Problem,
    draw_in_split,
    exact_verify,
    extract_answer,
    hashed_split,
    level_of,
)

__all__ = [
    "LEVELS",
    "CELL",
    "make_problem",
    "demonstration",
    "prompt_length",
    "response_cap",
    "extract_answer",
    "exact_verify",
    "chain",
    "expected_sampled_accuracy",
    "format_prompt",
    "split_of",
    "carry_in_columns",
]

LEVELS: dict[int, int] = {0: 4, 1: 6, 2: 8, 3: 11}  # difficulty -> digits per operand
CELL = 9  # characters per column cell: "a+b+c=tu;"


def _digits(difficulty: int) -> int:
    return level_of(LEVELS, difficulty, "stress")


def split_of(operands: tuple[int, ...], difficulty: int) -> str:
    return hashed_split(f"stress:{difficulty}:{operands}")


def _column_digits(x: int, n: int) -> list[int]:
    return [(x // 10**i) % 10 for i in range(n)]


def format_prompt(operands: tuple[int, int], difficulty: int) -> str:
    n = _digits(difficulty)
    a, b = (_column_digits(x, n) for x in operands)
    return "Q:" + "".join(f"{a[i]}+{b[i]}+?=??;" for i in range(n)) + "A:"


def prompt_length(difficulty: int) -> int:
    """Characters of every prompt of this level (all prompts have one length)."""
    return 2 + CELL * _digits(difficulty) + 2


def response_cap(difficulty: int) -> int:
    """Longest correct response (tokens, EOS included) plus slack of 4."""
    n = _digits(difficulty)
    return CELL * n + 1 + (n + 1) + 1 + 4


def chain(operands: tuple[int, int], n: int, dropped: frozenset[int] = frozenset()) -> tuple[str, str]:
    """(worked chain + '#' + answer, answer). The carry *into* each column in
    ``dropped`` is written as 0 (a faithful wrong solution follows)."""
    a, b = (_column_digits(x, n) for x in operands)
    cells, units, carry = [], [], 0
    for i in range(n):
        c = 0 if i in dropped else carry
        s = a[i] + b[i] + c
        cells.append(f"{a[i]}+{b[i]}+{c}={s // 10}{s % 10};")
        units.append(s % 10)
        carry = s // 10
    digits = ([carry] if carry else []) + units[::-1]
    answer = "".join(map(str, digits)).lstrip("0") or "0"
    return "".join(cells) + ANSWER_MARKER + answer, answer


def carry_in_columns(operands: tuple[int, int], n: int) -> list[int]:
    """Columns that receive a carry of 1 in the correct addition."""
    a, b = (_column_digits(x, n) for x in operands)
    out, carry = [], 0
    for i in range(n):
        if carry:
            out.append(i)
        carry = (a[i] + b[i] + carry) // 10
    return out


def make_problem(index: int, split: str, difficulty: int, seed: int) -> Problem:
    """Problem ``index`` of ``split``: deterministic in all four arguments."""
    n = _digits(difficulty)
    operands = draw_in_split(
        Draw("stress", index, split, difficulty, seed),
        lambda rng: (rng.randrange(10**n), rng.randrange(10**n)),
        split_of,
    )
    solution, answer = chain(operands, n)
    return Problem(
        id=f"str-d{difficulty}-s{seed}-{split}-{index}",
        prompt=format_prompt(operands, difficulty),
        solution=solution,
        answer=answer,
        operands=operands,
    )


def demonstration(problem: Problem, difficulty: int, carry_drop: float, rng: random.Random) -> str:
    """A noisy teacher's response: each carry in dropped with probability ``carry_drop``."""
    if not 0.0 <= carry_drop < 1.0:
        raise ValueError(f"carry_drop must be in [0, 1), got {carry_drop}")
    n = _digits(difficulty)
    dropped = frozenset(c for c in carry_in_columns(problem.operands, n) if rng.random() < carry_drop)
    return chain(problem.operands, n, dropped)[0]


def expected_sampled_accuracy(difficulty: int, carry_drop: float, n: int = 2000, seed: int = 0) -> float:
    """Accuracy of a perfect clone of the noisy teacher (planning aid)."""
    d = _digits(difficulty)
    return (
        sum(
            (1.0 - carry_drop) ** len(carry_in_columns(make_problem(i, "test", difficulty, seed).operands, d))
            for i in range(n)
        )
        / n
    )
