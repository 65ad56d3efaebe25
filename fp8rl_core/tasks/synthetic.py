"""The synthetic reasoning task: column addition with a worked solution.

A problem adds two or three non-negative integers. Operands are written least
significant digit first ("little-endian") and zero-padded to the level's width,
so every prompt of a level has the same length and a batch never needs padding::

    problem   347 + 85
    prompt    Q:743+580=?A:
    response  234#432<eos>

The response is a short worked solution followed by the answer marker ``#`` and
the final answer in the usual (big-endian) notation. The worked solution is the
column addition itself: the digit of each column, least significant first
(7+5=12 -> 2, carry 1; 4+8+1=13 -> 3, carry 1; 3+0+1=4 -> 4), plus the final
carry when it is not zero; the answer is those digits read back, without leading
zeros.

Why this layout: with both the operands and the work little-endian, the digits a
column needs sit at a *constant* distance behind the position that writes it, so
a two-layer rotary-attention model finds them after ~450 SFT steps, and every
digit depends only on its column and on the carry of the digit just written —
no look-ahead. With big-endian operands the distance grows by two per column
and the same model was still at 1 % accuracy after 600 steps (measured; the
reversed-operand trick is the one of Lee et al. 2023, "Teaching Arithmetic to
Small Transformers"). Reading the work back in reverse for the answer is an
easy copy the model learns early.

**Headroom for RL** comes from the demonstrations, not from the problems:
:func:`demonstration` writes a worked solution in which every carry is dropped
(the classic pupil's slip: the carry is forgotten, the column digit is written
anyway and the rest of the work follows faithfully) with probability
``carry_drop``. A policy cloned from such a teacher samples the right answer only
when it keeps every carry, about ``E[(1 - carry_drop) ** n_carries]`` of the time
(:func:`expected_sampled_accuracy`), while keeping the carry stays its mode when
``carry_drop < 0.5`` (at 0.45 the clone's greedy accuracy was 52-72 % for a
sampled 43-48 %, measured). RL from the verifier's reward has to learn "always
carry": a single behaviour, shared by every column and every problem, that the
base policy already knows — the setting RL is good at (selecting a procedure
the base model already samples), so the gain is large and fast (+30 points in
5 GRPO steps of 64x8, +45 in 20; ``stages.bootstrap.math`` has the recipe).

**Splits** are disjoint by construction: a hash of ``(difficulty, operands)``
assigns each operand tuple to ``test`` (1 in :data:`TEST_SHARE_DENOM`) or
``train``; :func:`make_problem` draws operands from a seeded stream and rejects
those of the other split. The split does not depend on the seed, so problems of
one seed's train split never appear in another seed's test split either.

Difficulty levels (:data:`LEVELS`): 0 = two 2-digit operands, 1 = two 3-digit
operands (the measured default), 2 = three 3-digit operands (column carries up
to 2), 3 = three 4-digit operands. Levels 2 and 3 are generated and verified
but their bootstrap was not tuned.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Callable, Mapping, TypeVar

ANSWER_MARKER = "#"
TEST_SHARE_DENOM = 10  # one operand tuple in 10 belongs to the test split
SPLITS = ("train", "test")
_L = TypeVar("_L")


@dataclass(frozen=True)
class Level:
    """Shape of the problems of one difficulty level."""

    n_operands: int
    digits: int


LEVELS: dict[int, Level] = {0: Level(2, 2), 1: Level(2, 3), 2: Level(3, 3), 3: Level(3, 4)}


@dataclass(frozen=True)
class Problem:
    """One synthetic problem.

    ``prompt`` is the full model input (no chat template), ``solution`` the
    correct response without the end-of-sequence token, ``answer`` the final
    answer as the verifier compares it (decimal digits).
    """

    id: str
    prompt: str
    solution: str
    answer: str
    operands: tuple[int, ...]


def level_of(levels: Mapping[int, _L], difficulty: int, task: str) -> _L:
    """``levels[difficulty]``; an unknown difficulty is one line naming the valid ones."""
    try:
        return levels[difficulty]
    except KeyError:
        raise ValueError(f"unknown {task} difficulty {difficulty}; valid: {sorted(levels)}") from None


def hashed_split(key: str) -> str:
    """``'test'`` for one key in :data:`TEST_SHARE_DENOM`, else ``'train'``: a pure function of the key."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "little") % TEST_SHARE_DENOM == 0 else "train"


@dataclass(frozen=True)
class Draw:
    """Which problem to draw: the task's name, the problem's index and split, the level, the seed."""

    task: str
    index: int
    split: str
    difficulty: int
    seed: int


def draw_in_split(
    d: Draw,
    operands: Callable[[random.Random], tuple[int, ...]],
    split_fn: Callable[[tuple[int, ...], int], str],
) -> tuple[int, ...]:
    """Problem ``d.index``'s operands: ``operands`` drawn from a stream seeded with ``(task, seed,
    difficulty, split, index)`` until ``split_fn`` puts them in ``d.split`` (the other split's are rejected)."""
    if d.split not in SPLITS:
        raise ValueError(f"unknown split {d.split!r}; valid: {SPLITS}")
    if d.index < 0:
        raise ValueError(f"problem index must be >= 0, got {d.index}")
    rng = random.Random(f"fp8rl-{d.task}:{d.seed}:{d.difficulty}:{d.split}:{d.index}")
    while True:
        drawn = operands(rng)
        if split_fn(drawn, d.difficulty) == d.split:
            return drawn


