"""``data=arith_words``: generated arithmetic word problems in GSM8K's shape.

A chat-format prompt (one user message holding the question) and a worked answer that ends
in ``#### N``, scored by the ``gsm8k`` reward. It is small enough for a CPU model, and it
runs the chat-template + GSM8K-reward path end to end with no download. Its text uses only
characters the built-in character tokenizer knows (no newlines, no ``$``).
"""
from __future__ import annotations

import random

from .example import Example

NAMES = ("Tom", "Ana", "Sam", "Lea", "Max", "Mia", "Ben", "Zoe")
ITEMS = ("apples", "pens", "cards", "books", "coins", "eggs", "shells", "stickers")
DATA_SOURCE = "arith_words"


def _add(rng: random.Random, name: str, item: str) -> tuple[str, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
    return question, f"{a}+{b}={a + b}. #### {a + b}"


def _sub(rng: random.Random, name: str, item: str) -> tuple[str, str]:
    a = rng.randint(1, 9)
    b = rng.randint(1, a)
    question = f"{name} has {a} {item} and gives {b} to a friend. How many {item} are left?"
    return question, f"{a}-{b}={a - b}. #### {a - b}"


def _mul(rng: random.Random, name: str, item: str) -> tuple[str, str]:
    a, b = rng.randint(2, 5), rng.randint(2, 9)
    question = f"{name} buys {a} boxes with {b} {item} in each box. How many {item} does {name} buy?"
    return question, f"{a}*{b}={a * b}. #### {a * b}"


def _two_step(rng: random.Random, name: str, item: str) -> tuple[str, str]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    c = rng.randint(1, a + b)
    question = f"{name} has {a} {item}, gets {b} more and then gives away {c}. How many {item} are left?"
    return question, f"{a}+{b}={a + b}. {a + b}-{c}={a + b - c}. #### {a + b - c}"


KINDS = (_add, _sub, _mul, _two_step)
# Distinct questions per (name, item): add 9*9, sub 45, mul 4*8, two-step sum over a, b of a+b.
_PER_NAME_ITEM = 81 + 45 + 32 + sum(a + b for a in range(1, 10) for b in range(1, 10))


class ArithWordsTask:
    """Word problems on one-digit numbers: add, subtract, multiply, or add then subtract."""

    name = "arith_words"
    distinct_prompts = len(NAMES) * len(ITEMS) * _PER_NAME_ITEM
    # Longest worked answer: "9+9=18. 18-1=17. #### 17".
    max_answer_chars = 24

    def sample(self, rng: random.Random) -> Example:
        """One random problem drawn with ``rng``."""
        kind = rng.choice(KINDS)
        question, answer = kind(rng, rng.choice(NAMES), rng.choice(ITEMS))
        return Example(prompt=question, answer=answer, messages=({"role": "user", "content": question},),
                       data_source=DATA_SOURCE, where=f"arith_words problem {question!r}")
