"""A built-in visual task (``data.task=count_squares``): how many coloured squares are drawn on a
small generated image? Every prompt has the same text and one image; the answer is the count.

Images are 56x56 pixels (4 image tokens on the tiny presets' towers): a 4x4 grid of 14-pixel
cells, ``1..max_squares`` of them holding a 12-pixel square of a random dark colour on a white
background (one square per 14x14 patch of the tiny towers; 10-pixel squares in lighter colours
kept the tiny model at chance for 300 SFT steps, docs/vision-language.md).
An example is named by its drawing (``where``), so held-out images are never
trained on even though every prompt's text is the same.
"""
from __future__ import annotations

import random

from .example import Example

QUESTION = "How many squares?"
SIZE, CELL, SQUARE = 56, 14, 12
COLOURS = ((180, 0, 0), (0, 120, 0), (0, 0, 180), (0, 110, 110), (120, 0, 120))


def draw(cells: list[int], colours: list[int]):
    """The image with a square of ``COLOURS[colours[k]]`` in grid cell ``cells[k]`` (row-major)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    per_row = SIZE // CELL
    for cell, colour in zip(cells, colours):
        left = (cell % per_row) * CELL + (CELL - SQUARE) // 2
        top = (cell // per_row) * CELL + (CELL - SQUARE) // 2
        pen.rectangle((left, top, left + SQUARE - 1, top + SQUARE - 1), fill=COLOURS[colour])
    return image


class CountSquaresTask:
    """Count the squares on a generated image (module docstring)."""

    name = "count_squares"

    def __init__(self, max_squares: int = 4) -> None:
        self.max_squares = max_squares

    def sample(self, rng: random.Random) -> Example:
        """One random image and its count, drawn with ``rng``."""
        count = rng.randint(1, self.max_squares)
        cells = sorted(rng.sample(range((SIZE // CELL) ** 2), count))
        colours = [rng.randrange(len(COLOURS)) for _ in cells]
        message = {"role": "user", "content": ({"type": "image"}, {"type": "text", "text": QUESTION})}
        return Example(prompt=QUESTION, answer=str(count), messages=(message,), data_source=self.name,
                       where=f"count_squares image cells={cells} colours={colours}", images=(draw(cells, colours),))

    @property
    def distinct_prompts(self) -> int:
        """How many different drawings :meth:`sample` can produce (cells x colours)."""
        from math import comb

        cells = (SIZE // CELL) ** 2
        return sum(comb(cells, k) * len(COLOURS) ** k for k in range(1, self.max_squares + 1))

    @property
    def max_answer_chars(self) -> int:
        """Longest reference answer, in characters."""
        return len(str(self.max_squares))
