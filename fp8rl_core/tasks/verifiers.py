"""Reward functions: final-answer extraction and equivalence checking.

Four verifiers, registered by name in :data:`VERIFIERS`:

``"math"`` — :func:`math_equal`, for real benchmarks and math training sets.
    1. *Extract* the final answer from the response (:func:`extract_final_answer`),
       in this order of trust: the last ``\\boxed{...}`` (or ``\\fbox``/
       ``\\framebox``; nested braces are matched), the last "final answer is X" /
       "answer: X", the synthetic task's ``#`` marker ending the response
       (which also reads GSM8K's ``#### 18``; a markdown heading is not a
       marker), and finally the last number in the text. A response with
       none of these has no answer and is *wrong* — never an error.
    2. *Compare* with the gold answer: equal strings (after whitespace and
       ``$`` clean-up) are equal, and two plain decimals that differ by more than
       a relative 1e-4 are unequal, without further work; otherwise both sides are
       parsed by math-verify (LaTeX and plain expressions; its normalisation
       strips ``\\text{units}``, ``\\left``/``\\right``, ``^\\circ``, thousands
       separators) and compared by ``math_verify.verify`` (numeric within
       precision, symbolic simplification, sets, intervals, tuples, matrices).

    math-verify bounds its work with ``signal.alarm``, which only works in the
    main thread of a process. Outside the main thread :func:`math_equal` turns
    its timeout off rather than crash; the caller must then bound wall-clock
    time, as ``stages.grade.pool`` does with one process per worker that it kills
    when an item runs past its limit.

``"synthetic"`` — :func:`fp8rl_core.tasks.synthetic.exact_verify`: a pure string check of the
    synthetic task's answer, cheap enough to run inline.

``"code"``, ``"code_expr"`` — :class:`SandboxedVerifier`: the response's program (or a
    program built from its expression) runs against the problem's tests in the sandbox,
    in batches (``stages.grade.code``); marked ``sandboxed``, never called as a function.

A verifier is ``(response: str, gold: str) -> bool``.
"""

from __future__ import annotations

import re
import threading
from typing import Callable

from fp8rl_core.registry import Registry
from fp8rl_core.tasks.synthetic import ANSWER_MARKER, exact_verify, extract_answer

Verifier = Callable[[str, str], bool]
VERIFIERS: Registry[Verifier] = Registry("verifier")

_BOX_COMMANDS = ("\\boxed", "\\fbox", "\\framebox")
_ANSWER_IS_RE = re.compile(
    r"(?:final answer|the answer|answer)\s*(?:is|:)\s*(?:[:=]\s*)?(?P<ans>[^\n]+)", re.IGNORECASE
)
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox``/``\\framebox``) in
    ``text``, braces matched so ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``.
    ``\\boxed 5`` (no braces) gives ``5``. ``None`` if there is none or the
    last one is unterminated."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _clean(ans: str) -> str:
    """Strip math delimiters and a sentence's final period, repeatedly."""
    previous = None
    while previous != ans:
        previous = ans
        ans = ans.strip().rstrip(".").strip().strip("$")
        ans = re.sub(r"^\\[(\[]|\\[)\]]$", "", ans)
    return ans.strip()


def extract_final_answer(response: str) -> str | None:
    """The final answer written in ``response`` (see the module docstring for
    the order of rules), or ``None`` when the response states no answer."""
    boxed = last_boxed(response)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    said = list(_ANSWER_IS_RE.finditer(response))
    if said:
        ans = said[-1].group("ans")
        # Keep a math span whole; otherwise stop at the end of the sentence.
        if not ans.lstrip().startswith("$"):
            ans = re.split(r"(?<=[^\d])\.(?:\s|$)", ans)[0]
        ans = _clean(ans)
        if ans:
            return ans
    if ANSWER_MARKER in response:
        tail = response.rpartition(ANSWER_MARKER)[2]
        # Only a short last-line answer ("#### 18", "234#432"); a markdown heading
        # ("## Step 2\n...") is not an answer marker.
        if "\n" not in tail.strip() and len(tail.strip()) <= 64:
            ans = _clean(tail)
            if ans:
                return ans
    numbers = _NUMBER_RE.findall(response)
    if numbers:
        return numbers[-1].replace(",", "").replace(" ", "")
    return None



