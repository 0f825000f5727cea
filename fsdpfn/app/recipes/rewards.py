"""Built-in rewards for ``reward.fn`` (see fsdpfn.app.recipes.reward for the signature).

    reward: {fn: "fsdpfn.app.recipes.rewards:math"}          # the default
    reward: {fn: "fsdpfn.app.recipes.rewards:exact_match"}

``math``: the completion's final answer (the last ``\\boxed{...}`` with balanced braces, else the
last number in the text) against the row's ``answer``, 1.0 or 0.0. With the optional extra
``pip install 'fsdpfn[math]'`` the comparison is math-verify's (LaTeX and sympy equivalence:
``\\frac{1}{2}`` equals ``0.5``); without it, numbers are compared numerically (``1,000`` equals
``1000.0``, ``3/4`` equals ``0.75``) and other answers as strings, stripped of spaces and ``$``.

This module imports only the standard library (``math`` imports math_verify, when installed,
through its ``prepare`` hook): reward workers load it without importing torch.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

__all__ = ["math", "exact_match", "addition", "extract_answer", "last_boxed", "last_number",
           "answers_equal", "fallback_equal"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# a number, not the minus of a subtraction ("5-3" ends in 3); 1,000 and 3/4 and .5 are numbers
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?"
                     r"|(?:(?<![\w)\]}])-)?\.\d+")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` whose braces balance (None: there is none)."""
    for match in reversed(list(_BOXED.finditer(text))):
        depth = 1
        for j in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[match.end():j].strip()
    return None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (None: there is none)."""
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion: the last balanced \\boxed{}, else the last number."""
    boxed = last_boxed(completion)
    return boxed if boxed is not None else last_number(completion)


# ---------------------------------------------------------------- comparison


def _as_number(text: str) -> Fraction | None:
    text = text.replace(",", "").replace(" ", "")
    frac = re.fullmatch(r"\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", text)
    if frac:
        text = f"{frac[1]}/{frac[2]}"
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _normalise(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    return re.sub(r"\s+", "", text).rstrip(".")


def fallback_equal(answer: str, predicted: str) -> bool:
    """Numbers numerically (exactly, as fractions), anything else as normalised strings."""
    a, p = _normalise(answer), _normalise(predicted)
    na, np_ = _as_number(a), _as_number(p)
    if na is not None and np_ is not None:
        return na == np_
    return a == p


def _latex(text: str) -> str:
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def _math_verify_equal(mv, answer: str, predicted: str) -> bool | None:
    """math-verify's verdict, or None when it cannot parse the reference answer."""
    # math-verify times its parsing with SIGALRM, which works in the main thread only
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(_latex(answer), parsing_timeout=limit)
    if not gold:
        return None
    pred = mv.parse(_latex(predicted), parsing_timeout=limit)
    return bool(pred) and bool(mv.verify(gold, pred, timeout_seconds=limit))


def _math_verify():
    # looked up per call (a cached import), so that its absence can be simulated in tests
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def answers_equal(answer: str, predicted: str) -> bool:
    """Two plain numbers exactly; else math-verify's equivalence when installed (and able to
    parse the answer), else fallback_equal."""
    a, p = _as_number(_normalise(answer)), _as_number(_normalise(predicted))
    if a is not None and p is not None:  # "1,000" is a number here, a tuple to LaTeX parsers
        return a == p
    mv = _math_verify()
    verdict = None if mv is None else _math_verify_equal(mv, answer, predicted)
    return fallback_equal(answer, predicted) if verdict is None else verdict


# ---------------------------------------------------------------- the rewards


def math(prompt: str, completion: str, *, answer, **_) -> float:
    """1.0 when the completion's final answer (extract_answer) equals ``answer``, else 0.0."""
    if answer is None:
        raise ValueError("the math reward needs each row's reference 'answer', got None")
    predicted = extract_answer(completion)
    if predicted is None:
        return 0.0
    return 1.0 if answers_equal(str(answer), predicted) else 0.0


# run once when a reward worker loads ``math`` (math-verify's import, about half a second, paid
# then and not inside the first call's timeout); other rewards never import it
math.prepare = _math_verify


def exact_match(prompt: str, completion: str, *, answer, **_) -> float:
    """1.0 when the completion equals ``answer`` once both are stripped, else 0.0."""
    if answer is None:
        raise ValueError("the exact_match reward needs each row's reference 'answer', got None")
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def addition(prompt: str, completion: str, *, answer, sample=None, **_) -> float:
    """The embedded addition task's reward: 1.0 when the completion is the decimal sum
    ``answer`` as the task writes it (``sample["reverse"]``: least-significant digit first),
    with no leading zero and nothing else; else 0.0."""
    text = completion.strip()
    if sample and sample.get("reverse"):
        text = text[::-1]
    if not text.isdigit() or (len(text) > 1 and text[0] == "0"):
        return 0.0
    return 1.0 if text == str(answer) else 0.0
