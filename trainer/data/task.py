"""The built-in verifiable task (no download needed): reverse a string of letters.

Task: reverse a short string of letters. Prompt ``"cadb="``, answer ``"bdac"``. The reward
gives partial credit: the fraction of answer positions that are right, divided by the
longer of the answer and the completion, so it lies in [0, 1] and is 1 only for an exact
answer. A 2-layer model of 0.23M parameters learns it in about a CPU minute.
"""
from __future__ import annotations

import random

from .example import Example


class ReverseTask:
    """Reverse a string of ``min_len..max_len`` letters drawn from ``alphabet``."""

    name = "reverse"

    def __init__(self, alphabet: str = "abcdefgh", min_len: int = 3, max_len: int = 5) -> None:
        if not alphabet or not alphabet.isalpha():
            raise ValueError(f"task alphabet must be non-empty letters, got {alphabet!r}")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"task lengths need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        self.alphabet, self.min_len, self.max_len = alphabet, min_len, max_len

    def sample(self, rng: random.Random) -> Example:
        """One random example drawn with ``rng``."""
        n = rng.randint(self.min_len, self.max_len)
        s = "".join(rng.choice(self.alphabet) for _ in range(n))
        return Example(prompt=s + "=", answer=s[::-1])

    @property
    def distinct_prompts(self) -> int:
        """How many different prompts :meth:`sample` can produce."""
        k = len(set(self.alphabet))
        return sum(k ** n for n in range(self.min_len, self.max_len + 1))

    @property
    def max_answer_chars(self) -> int:
        """Longest reference answer, in characters."""
        return self.max_len


def reward(completion: str, answer: str) -> float:
    """Partial credit in [0, 1]: position-wise matches over the longer of the two strings."""
    if not answer and not completion:
        return 1.0
    matches = sum(a == b for a, b in zip(completion, answer))
    return matches / max(len(completion), len(answer))