def extract_for(verifier: str, response: str) -> str | None:
    """The answer ``response`` states, as the verifier ``verifier`` reads it (None: none)."""
    return extract_answer(response) if verifier == "synthetic" else extract_final_answer(response)


def answer_parser(verifier: str) -> Callable[[str], str | None]:
    """The answer parser of a verifier: a response it returns None for is *garbled*
    (docs/method.md, "Failure signals"; ``fp8rl_core.signals.failure_signals``)."""
    return lambda response: extract_for(verifier, response)

def _normalise(s: str) -> str:
    return re.sub(r"\s+", "", s.strip().strip("$")).rstrip(".")


_PLAIN_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def _plain_number(s: str) -> float | None:
    s = _normalise(s).replace(",", "").replace("{,}", "")
    return float(s) if _PLAIN_NUMBER_RE.fullmatch(s) else None


def _clearly_different_numbers(a: str, b: str) -> bool:
    """Both sides plain decimals that differ by more than a relative 1e-4: no
    math-verify rule makes those equal, so sympy need not be asked."""
    x, y = _plain_number(a), _plain_number(b)
    return x is not None and y is not None and abs(x - y) > 1e-4 * max(1.0, abs(x), abs(y))


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _parse(math_verify, text: str, timeout: int | None):
    configs = [math_verify.LatexExtractionConfig(boxed_match_priority=0), math_verify.ExprExtractionConfig()]
    return math_verify.parse("\\boxed{" + text + "}", extraction_config=configs, parsing_timeout=timeout)


@VERIFIERS.register("math")
def math_equal(response: str, gold: str, *, timeout_s: int | None = 5) -> bool:
    """Is the final answer of ``response`` mathematically equal to ``gold``?

    ``gold`` is a bare answer (``"\\frac{1}{2}"``, ``"27.0"``, ``"(3,\\pi/2)"``),
    not a response. ``timeout_s`` bounds each math-verify parse/compare (whole
    seconds, ``signal.alarm``); it is disabled outside the main thread. A
    response without an answer, an unparsable one or a timed-out comparison is
    ``False``.
    """
    pred = extract_final_answer(response)
    if pred is None:
        return False
    if _normalise(pred) == _normalise(gold):
        return True
    if _clearly_different_numbers(pred, gold):
        return False
    import math_verify  # heavy (sympy): imported on first real comparison

    timeout = timeout_s if _in_main_thread() else None
    try:
        gold_parsed = _parse(math_verify, gold, timeout)
        pred_parsed = _parse(math_verify, pred, timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except Exception:  # math-verify raises on pathological input; that answer is simply not verified
        return False


VERIFIERS.register("synthetic")(exact_verify)


class SandboxedVerifier:
    """A verifier that runs the response's program: graded in the sandbox, in batches
    (``stages.grade.code.grade_code_responses``), never called as a function."""

    sandboxed = True

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, response: str, gold: str) -> bool:
        raise RuntimeError(f"verifier {self.name!r} runs the response's program: it is graded in the sandbox "
                           "(stages.grade.code.grade_code_responses), not called")


for _name in ("code", "code_expr"):  # a whole program; a program built from one expression
    VERIFIERS.register(_name)(SandboxedVerifier(_name))


def is_sandboxed(name: str) -> bool:
    """Does the verifier ``name`` run the response's program (graded in the sandbox)? An importable
    ``module:function`` verifier never does."""
    return ":" not in name and name in VERIFIERS and bool(getattr(VERIFIERS.get(name), "sandboxed", False))


def get_verifier(name: str) -> Verifier:
    """The verifier registered as ``name`` (``KeyError`` listing valid names)."""
    return VERIFIERS.get(name)