def _level(difficulty: int) -> Level:
    return level_of(LEVELS, difficulty, "synthetic")


def split_of(operands: tuple[int, ...], difficulty: int) -> str:
    """``'test'`` or ``'train'``: a pure function of the problem, never of the seed."""
    return hashed_split(f"{difficulty}:{operands}")


def format_prompt(operands: tuple[int, ...], difficulty: int) -> str:
    """``Q:743+580=?A:`` for 347 + 85: operands written least-significant digit
    first, zero-padded to the level's width."""
    width = _level(difficulty).digits
    return "Q:" + "+".join(str(x).zfill(width)[::-1] for x in operands) + "=?A:"


def prompt_length(difficulty: int) -> int:
    """Characters (= tokens, before BOS) of every prompt of this level."""
    lv = _level(difficulty)
    return len("Q:") + lv.n_operands * lv.digits + (lv.n_operands - 1) + len("=?A:")


def column_work(operands: tuple[int, ...], width: int, dropped: frozenset[int] = frozenset()) -> tuple[str, str]:
    """The worked solution and answer of a column addition.

    Returns ``(work, answer)``: ``work`` is the digit of each of the ``width``
    columns, least significant first, then the final carry if non-zero;
    ``answer`` is ``work`` reversed without leading zeros. The carry *out of*
    every column index in ``dropped`` is forgotten (a faithful wrong solution).
    """
    digits: list[int] = []
    carry = 0
    for col in range(width):
        s = carry + sum((x // 10**col) % 10 for x in operands)
        digits.append(s % 10)
        carry = 0 if col in dropped else s // 10
    if carry:
        digits.extend(int(c) for c in reversed(str(carry)))
    work = "".join(str(d) for d in digits)
    answer = work[::-1].lstrip("0") or "0"
    return work, answer


def carry_columns(operands: tuple[int, ...], width: int) -> list[int]:
    """Columns that produce a non-zero carry in the correct addition."""
    out, carry = [], 0
    for col in range(width):
        s = carry + sum((x // 10**col) % 10 for x in operands)
        carry = s // 10
        if carry:
            out.append(col)
    return out


def make_problem(index: int, split: str, difficulty: int, seed: int) -> Problem:
    """Problem ``index`` of ``split`` — deterministic in all four arguments.

    Operands are drawn uniformly from ``[0, 10**digits)`` by a stream seeded with
    ``(seed, difficulty, split, index)``; a draw of the other split is rejected.
    Different indices may give the same operands (small levels repeat often).
    """
    lv = _level(difficulty)
    operands = draw_in_split(
        Draw("synthetic", index, split, difficulty, seed),
        lambda rng: tuple(rng.randrange(10**lv.digits) for _ in range(lv.n_operands)),
        split_of,
    )
    work, answer = column_work(operands, lv.digits)
    return Problem(
        id=f"syn-d{difficulty}-s{seed}-{split}-{index}",
        prompt=format_prompt(operands, difficulty),
        solution=f"{work}{ANSWER_MARKER}{answer}",
        answer=answer,
        operands=operands,
    )


def demonstration(problem: Problem, difficulty: int, carry_drop: float, rng: random.Random) -> str:
    """A supervised target for ``problem`` from a noisy teacher.

    Each carry of the correct addition is dropped independently with probability
    ``carry_drop`` (``0`` gives ``problem.solution``). The answer after the marker
    always follows the written work, so a dropped carry gives a consistent wrong
    answer, not noise the model could learn to ignore.
    """
    if not 0.0 <= carry_drop < 1.0:
        raise ValueError(f"carry_drop must be in [0, 1), got {carry_drop}")
    width = _level(difficulty).digits
    dropped = frozenset(c for c in carry_columns(problem.operands, width) if rng.random() < carry_drop)
    work, answer = column_work(problem.operands, width, dropped)
    return f"{work}{ANSWER_MARKER}{answer}"


_ANSWER_RE = re.compile(r"-?\d+")


def extract_answer(response: str) -> str | None:
    """The final answer of a response: the text after the last ``#``.

    It must be an integer and nothing else (surrounding whitespace aside), so a
    response that runs on after its answer is not rewarded. ``None`` when there
    is no marker or no well-formed answer — a wrong response, not an error.
    """
    head, marker, tail = response.rpartition(ANSWER_MARKER)
    if not marker:
        return None
    tail = tail.strip()
    return tail if _ANSWER_RE.fullmatch(tail) else None


def exact_verify(response: str, answer: str) -> bool:
    """Reward of the synthetic task: the extracted answer equals ``answer``
    (as integers, so ``0432`` and ``432`` agree)."""
    got = extract_answer(response)
    return got is not None and int(got) == int(answer)


def expected_sampled_accuracy(difficulty: int, carry_drop: float, n: int = 2000, seed: int = 0) -> float:
    """Accuracy of a perfect clone of the noisy teacher on the test split:
    the mean of ``(1 - carry_drop) ** n_carries`` (a planning aid for choosing
    ``carry_drop``; the greedy accuracy of the same clone is 1 for ``carry_drop < 0.5``)."""
    width = _level(difficulty).digits
    total = 0.0
    for i in range(n):
        p = make_problem(i, "test", difficulty, seed)
        total += (1.0 - carry_drop) ** len(carry_columns(p.operands, width))
    return total / n


def response_cap(difficulty: int) -> int:
    """Response tokens a base-accuracy measurement allows (the longest correct response plus slack)."""
    return 2 * _level(difficulty).digits + 4
