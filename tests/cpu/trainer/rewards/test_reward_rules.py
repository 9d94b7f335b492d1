"""The built-in reward rules, table-driven, near misses included."""
from __future__ import annotations

import pytest

from polyfsdp.trainer.rewards.rules import BUILTIN_REWARDS, char_match, exact_match, gsm8k, last_boxed, math_boxed


@pytest.mark.parametrize("completion,answer,expected", [
    ("bdac", "bdac", 1.0), ("bdax", "bdac", 0.75), ("bdacc", "bdac", 0.8), ("", "ab", 0.0), ("", "", 1.0),
])
def test_char_match_is_todays_partial_credit(completion, answer, expected):
    assert char_match("x", completion, answer, {}) == pytest.approx(expected)


@pytest.mark.parametrize("completion,answer,expected", [
    ("42", "42", 1.0), ("  42\n", "42", 1.0), ("42", " 42 ", 1.0),
    ("42.", "42", 0.0), ("4 2", "42", 0.0), ("Paris", "paris", 0.0), ("", "", 1.0),
])
def test_exact_match_compares_stripped_strings(completion, answer, expected):
    assert exact_match("x", completion, answer, {}) == expected


@pytest.mark.parametrize("completion,answer,expected", [
    ("3+4=7. #### 7", "3+4=7. #### 7", 1.0),          # worked reference: its #### number
    ("so 7 apples #### 7", "7", 1.0),                 # bare reference number
    ("#### 1,200", "1200", 1.0),                      # commas dropped
    ("#### $18", "18", 1.0),                          # dollar sign dropped
    ("#### 18.0", "18", 1.0),                         # numeric compare
    ("#### -3", "-3", 1.0),
    ("there are 5 then 12", "12", 1.0),               # no ####: the last number
    ("#### 12 apples, 13 pears", "12", 1.0),          # after ####: the first number
    ("12 #### 13", "12", 0.0),                        # #### wins over earlier numbers
    ("#### 17", "#### 71", 0.0),                      # near miss: digits swapped
    ("#### 7.5", "7", 0.0),
    ("there are 12 then 5", "12", 0.0),               # the last number, not any number
    ("no number here", "3", 0.0),
    ("####", "3", 0.0),
])
def test_gsm8k_compares_the_final_number(completion, answer, expected):
    assert gsm8k("openai/gsm8k", completion, answer, {}) == expected


@pytest.mark.parametrize("text,expected", [
    ("so \\boxed{42}.", "42"), ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{{a}+{b}}", "{a}+{b}"), ("\\boxed{12", None), ("no box", None),
])
def test_last_boxed_takes_the_last_balanced_box(text, expected):
    assert last_boxed(text) == expected


MATH_TABLE = [
    ("The answer is \\boxed{42}", "42", 1.0),
    ("\\boxed{42.}", "42", 1.0),                                   # trailing dot
    ("\\boxed{ 42 }", "42", 1.0),                                  # spaces
    ("\\boxed{42.0}", "42", 1.0),                                  # numeric compare
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0),              # \dfrac
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),               # equal fractions
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),                        # decimal vs fraction
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),                        # slash fraction
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{\\left(1,2\\right)}", "(1, 2)", 1.0),               # \left \right and spaces
    ("\\boxed{x^2+1}", "x^2 + 1", 1.0),                            # normalised strings
    ("\\boxed{1} ... \\boxed{2}", "2", 1.0),                       # the last box counts
    ("\\boxed{2} ... \\boxed{1}", "2", 0.0),
    ("\\boxed{43}", "42", 0.0),                                    # near misses
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{0.51}", "\\frac{1}{2}", 0.0),
    ("42", "42", 0.0),                                             # no box at all
    ("\\boxed{42", "42", 0.0),                                     # cut off inside the box
    ("\\boxed{x^2-1}", "x^2+1", 0.0),
    ("\\boxed{7}", "\\boxed{7}", 1.0),                             # boxed reference
]


@pytest.mark.parametrize("completion,answer,expected", MATH_TABLE)
def test_math_boxed_compares_the_last_box(completion, answer, expected):
    assert math_boxed("math", completion, answer, {}) == expected


def test_every_builtin_has_verls_signature_and_returns_a_float():
    for name, fn in BUILTIN_REWARDS.items():
        value = fn("src", "#### 1 \\boxed{1}", "1", {"response_ids": [1, 2]})
        assert isinstance(value, float) and 0.0 <= value <= 1.0, name
