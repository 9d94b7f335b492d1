"""Built-in reward rules, with verl's signature ``fn(data_source, solution_str, ground_truth,
extra_info) -> float``: ``char_match``, ``exact_match``, ``gsm8k``, ``math_boxed``.

Each is a pure function of its text arguments, so tests can drive them from tables.
"""
from __future__ import annotations

import re
from fractions import Fraction

from ..data.task import reward as _char_reward

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def char_match(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """Partial credit in [0, 1]: position-wise character matches over the longer string."""
    return _char_reward(solution_str, str(ground_truth))


def exact_match(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the completion equals the answer after stripping surrounding whitespace."""
    return float(solution_str.strip() == str(ground_truth).strip())


def _gsm8k_number(text: str) -> Fraction | None:
    """The number after the last ``####``, else the last number in ``text`` (commas, ``$`` dropped)."""
    text = text.replace(",", "").replace("$", "")
    if "####" in text:
        found = _NUMBER.search(text.rpartition("####")[2])
        return Fraction(found.group(0)) if found else None
    numbers = _NUMBER.findall(text)
    return Fraction(numbers[-1]) if numbers else None


def gsm8k(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the completion's final number equals the reference's (GSM8K convention:
    ``#### N`` ends a worked answer; a bare reference number works too)."""
    want = _gsm8k_number(str(ground_truth))
    got = _gsm8k_number(solution_str)
    return float(want is not None and got is not None and got == want)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None  # unbalanced: the completion was cut off inside the box


def normalise_math(text: str) -> str:
    """Canonical spelling of a short LaTeX answer: no spaces, ``\\left``/``\\right``, ``$``
    or trailing ``.``; ``\\dfrac``/``\\tfrac`` as ``\\frac``."""
    text = text.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("\\!", "").replace("\\,", "").replace("$", "")
    text = "".join(text.split())
    while text.endswith("."):
        text = text[:-1]
    return text


_FRAC = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH = re.compile(r"^(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)$")


def _as_number(text: str) -> Fraction | None:
    """The value of a normalised number or simple fraction (``3``, ``-0.5``, ``\\frac{1}{2}``, ``1/2``)."""
    text = text.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text) else text
    try:
        if _NUMBER.fullmatch(text):
            return Fraction(text)
        match = _FRAC.match(text)
        if match and int(match.group(3)) != 0:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return -value if match.group(1) else value
        match = _SLASH.match(text)
        if match and Fraction(match.group(2)) != 0:
            return Fraction(match.group(1)) / Fraction(match.group(2))
    except (ValueError, ZeroDivisionError):
        return None
    return None


def math_boxed(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the completion's last ``\\boxed{}`` matches the reference: numerically when
    both parse as numbers or simple fractions, else as normalised strings."""
    got = last_boxed(solution_str)
    if got is None:
        return 0.0
    reference = str(ground_truth)
    reference = last_boxed(reference) if "\\boxed{" in reference else reference
    if reference is None:
        return 0.0
    got, reference = normalise_math(got), normalise_math(reference)
    got_value, want_value = _as_number(got), _as_number(reference)
    if got_value is not None and want_value is not None:
        return float(got_value == want_value)
    return float(got == reference)


def gsm8k_answer(solution_str: str) -> str | None:
    """The number ``gsm8k`` would compare, as text (None: no number)."""
    number = _gsm8k_number(solution_str)
    return None if number is None else str(number)


def boxed_answer(solution_str: str) -> str | None:
    """The last ``\\boxed{}`` as ``math_boxed`` compares it (a number's value, else the
    normalised text; None: no box)."""
    got = last_boxed(solution_str)
    if got is None:
        return None
    got = normalise_math(got)
    value = _as_number(got)
    return got if value is None else str(value)


# The answer each built-in compares, for majority votes (eval.n_samples > 1: maj@n).
BUILTIN_ANSWERS = {"char_match": str.strip, "exact_match": str.strip, "gsm8k": gsm8k_answer,
                   "math_boxed": boxed_answer}
BUILTIN_REWARDS = {"char_match": char_match, "exact_match": exact_match, "gsm8k": gsm8k, "math_boxed": math_boxed}
